"""Builds the descriptive responses (info, capabilities, status, metrics) from domain values.

Facts fixed at start-up (the model, the configuration, the memory plan) are read directly.
State that the engine thread mutates is copied there into plain records (`status_of`), and the
protobuf is built from those on the event loop: no protobuf object reaches the engine thread.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from ferrum_client.pb import executor_pb2 as pb

from ferrum_server import __version__, convert
from ferrum_server.engine import Engine
from ferrum_server.kv.manager import KvUsage
from ferrum_server.profiling import device_peak_bytes
from ferrum_server.recorder import EngineStats

# Keyed by EngineConfig.dtype, the configuration's string, so describing needs no torch.
_DTYPES = {
    "float32": pb.DATA_TYPE_FP32,
    "bfloat16": pb.DATA_TYPE_BF16,
    "float16": pb.DATA_TYPE_FP16,
}
_BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    kv_per_token = engine.memory_plan.block_bytes // engine.config.block_size
    return pb.ExecutorCapabilities(
        max_batch_size=engine.config.max_batch_size,
        max_sequence_length=engine.max_sequence_length,
        attention_mechanisms=attention,
        supports_dynamic_batching=True,
        supports_continuous_batching=True,
        supports_speculative_decoding=True,
        supported_dtypes=list(_DTYPES.values()),
        supported_devices=[pb.Device(kind=pb.DEVICE_KIND_CPU), pb.Device(kind=pb.DEVICE_KIND_CUDA)],
        memory_requirements=pb.MemoryRequirements(
            parameter_memory=_weights_bytes(engine),
            kv_cache_memory_per_token=kv_per_token // max(1, mc.num_layers),
            typed_sequence_state=pb.TypedSequenceStateMemory(kv_bytes_per_token=kv_per_token),
        ),
        supports_native_unified_decode=True,
        execution_resource_authority=pb.EXECUTION_RESOURCE_AUTHORITY_PLAN_RUNTIME,
        supports_server_sampling=True,
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
        ),
        memory_config=pb.ExecutorMemoryConfig(
            enable_memory_pooling=True,
            memory_pool_size=_pool_bytes(engine),
            max_memory_usage=cfg.gpu_memory_utilization * 100,
        ),
        optimization_config=pb.OptimizationConfig(
            enable_cuda_graphs=bool(engine.graph_batch_sizes)
        ),
        executor_options={"max_batch_tokens": json.dumps(cfg.max_batch_tokens)},
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
    return engine.model_config.num_parameters * _BYTES_PER_ELEMENT[engine.config.dtype]


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


def status_of(engine: Engine) -> EngineStatus:
    """Engine thread: copy the state that GetStatus reports."""
    return EngineStatus(
        warmed_up=engine.warmed_up,
        stats=dataclasses.replace(engine.stats),
        active_caches=len(engine.kv.caches),
        kv=engine.kv.usage(),
        peak_bytes=device_peak_bytes(engine.device),
    )


def status_response(engine: Engine, status: EngineStatus, accepting: bool) -> pb.GetStatusResponse:
    stats = status.stats
    if not status.warmed_up:
        state = pb.EXECUTOR_STATE_INITIALIZING
    elif not accepting:
        state = pb.EXECUTOR_STATE_SHUTDOWN
    else:
        state = pb.EXECUTOR_STATE_READY
    executor_status = pb.ExecutorStatus(
        state=state,
        is_ready=accepting,
        current_batch_size=stats.current_batch_size,
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
        throughput_tps=(stats.prefill_tokens + stats.decode_tokens) / busy_s if busy_s else 0.0,
        memory_efficiency=memory.used_bytes / max(1, memory.allocated_bytes),
        batch_utilization=stats.items / max(1, stats.steps) / engine.config.max_batch_size,
    )
