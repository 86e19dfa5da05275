"""Start-up measurements the memory plan needs: weights, peak activations, CUDA graph memory.

On CUDA the engine runs the largest forwards it will ever accept against a small temporary KV
pool before it sizes the real one, so the pool gets what is actually left rather than a guess.
Everything here runs on the engine thread, before the engine serves anything.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from ferrum_kernels.backend import KernelBackend
from torch import nn

from ferrum_server.cuda_graphs import DecodeGraphs
from ferrum_server.domain import ItemKind, Sampling, StepItem
from ferrum_server.kv.manager import Cache
from ferrum_server.memory_plan import estimate_graph_bytes
from ferrum_server.models import CausalLM, ModelConfig
from ferrum_server.runner import ModelRunner

# (KV pool, scratch block, bucket sizes) -> graphs over that pool, not yet captured
GraphBuilder = Callable[[torch.Tensor, int, tuple[int, ...]], DecodeGraphs]


@dataclass(frozen=True, slots=True)
class ProfileShape:
    """The largest step the engine accepts (from EngineConfig and the model)."""

    block_size: int
    max_batch_tokens: int
    max_batch_size: int
    max_sequence_length: int
    max_num_logprobs: int


@dataclass(frozen=True, slots=True)
class StartupProfile:
    activation_peak_bytes: int
    cuda_graph_bytes: int  # estimate for every bucket (0 when graphs are off)


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (tied tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


def device_total_bytes(device: torch.device) -> int:
    """Device memory (CUDA) or physical host memory (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_free_bytes(device: torch.device) -> int | None:
    """Memory free on the device now, with torch's cache returned first; None on CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def device_used_bytes(device: torch.device) -> int:
    """Memory in use on the device by anyone (0 on CPU): differences of this measure what a
    step of start-up took, non-torch allocations (graph executables, cuBLAS) included."""
    free = device_free_bytes(device)
    return 0 if free is None else device_total_bytes(device) - free


def device_peak_bytes(device: torch.device) -> int | None:
    """The most torch's allocator has held on the device since start-up; None on CPU (no
    allocator counters). Also read while serving, for the status and metrics responses."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def profile_startup(
    model: CausalLM,
    config: ModelConfig,
    kernels: KernelBackend,
    *,
    dtype: torch.dtype,
    device: torch.device,
    shape: ProfileShape,
    graphs: tuple[GraphBuilder, tuple[int, ...]] | None = None,
) -> StartupProfile:
    """Peak activations of the largest forwards and the CUDA graphs' memory (CUDA only)."""
    prefill_tokens = min(shape.max_batch_tokens, shape.max_sequence_length)
    decode_items = min(shape.max_batch_size, shape.max_batch_tokens)
    blocks = max(math.ceil(prefill_tokens / shape.block_size), decode_items)
    # +1: the scratch block the trial graphs write their padding rows to.
    pool = torch.zeros(
        (config.num_layers, 2, blocks + 1, shape.block_size, config.num_kv_heads, config.head_dim),
        dtype=dtype,
        device=device,
    )
    runner = ModelRunner(model, pool, shape.block_size, config.vocab_size, device, kernels)
    activation = _activation_peak(runner, config, shape, prefill_tokens, decode_items, device)
    del runner
    graph_bytes = 0
    if graphs is not None:
        builder, sizes = graphs
        graph_bytes = _graph_estimate(builder, pool, blocks, sizes, device)
    del pool
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return StartupProfile(activation, graph_bytes)


def _activation_peak(
    runner: ModelRunner,
    config: ModelConfig,
    shape: ProfileShape,
    prefill_tokens: int,
    decode_items: int,
    device: torch.device,
) -> int:
    """Peak bytes above the weights and pool over a full-width prefill and a full-batch decode.

    The prefill has the widest activations; the decode has the most LM-head rows (logits and
    sampling are per output row). Both use the costliest sampling settings. The torch reference
    attention also gathers every item's context, which grows with context length rather than
    batch shape: its peak is not covered here (production runs the Triton kernels). Off CUDA
    the steps still run (so the code path is tested on CPU) but nothing is measured.
    """
    cuda = device.type == "cuda"
    vocab = config.vocab_size
    heavy = Sampling(
        temperature=1.0,
        top_k=50,
        top_p=0.9,
        seed=1,
        repetition_penalty=1.1,
        num_logprobs=shape.max_num_logprobs,
        token_mask=b"\xff" * math.ceil(vocab / 8),
    )
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (prefill_tokens,), generator=generator).tolist()
    prefill = StepItem(
        ItemKind.PREFILL_CHUNK, "profile", "", tokens, 0, prefill_tokens, sampling=heavy
    )
    prefill_blocks = math.ceil(prefill_tokens / shape.block_size)
    prefill_seq = Cache("profile", "profile", prefill_tokens, block_ids=list(range(prefill_blocks)))
    # Context-1 decodes, one block each: the batch shape is what sizes their activations.
    decodes = [
        StepItem(
            ItemKind.DECODE, f"profile{i}", f"p{i}", [tokens[i % prefill_tokens]], 0, sampling=heavy
        )
        for i in range(decode_items)
    ]
    decode_seqs = [Cache(f"p{i}", f"profile{i}", 1, block_ids=[i]) for i in range(decode_items)]
    base = 0
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    runner.run([prefill], [prefill_seq])
    runner.run(decodes, decode_seqs)
    if not cuda:
        return 0
    torch.cuda.synchronize(device)
    return max(0, int(torch.cuda.max_memory_allocated(device)) - base)


def _graph_estimate(
    builder: GraphBuilder,
    pool: torch.Tensor,
    scratch_block: int,
    sizes: tuple[int, ...],
    device: torch.device,
) -> int:
    """Capture the two largest buckets on the trial pool and extrapolate to all of them."""
    trial = tuple(sorted(sizes, reverse=True)[:2])
    before = device_used_bytes(device)
    graphs = builder(pool, scratch_block, sizes)
    graphs.capture(trial[:1])
    first = device_used_bytes(device) - before  # static buffers + the largest graph
    second = 0
    if len(trial) > 1:
        graphs.capture(trial[1:])
        second = device_used_bytes(device) - before - first
    del graphs
    return estimate_graph_bytes(first, second, len(sizes))
