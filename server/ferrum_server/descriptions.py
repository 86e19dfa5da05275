"""Builds the descriptive responses (info, capabilities, status, metrics, resource snapshot,
cache metrics) from domain values.

Facts fixed at start-up (the model, the configuration, the memory plan) are read directly.
State that the engine thread mutates is copied there into plain records (`status_of`,
`resources_of`, `cache_metrics_of`), and the protobuf is built from those on the event loop: no
protobuf object reaches the engine thread.

Every figure is produced from what the executor measured or holds; the fields that are always 0
or false here say so in docs/protocol.md ("Figures that are always the same").
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from ferrum_client.pb import executor_pb2 as pb

from ferrum_server import __version__, convert
from ferrum_server.engine import Engine
from ferrum_server.kv.epochs import Epochs
from ferrum_server.kv.manager import KvUsage
from ferrum_server.profiling import device_peak_bytes
from ferrum_server.recorder import EngineStats

# The percentile GetMetrics reports over each latency window (recorder.LATENCY_WINDOW_STEPS).
P95 = 0.95

# Keyed by EngineConfig.dtype, the configuration's string, so describing needs no torch.
_DTYPES = {
    "float32": pb.DATA_TYPE_FP32,
    "bfloat16": pb.DATA_TYPE_BF16,
    "float16": pb.DATA_TYPE_FP16,
}


def _device(engine: Engine) -> pb.Device:
    kind, _, ordinal = engine.config.device.partition(":")
    if kind == "cuda":
        return pb.Device(kind=pb.DEVICE_KIND_CUDA, ordinal=int(ordinal or 0))
    return pb.Device(kind=pb.DEVICE_KIND_CPU)


def model_info(engine: Engine) -> pb.ModelInfo:
    mc = engine.model_config
    return pb.ModelInfo(
        model_id=engine.config.model,
        model_type=mc.model_type,
        num_parameters=mc.num_parameters,
        hidden_size=mc.hidden_size,
        num_layers=mc.num_layers,
        num_heads=mc.num_heads,
        num_kv_heads=mc.num_kv_heads,
        vocab_size=mc.vocab_size,
        max_sequence_length=engine.max_sequence_length,
        dtype=_DTYPES[engine.config.dtype],
        device=_device(engine),
        head_dim=mc.head_dim,
        eos_token_ids=list(mc.eos_token_ids),
        num_experts=mc.moe.num_experts if mc.moe is not None else 0,
        num_experts_per_token=mc.moe.num_experts_per_token if mc.moe is not None else 0,
        metadata={"architecture": json.dumps(mc.architecture)},
    )


def capabilities(engine: Engine) -> pb.ExecutorCapabilities:
    mc = engine.model_config
    attention = [pb.ATTENTION_TYPE_PAGED]
    attention.append(
        pb.ATTENTION_TYPE_GROUPED_QUERY
        if mc.num_kv_heads < mc.num_heads
        else pb.ATTENTION_TYPE_MULTI_HEAD
    )
    return pb.ExecutorCapabilities(
        max_batch_size=engine.config.max_batch_size,
        max_sequence_length=engine.max_sequence_length,
        attention_mechanisms=attention,
        supports_dynamic_batching=True,
        supports_continuous_batching=True,
        supports_tensor_parallelism=True,
        tensor_parallel_size=engine.tp.world_size,
        rank_memory_plans=[_rank_plan(engine, plan) for plan in engine.rank_plans],
        supports_speculative_decoding=True,
        supported_dtypes=list(_DTYPES.values()),
        supported_devices=[pb.Device(kind=pb.DEVICE_KIND_CPU), pb.Device(kind=pb.DEVICE_KIND_CUDA)],
        memory_requirements=memory_requirements(engine),
        supports_native_unified_decode=True,
        execution_resource_authority=pb.EXECUTION_RESOURCE_AUTHORITY_PLAN_RUNTIME,
        supports_server_sampling=True,
        supports_decode_continuation=True,
        supports_prefix_caching=engine.config.prefix_caching,
        supports_swap_preemption=engine.config.swap_space_bytes > 0,
        max_num_logprobs=engine.config.max_num_logprobs,
        admission_limits=pb.AdmissionLimits(
            maximum_active_sequences=engine.config.max_batch_size,
            maximum_scheduled_tokens=engine.config.max_batch_tokens,
        ),
        block_size=engine.config.block_size,
        memory_plan=memory_plan(engine),
        cuda_graph_batch_sizes=list(engine.graph_batch_sizes),
        cache_lease_ms=round(engine.config.cache_lease_s * 1000),
        kv_capacity=kv_capacity(engine),
        supports_admission_batch=True,
        max_admission_batch_tokens=engine.admission_batch_tokens,
    )


def kv_capacity(engine: Engine) -> int:
    """Most tokens one sequence's KV can ever hold: the model's limit or the whole pool."""
    return min(engine.max_sequence_length, engine.memory_plan.num_blocks * engine.kv.block_size)


def memory_requirements(engine: Engine) -> pb.MemoryRequirements:
    """From the measured start-up plan: weights as loaded, the activation peak of the largest
    step spread over its tokens (0 on CPU, where it is not measured), and as overhead what the
    plan holds besides weights, activations and KV blocks sequences may use (CUDA graph memory
    and the graphs' scratch block)."""
    plan = engine.memory_plan
    kv_per_token = plan.block_bytes // engine.config.block_size
    largest_step = max(1, min(engine.config.max_batch_tokens, engine.max_sequence_length))
    graphs = max(plan.cuda_graph_reserved_bytes, plan.cuda_graph_bytes)
    return pb.MemoryRequirements(
        parameter_memory=plan.weights_bytes,
        activation_memory_per_token=-(-plan.activation_peak_bytes // largest_step),
        kv_cache_memory_per_token=kv_per_token // max(1, engine.model_config.num_layers),
        typed_sequence_state=pb.TypedSequenceStateMemory(kv_bytes_per_token=kv_per_token),
        overhead_memory=graphs + plan.reserved_blocks * plan.block_bytes,
    )


def memory_plan(engine: Engine) -> pb.MemoryPlan:
    plan = engine.memory_plan
    return pb.MemoryPlan(
        total_bytes=plan.total_bytes,
        utilization=plan.utilization,
        weights_bytes=plan.weights_bytes,
        activation_peak_bytes=plan.activation_peak_bytes,
        cuda_graph_reserved_bytes=plan.cuda_graph_reserved_bytes,
        cuda_graph_bytes=plan.cuda_graph_bytes,
        kv_cache_bytes=plan.kv_cache_bytes,
        kv_blocks=plan.num_blocks,
        reserved_kv_blocks=plan.reserved_blocks,
        explicit_kv_cache_bytes=plan.explicit_kv,
    )


def _rank_plan(engine: Engine, parts: dict[str, int]) -> pb.MemoryPlan:
    """One rank's plan as gathered at start-up (MemoryPlan.parts() and its block count)."""
    plan = engine.memory_plan
    return pb.MemoryPlan(
        total_bytes=parts["total"],
        utilization=plan.utilization,
        weights_bytes=parts["weights"],
        activation_peak_bytes=parts["activation_peak"],
        cuda_graph_reserved_bytes=parts["cuda_graphs_reserved"],
        cuda_graph_bytes=parts["cuda_graphs"],
        kv_cache_bytes=parts["kv_cache"],
        kv_blocks=parts["num_blocks"],
        reserved_kv_blocks=plan.reserved_blocks,
        explicit_kv_cache_bytes=plan.explicit_kv,
    )


def executor_config(engine: Engine) -> pb.ExecutorConfig:
    cfg = engine.config
    return pb.ExecutorConfig(
        model_info=model_info(engine),
        device=_device(engine),
        dtype=_DTYPES[engine.config.dtype],
        max_batch_size=cfg.max_batch_size,
        max_sequence_length=engine.max_sequence_length,
        attention_config=pb.ExecutorAttentionConfig(
            attention_type=pb.ATTENTION_TYPE_PAGED,
            enable_paged_attention=True,
            block_size=cfg.block_size,
            # One field for the model: its windowed layers share one window (0 = none).
            sliding_window_size=max(engine.model_config.sliding_windows, default=0),
        ),
        memory_config=pb.ExecutorMemoryConfig(
            enable_memory_pooling=True,
            memory_pool_size=_pool_bytes(engine),
            enable_kv_cache_sharing=cfg.prefix_caching,
            max_memory_usage=engine.memory_plan.utilization * 100,
        ),
        optimization_config=pb.OptimizationConfig(
            enable_cuda_graphs=bool(engine.graph_batch_sizes),
            # The cpu and triton kernels fuse residual + norm, rotary, SiLU-and-mul, sampling.
            enable_kernel_fusion=engine.runner.kernels.name != "torch",
        ),
        executor_options={
            "max_batch_tokens": json.dumps(cfg.max_batch_tokens),
            "kernel_backend": json.dumps(engine.runner.kernels.name),
        },
    )


def info_response(engine: Engine) -> pb.GetInfoResponse:
    return pb.GetInfoResponse(
        model_info=model_info(engine),
        capabilities=capabilities(engine),
        config=executor_config(engine),
        executor_instance_id=engine.instance_id,
        executor_type=pb.EXECUTOR_TYPE_CONTINUOUS_BATCH,
        server_version=__version__,
    )


def _weights_bytes(engine: Engine) -> int:
    """Weights and buffers as loaded (measured at start-up)."""
    return engine.memory_plan.weights_bytes


def _pool_bytes(engine: Engine) -> int:
    return engine.kv_cache.numel() * engine.kv_cache.element_size()


def _memory(engine: Engine, used_blocks: int, peak_bytes: int | None) -> pb.ExecutorMemoryUsage:
    weights = _weights_bytes(engine)
    used = weights + used_blocks * engine.memory_plan.block_bytes
    allocated = weights + _pool_bytes(engine)
    return pb.ExecutorMemoryUsage(
        allocated_bytes=allocated,
        used_bytes=used,
        peak_bytes=allocated if peak_bytes is None else peak_bytes,
        utilization_percent=100.0 * used / allocated,
    )


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """What GetStatus reports, read on the engine thread in one go so the figures agree."""

    warmed_up: bool
    stats: EngineStats  # a copy
    active_caches: int
    kv: KvUsage
    peak_bytes: int | None  # None without device allocator counters (CPU)
    faulted: bool


def status_of(engine: Engine) -> EngineStatus:
    """Engine thread: copy the state that GetStatus reports."""
    return EngineStatus(
        warmed_up=engine.warmed_up,
        stats=dataclasses.replace(engine.stats),
        active_caches=len(engine.kv.caches),
        kv=engine.kv.usage(),
        peak_bytes=device_peak_bytes(engine.device),
        faulted=engine.fault is not None,
    )


def status_response(
    engine: Engine, status: EngineStatus, accepting: bool, running_items: int = 0
) -> pb.GetStatusResponse:
    """running_items: items of the step that was running when the call arrived (read on the
    event loop then; the rest of the status is read on the engine thread after that step)."""
    stats = status.stats
    if not status.warmed_up:
        state = pb.EXECUTOR_STATE_INITIALIZING
    elif status.faulted:
        state = pb.EXECUTOR_STATE_ERROR
    elif not accepting:
        state = pb.EXECUTOR_STATE_SHUTDOWN
    elif running_items:
        state = pb.EXECUTOR_STATE_BUSY
    else:
        state = pb.EXECUTOR_STATE_READY
    executor_status = pb.ExecutorStatus(
        state=state,
        is_ready=accepting and not status.faulted,
        current_batch_size=running_items or stats.current_batch_size,
        prefill_operations=stats.prefill_steps,
        decode_operations=stats.decode_steps,
        avg_prefill_time_ms=stats.prefill_time_ns / 1e6 / max(1, stats.prefill_steps),
        avg_decode_time_ms=stats.decode_time_ns / 1e6 / max(1, stats.decode_steps),
        memory_usage=_memory(engine, status.kv.used_blocks, status.peak_bytes),
        active_sequences=status.active_caches,
        steps_executed=stats.steps,
        prefill_tokens=stats.prefill_tokens,
        decode_tokens=stats.decode_tokens,
    )
    return pb.GetStatusResponse(
        status=executor_status, kv_capacity=convert.kv_usage_to_pb(status.kv)
    )


def metrics(engine: Engine) -> pb.ExecutorMetrics:
    # On the event loop, unlike status: the counters are read as they stand, without waiting
    # behind the steps queued on the engine thread.
    stats = engine.stats
    busy_s = (stats.prefill_time_ns + stats.decode_time_ns) / 1e9
    memory = _memory(engine, engine.kv.pool.num_used, device_peak_bytes(engine.device))
    return pb.ExecutorMetrics(
        total_operations=stats.steps,
        prefill_operations=stats.prefill_steps,
        decode_operations=stats.decode_steps,
        avg_prefill_latency=stats.prefill_time_ns / 1e6 / max(1, stats.prefill_steps),
        avg_decode_latency=stats.decode_time_ns / 1e6 / max(1, stats.decode_steps),
        p95_prefill_latency=stats.prefill_window.percentile(P95),
        p95_decode_latency=stats.decode_window.percentile(P95),
        throughput_tps=(stats.prefill_tokens + stats.decode_tokens) / busy_s if busy_s else 0.0,
        memory_efficiency=memory.used_bytes / max(1, memory.allocated_bytes),
        batch_utilization=stats.items / max(1, stats.steps) / engine.config.max_batch_size,
    )


# -- plan-runtime resource snapshot ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Resources:
    """What GetResourceSnapshot reports, copied on the engine thread in one go."""

    kv: KvUsage
    live_caches: int
    pending_admissions: int
    swapped_blocks: int
    swapped_bytes: int
    epochs: Epochs


def resources_of(engine: Engine) -> Resources:
    """Engine thread: copy the live state GetResourceSnapshot reports."""
    caches = engine.kv.caches.values()
    swapped = engine.capacity.swapped.values()
    return Resources(
        kv=engine.kv.usage(),
        live_caches=len(caches),
        pending_admissions=sum(1 for c in caches if c.pending_admission),
        swapped_blocks=sum(s.host_kv.num_blocks for s in swapped),
        swapped_bytes=sum(s.num_bytes for s in swapped),
        epochs=engine.kv.clock.snapshot(),
    )


def resource_snapshot_response(
    engine: Engine, resources: Resources
) -> pb.GetResourceSnapshotResponse:
    plan = engine.memory_plan
    kv = resources.kv
    graphs = max(plan.cuda_graph_reserved_bytes, plan.cuda_graph_bytes)
    static = plan.weights_bytes + graphs
    resident = plan.kv_cache_bytes + plan.activation_peak_bytes
    claimed = static + resident
    domains = [
        pb.ResourceDomainSnapshot(
            domain=0,
            kind=pb.RESOURCE_DOMAIN_KIND_DEVICE_KV,
            block_size=kv.block_size,
            block_bytes=plan.block_bytes,
            total_blocks=kv.total_blocks,
            free_blocks=kv.free_blocks,
            cached_blocks=kv.cached_blocks,
            used_blocks=kv.used_blocks,
            reserved_blocks=kv.reserved_blocks,
            total_bytes=kv.total_blocks * plan.block_bytes,
            used_bytes=kv.used_blocks * plan.block_bytes,
        )
    ]
    swap_bytes = engine.config.swap_space_bytes
    if swap_bytes:
        total = swap_bytes // plan.block_bytes
        domains.append(
            pb.ResourceDomainSnapshot(
                domain=1,
                kind=pb.RESOURCE_DOMAIN_KIND_HOST_SWAP,
                block_size=kv.block_size,
                block_bytes=plan.block_bytes,
                total_blocks=total,
                free_blocks=max(0, total - resources.swapped_blocks),
                used_blocks=resources.swapped_blocks,
                total_bytes=swap_bytes,
                used_bytes=resources.swapped_bytes,
            )
        )
    slots = engine.kv.max_sequences
    return pb.GetResourceSnapshotResponse(
        snapshot=pb.PlanRuntimeResourceSnapshot(
            device_capacity_bytes=plan.total_bytes,
            usable_capacity_bytes=plan.budget_bytes,
            process_claimed_bytes=claimed,
            plan_claimed_bytes=claimed,
            static_bytes=static,
            dynamic_resident_bytes=resident,
            dynamic_free_bytes=(kv.free_blocks + kv.cached_blocks) * plan.block_bytes,
            domains=domains,
            sequence_slots=pb.SequenceSlotSnapshot(
                total=slots,
                used=resources.live_caches,
                free=max(0, slots - resources.live_caches),
                pending_admission=resources.pending_admissions,
            ),
            epochs=convert.epochs_to_pb(resources.epochs),
        )
    )


# -- cache metrics ----------------------------------------------------------------------------


def cache_metrics_of(engine: Engine) -> pb.GetCacheMetricsResponse:
    """Prefix-cache counters, read on the event loop like GetMetrics' (plain ints, read whole)."""
    stats = engine.capacity.stats
    pool = engine.kv.pool
    return pb.GetCacheMetricsResponse(
        snapshot=pb.CacheMetricsSnapshot(
            prefix_caching_enabled=engine.kv.prefix_caching,
            lookups=stats.prefix_lookups,
            hit_lookups=stats.prefix_hit_lookups,
            query_tokens=stats.prefix_query_tokens,
            hit_tokens=stats.prefix_hit_tokens,
            miss_tokens=stats.prefix_query_tokens - stats.prefix_hit_tokens,
            evicted_blocks=pool.num_evictions,
            cached_blocks=pool.num_cached,
        )
    )
