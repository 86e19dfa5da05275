"""Start-up as one recipe: load the model, pick the kernels, plan memory, allocate the KV pool,
capture decode graphs, and hand the engine a frozen set of built parts.

`build_parts` runs on the engine thread (see Engine): every torch call there, construction
included, must come from the one thread that later runs the forwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from ferrum_kernels.backend import KernelBackend, select_backend
from ferrum_kernels.cpu_linear import packed_bytes, release_plain_weights

from ferrum_server import host_memory, logs
from ferrum_server.config import EngineConfig
from ferrum_server.cuda_graphs import (
    DecodeGraphLayout,
    DecodeGraphs,
    GraphCapturer,
    graph_batch_sizes,
    graph_capturer_for,
)
from ferrum_server.kv.manager import KvManager
from ferrum_server.memory_plan import MEMORY_PLAN_PARTS, MemoryPlan, plan_memory
from ferrum_server.models import CausalLM, ModelConfig, load_model, read_config
from ferrum_server.parallel import check_tensor_parallel
from ferrum_server.parallel.group import SINGLE_RANK, TensorParallel
from ferrum_server.parallel.launch import check_launch
from ferrum_server.profiling import (
    ProfileShape,
    StartupProfile,
    device_free_bytes,
    device_total_bytes,
    device_used_bytes,
    model_bytes,
    profile_startup,
)
from ferrum_server.runner import ModelRunner
from ferrum_server.validate import Limits

_LOG = logs.get(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Host memory has no utilisation figure to plan against: a fixed default pool beside the weights.
_CPU_DEFAULT_KV_BYTES = 256 * 1024**2


@dataclass(frozen=True, slots=True)
class BuiltParts:
    """Everything start-up made, in the order it was made."""

    device: torch.device
    dtype: torch.dtype
    model: CausalLM
    model_config: ModelConfig
    max_sequence_length: int
    kernels: KernelBackend
    memory_plan: MemoryPlan
    kv_cache: torch.Tensor  # [L, 2, num_blocks (+ reserved), block_size, kv_heads, head_dim]
    kv: KvManager
    runner: ModelRunner
    limits: Limits
    tp: TensorParallel
    # Every rank's plan (its memory_plan.parts() and block count), in rank order; one entry
    # on one rank.
    rank_plans: tuple[dict[str, int], ...]


def build_parts(
    config: EngineConfig, instance_id: int, tp: TensorParallel = SINGLE_RANK
) -> BuiltParts:
    """load → pick kernels → plan memory → allocate the KV pool → runner → capture graphs.

    Under tensor parallelism every rank runs this same recipe in step (the collectives of the
    start-up profile and of the block-count agreement match up): each loads its shard, and
    every pool gets the same block count, the smallest any rank can hold.
    """
    if config.torch_threads:
        # Per thread under OpenMP: it must be set on the thread that runs the forwards.
        torch.set_num_threads(config.torch_threads)
    device, dtype = torch.device(config.device), TORCH_DTYPES[config.dtype]
    if device.type == "cpu":
        # Before the weights load: set afterwards, it does not stop the page faults.
        host_memory.keep_freed_memory()
    model, model_config = load_model(config.model, dtype=dtype, device=device, tp=tp)
    max_len = _max_sequence_length(config, model_config)
    # LongRoPE rotates with its long or short factors depending on the longest sequence served.
    model.reset_rope_cache(device, max_len)
    kernels = select_backend(device, config.kernel_backend)
    capturer = _graph_capturer(config, device, kernels, tp)
    graph_sizes = graph_batch_sizes(config.graph_max_batch) if capturer is not None else ()
    shapes = _GraphShapes(config.block_size, max_len, graph_sizes)
    plan = _plan_memory(config, model, model_config, kernels, capturer, shapes)
    plan = plan.with_num_blocks(tp.agree_min(plan.num_blocks, device))
    kv_cache = torch.empty(
        (
            model_config.num_layers,
            2,
            # Blocks past num_blocks (the graphs' scratch block) are never handed to a cache.
            plan.num_blocks + plan.reserved_blocks,
            config.block_size,
            model.kv_heads,  # this rank's own (all of them on one rank)
            model_config.head_dim,
        ),
        dtype=dtype,
        device=device,
    )
    if device.type == "cpu":
        # While no page of it is touched yet: the zeroing below then faults in huge pages.
        advised = host_memory.advise_huge_pages(kv_cache) if config.kv_huge_pages else 0
        _LOG.info(
            "kv_pool_huge_pages",
            advised_mib=round(advised / 2**20, 1),
            pool_mib=round(kv_cache.numel() * kv_cache.element_size() / 2**20, 1),
            transparent_huge_pages=host_memory.transparent_huge_pages(),
        )
    kv_cache.zero_()
    kv = KvManager(
        plan.num_blocks,
        config.block_size,
        config.max_batch_size,
        instance_id,
        prefix_caching=config.prefix_caching,
    )
    runner = ModelRunner(
        model, kv_cache, config.block_size, model_config.vocab_size, device, kernels
    )
    if capturer is not None:
        plan = _capture_graphs(runner, model, kernels, capturer, kv_cache, plan, shapes)
    if device.type == "cpu":
        # The served model runs only its packed linears: their plain copies are dead weight.
        # The allocator keeps what it frees, so each plain weight's pages go back to the kernel
        # as it is freed: kept, they stacked under the packed copies made meanwhile, and W1
        # float32's start-up peaked 35-150 MB higher, by how the allocator placed them.
        freed = release_plain_weights(model, after_each=host_memory.return_free_pages)
        _LOG.info("plain_weights_released", mib=round(freed / 1024**2, 1))
        host_memory.return_free_pages()  # and whatever else start-up freed
        # What the weights hold now: the parameters' count misses the packed copies (float32
        # for bfloat16 widened on an AVX2 CPU, twice the plain bytes) and a tied head's.
        plan = plan.with_weights_bytes(model_bytes(model) + packed_bytes(model))
    limits = Limits(
        vocab_size=model_config.vocab_size,
        max_sequence_length=max_len,
        max_batch_tokens=config.max_batch_tokens,
        max_batch_size=config.max_batch_size,
        max_num_logprobs=config.max_num_logprobs,
        instance_id=instance_id,
        require_fencing=config.require_fencing,
    )
    rank_plans = _gather_plans(tp, plan, device)
    tp.clock.take()  # start-up's collectives are not any step's
    return BuiltParts(
        device,
        dtype,
        model,
        model_config,
        max_len,
        kernels,
        plan,
        kv_cache,
        kv,
        runner,
        limits,
        tp,
        rank_plans,
    )


_PLAN_FIELDS = (*MEMORY_PLAN_PARTS, "num_blocks")


def _gather_plans(
    tp: TensorParallel, plan: MemoryPlan, device: torch.device
) -> tuple[dict[str, int], ...]:
    """Every rank's memory plan, in rank order (rank 0 reports them all)."""
    mine = {**plan.parts(), "num_blocks": plan.num_blocks}
    if not tp.is_parallel:
        return (mine,)
    rows = tp.gather_ints([mine[name] for name in _PLAN_FIELDS], device)
    return tuple(dict(zip(_PLAN_FIELDS, row, strict=True)) for row in rows)


def check_split(config: EngineConfig) -> None:
    """Refuse, in one line and before anything starts, a model that cannot be split over the
    configured ranks (and a launch that is not complete)."""
    check_launch(config)
    if config.parallel_size > 1:
        check_tensor_parallel(read_config(Path(config.model)), config.parallel_size)


@dataclass(frozen=True, slots=True)
class _GraphShapes:
    block_size: int
    max_sequence_length: int
    batch_sizes: tuple[int, ...]  # decode batch sizes to capture (empty: no graphs)


def _max_sequence_length(config: EngineConfig, model_config: ModelConfig) -> int:
    longest = config.max_sequence_length or model_config.max_position_embeddings
    if longest > model_config.max_position_embeddings:
        raise ValueError(
            f"max sequence length {longest} exceeds the model's "
            f"{model_config.max_position_embeddings} positions"
        )
    return longest


def _graph_capturer(
    config: EngineConfig, device: torch.device, kernels: KernelBackend, tp: TensorParallel
) -> GraphCapturer | None:
    """How decode graphs get captured here, or None to run every step eagerly."""
    if not config.cuda_graphs:
        return None
    if tp.is_parallel:
        # A captured decode would hold the collectives too; until that is built and measured on
        # GPUs, a split model runs every step eagerly (docs/parallelism.md).
        _LOG.info("cuda_graphs_off", reason="tensor parallelism runs every step eagerly")
        return None
    capturer = graph_capturer_for(device)
    if capturer is None:
        return None
    if kernels.decode_attention is None:
        _LOG.info(
            "cuda_graphs_off",
            reason=f"the {kernels.name} kernels have no graph-safe decode attention",
        )
        return None
    return capturer


def _decode_graphs(
    model: CausalLM,
    kernels: KernelBackend,
    capturer: GraphCapturer,
    kv_cache: torch.Tensor,
    scratch_block: int,
    shapes: _GraphShapes,
    sizes: tuple[int, ...],
) -> DecodeGraphs:
    layout = DecodeGraphLayout(
        block_size=shapes.block_size,
        max_blocks_per_sequence=math.ceil(shapes.max_sequence_length / shapes.block_size),
        scratch_block=scratch_block,
        batch_sizes=sizes,
    )
    return DecodeGraphs(model, kv_cache, layout, kernels, capturer)


def _capture_graphs(
    runner: ModelRunner,
    model: CausalLM,
    kernels: KernelBackend,
    capturer: GraphCapturer,
    kv_cache: torch.Tensor,
    plan: MemoryPlan,
    shapes: _GraphShapes,
) -> MemoryPlan:
    """Capture the decode graphs into the runner; return the plan with their measured bytes."""
    device = kv_cache.device
    before = device_used_bytes(device)
    graphs = _decode_graphs(
        model, kernels, capturer, kv_cache, plan.num_blocks, shapes, shapes.batch_sizes
    )
    graphs.capture()
    runner.graphs = graphs
    plan = plan.with_cuda_graph_bytes(device_used_bytes(device) - before)
    if not plan.graphs_within_reservation:
        # The device keeps (1 - utilisation) spare, so this is a warning, not a failure.
        _LOG.warning(
            "cuda_graphs_over_reservation",
            measured_bytes=plan.cuda_graph_bytes,
            reserved_bytes=plan.cuda_graph_reserved_bytes,
        )
    return plan


def _plan_memory(
    config: EngineConfig,
    model: CausalLM,
    model_config: ModelConfig,
    kernels: KernelBackend,
    capturer: GraphCapturer | None,
    shapes: _GraphShapes,
) -> MemoryPlan:
    """Size the KV pool: on CUDA from measurements of the largest steps (see memory_plan)."""
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    common = {
        "total_bytes": device_total_bytes(device),
        "weights_bytes": model_bytes(model),
        "block_bytes": model_config.kv_bytes_per_token(dtype, model.kv_heads) * config.block_size,
        "reserved_blocks": 1 if capturer is not None else 0,  # the graphs' scratch block
    }
    if device.type != "cuda":
        return plan_memory(
            utilization=1.0,
            activation_peak_bytes=0,
            cuda_graph_bytes=0,
            requested_kv_bytes=config.kv_cache_bytes or _CPU_DEFAULT_KV_BYTES,
            **common,
        )
    profile = _profile(config, model, model_config, kernels, capturer, shapes)
    return plan_memory(
        utilization=config.gpu_memory_utilization,
        activation_peak_bytes=profile.activation_peak_bytes,
        cuda_graph_bytes=profile.cuda_graph_bytes,
        requested_kv_bytes=config.kv_cache_bytes,
        free_bytes=device_free_bytes(device),
        **common,
    )


def _profile(
    config: EngineConfig,
    model: CausalLM,
    model_config: ModelConfig,
    kernels: KernelBackend,
    capturer: GraphCapturer | None,
    shapes: _GraphShapes,
) -> StartupProfile:
    device = model.embed_tokens.weight.device
    shape = ProfileShape(
        block_size=config.block_size,
        max_batch_tokens=config.max_batch_tokens,
        max_batch_size=config.max_batch_size,
        max_sequence_length=shapes.max_sequence_length,
        max_num_logprobs=config.max_num_logprobs,
    )
    graphs = None
    if capturer is not None:

        def build(pool: torch.Tensor, scratch: int, sizes: tuple[int, ...]) -> DecodeGraphs:
            # A capturer (and memory pool) of its own, freed with the trial graphs.
            trial = graph_capturer_for(device)
            assert trial is not None
            return _decode_graphs(model, kernels, trial, pool, scratch, shapes, sizes)

        graphs = (build, shapes.batch_sizes)
    return profile_startup(
        model,
        model_config,
        kernels,
        dtype=model.embed_tokens.weight.dtype,
        device=device,
        shape=shape,
        graphs=graphs,
    )
