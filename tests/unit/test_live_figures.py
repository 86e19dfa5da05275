"""Live figures and the snapshots built from engine state (issue #14, items 5, 6 and 9):
GetStatus state and batch size, GetMetrics p95 windows, memory requirements from the measured
plan, the fault that poisons the executor, request origins, completion work, the resource and
cache-metrics snapshots, and the bounded execution-event rings."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import pytest
from ferrum_client.pb import executor_pb2 as pb
from ferrum_server import convert, descriptions
from ferrum_server.config import EngineConfig
from ferrum_server.domain import (
    CompletionWork,
    CompletionWorkKind,
    ItemKind,
    RequestOrigin,
    Step,
    StepItem,
)
from ferrum_server.engine import Engine
from ferrum_server.errors import ExecutionFailed, ExecutorFaulted, InvalidArgument
from ferrum_server.execution_events import (
    CacheReleased,
    Dropped,
    Event,
    ExecutionEvents,
    StepCompleted,
)
from ferrum_server.kv.epochs import KV_BLOCKS, Epochs
from ferrum_server.recorder import LATENCY_WINDOW_STEPS, LatencyWindow


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    built = Engine(
        EngineConfig(
            block_size=4, kv_cache_bytes=2 * 1024**2, max_batch_tokens=64, max_batch_size=8
        )
    )
    built.warmup(16)
    yield built
    built.shutdown()


def _prefill(engine: Engine, request_id: str, tokens: list[int]) -> str:
    item = StepItem(ItemKind.PREFILL_CHUNK, request_id, "", tokens, 0, len(tokens))
    return engine.execute(Step([item])).results[0].cache_id


# -- GetStatus ------------------------------------------------------------------------------


def test_status_reports_busy_and_the_running_then_last_batch_size(engine: Engine) -> None:
    items = [StepItem(ItemKind.PREFILL_CHUNK, f"b{i}", "", [1, 2, 3], 0, 3) for i in range(3)]
    seen: list[int] = []
    real = engine.runner.run

    def spy(*args: object) -> object:
        seen.append(engine.stats.running_items)  # what GetStatus reads while this runs
        return real(*args)  # type: ignore[arg-type]

    engine.runner.run = spy  # type: ignore[method-assign]
    try:
        outcome = engine.execute(Step(items))
    finally:
        engine.runner.run = real  # type: ignore[method-assign]
    assert seen == [3]
    busy = descriptions.status_response(engine, descriptions.status_of(engine), True, seen[0])
    assert busy.status.state == pb.EXECUTOR_STATE_BUSY
    assert busy.status.current_batch_size == 3
    idle = descriptions.status_response(
        engine, descriptions.status_of(engine), True, engine.stats.running_items
    )
    assert idle.status.state == pb.EXECUTOR_STATE_READY
    assert idle.status.current_batch_size == 3  # the last step's size, not 0
    for result in outcome.results:
        engine.release(result.cache_id)


# -- GetMetrics -----------------------------------------------------------------------------


def test_latency_window_keeps_the_last_steps_and_takes_the_nearest_rank_p95() -> None:
    window = LatencyWindow(100)
    assert window.percentile(0.95) == 0.0
    for value in range(1, 101):
        window.add(float(value))
    assert window.percentile(0.95) == 95.0
    for _ in range(100):  # the old values leave the window
        window.add(1000.0)
    assert len(window) == 100 and window.percentile(0.5) == 1000.0
    assert LATENCY_WINDOW_STEPS == 1024


def test_metrics_p95_comes_from_the_step_windows(engine: Engine) -> None:
    cache = _prefill(engine, "p95", list(range(10)))
    engine.release(cache)
    metrics = descriptions.metrics(engine)
    assert metrics.p95_prefill_latency > 0
    assert metrics.p95_prefill_latency == engine.stats.prefill_window.percentile(0.95)
    assert metrics.p95_decode_latency == engine.stats.decode_window.percentile(0.95)


# -- memory requirements, config --------------------------------------------------------------


def test_memory_requirements_come_from_the_measured_plan(engine: Engine) -> None:
    real = engine.memory_plan
    engine.memory_plan = dataclasses.replace(
        real,
        activation_peak_bytes=64 * 1000 + 1,  # max_batch_tokens is 64: rounds up
        cuda_graph_reserved_bytes=5000,
        cuda_graph_bytes=7000,
        reserved_blocks=1,
    )
    try:
        needs = descriptions.memory_requirements(engine)
        assert needs.activation_memory_per_token == 1001
        assert needs.overhead_memory == 7000 + real.block_bytes
        assert needs.parameter_memory == real.weights_bytes
    finally:
        engine.memory_plan = real
    on_cpu = descriptions.memory_requirements(engine)
    assert on_cpu.activation_memory_per_token == 0 and on_cpu.overhead_memory == 0


def test_config_reflects_prefix_caching_and_capabilities_carry_kv_capacity(
    engine: Engine,
) -> None:
    config = descriptions.executor_config(engine)
    assert config.memory_config.enable_kv_cache_sharing is engine.config.prefix_caching is True
    pool_tokens = engine.memory_plan.num_blocks * engine.config.block_size
    capabilities = descriptions.capabilities(engine)
    assert capabilities.kv_capacity == min(engine.max_sequence_length, pool_tokens)
    assert config.executor_options["kernel_backend"] == f'"{engine.runner.kernels.name}"'
    assert config.attention_config.sliding_window_size == 0  # the tiny model is all global
    windowed = dataclasses.replace(engine.model_config, sliding_windows=(0, 7))
    real = engine.model_config
    engine.model_config = windowed
    try:
        assert descriptions.executor_config(engine).attention_config.sliding_window_size == 7
    finally:
        engine.model_config = real


# -- request origin ---------------------------------------------------------------------------


def test_request_origin_is_validated_and_counted(engine: Engine) -> None:
    assert convert.request_origin_from_pb(pb.REQUEST_ORIGIN_UNSPECIFIED) is None
    assert convert.request_origin_from_pb(pb.REQUEST_ORIGIN_DIAGNOSTIC) == RequestOrigin.DIAGNOSTIC
    with pytest.raises(InvalidArgument, match="unknown request origin 9"):
        convert.request_origin_from_pb(9)
    probes = engine.recorder.metrics.admission_probes
    before = probes.labels("diagnostic")._value.get()
    decision = engine.try_admit("origin", [1, 2, 3], 0, 3, 0, 0, origin=RequestOrigin.DIAGNOSTIC)
    assert probes.labels("diagnostic")._value.get() == before + 1
    engine.release(decision.cache_id)  # type: ignore[union-attr]


# -- resource snapshot and cache metrics -------------------------------------------------------


def test_resource_snapshot_is_consistent(engine: Engine) -> None:
    cache = _prefill(engine, "res", list(range(9)))  # 3 blocks of 4
    resources = descriptions.resources_of(engine)
    snap = descriptions.resource_snapshot_response(engine, resources).snapshot
    plan = engine.memory_plan
    kv, swap = snap.domains  # the device pool; host swap (on by default)
    assert kv.kind == pb.RESOURCE_DOMAIN_KIND_DEVICE_KV and kv.used_blocks == 3
    assert swap.kind == pb.RESOURCE_DOMAIN_KIND_HOST_SWAP
    assert swap.total_bytes == engine.config.swap_space_bytes and swap.used_blocks == 0
    assert kv.free_blocks + kv.cached_blocks + kv.used_blocks == kv.total_blocks
    assert kv.used_bytes == 3 * plan.block_bytes
    assert snap.sequence_slots.used == 1 and snap.sequence_slots.total == 8
    assert snap.usable_capacity_bytes <= snap.device_capacity_bytes
    assert snap.plan_claimed_bytes <= snap.process_claimed_bytes <= snap.usable_capacity_bytes
    assert snap.dynamic_free_bytes <= snap.dynamic_resident_bytes
    assert snap.static_bytes + snap.dynamic_resident_bytes <= snap.plan_claimed_bytes
    assert snap.static_bytes == plan.weights_bytes
    engine.release(cache)


def test_cache_metrics_count_lookups_hits_and_evictions(engine: Engine) -> None:
    before = descriptions.cache_metrics_of(engine).snapshot
    prompt = list(range(100, 113))  # 3 full blocks + 1
    for request_id in ("cm1", "cm2"):
        decision = engine.try_admit(request_id, prompt, 0, 13, 0)
        cache_id = decision.cache_id  # type: ignore[union-attr]
        cached = decision.cached_prompt_tokens  # type: ignore[union-attr]
        item = StepItem(ItemKind.PREFILL_CHUNK, request_id, cache_id, prompt[cached:], cached, 13)
        engine.execute(Step([item]))
        engine.release(cache_id)
    after = descriptions.cache_metrics_of(engine).snapshot
    assert after.lookups - before.lookups == 2
    assert after.hit_lookups - before.hit_lookups >= 1
    assert after.query_tokens - before.query_tokens == 26
    assert after.hit_tokens - before.hit_tokens >= 12
    assert after.miss_tokens == after.query_tokens - after.hit_tokens
    assert after.evicted_blocks == engine.kv.pool.num_evictions


# -- completion work ----------------------------------------------------------------------------


def test_completion_work_is_proven_empty_until_a_fault() -> None:
    assert CompletionWork.observe(False).kind == CompletionWorkKind.NO_ADDITIONAL_WORK
    unproven = CompletionWork.observe(True)
    assert unproven.kind == CompletionWorkKind.ADDITIONAL_OR_UNPROVEN
    assert unproven.submission_indeterminate and unproven.label == "additional_or_unproven"
    out = convert.completion_work_to_pb(unproven)
    assert out.kind == pb.COMPLETION_WORK_KIND_ADDITIONAL_OR_UNPROVEN
    assert out.submission_indeterminate


def test_complete_and_cancel_observe_their_work(engine: Engine) -> None:
    metrics = engine.recorder.metrics.completion_work
    before = metrics.labels("complete", "none")._value.get()
    cache = _prefill(engine, "done", [5, 6, 7])
    result, work = engine.complete_observed("done", cache, 3, 1)
    assert result.released and work.kind == CompletionWorkKind.NO_ADDITIONAL_WORK
    assert metrics.labels("complete", "none")._value.get() == before + 1
    decision = engine.try_admit("cancel-me", [1, 2], 0, 2, 0)
    released, work = engine.cancel_admission_observed("cancel-me")
    assert released and work.kind == CompletionWorkKind.NO_ADDITIONAL_WORK
    assert decision.cache_id not in engine.kv.caches  # type: ignore[union-attr]


# -- faults ---------------------------------------------------------------------------------------


def test_a_forward_fault_poisons_the_executor() -> None:
    engine = Engine(EngineConfig(block_size=4, kv_cache_bytes=1024**2, max_batch_tokens=32))
    try:
        engine.warmup(8)
        held = _prefill(engine, "held", [1, 2, 3])

        def broken(*args: object) -> object:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        engine.runner.run = broken  # type: ignore[method-assign]
        free_before = engine.kv.pool.num_available
        with pytest.raises(ExecutionFailed):
            _prefill(engine, "x", [1, 2, 3])
        assert engine.kv.pool.num_available == free_before  # the failed item opened nothing
        assert engine.fault == "RuntimeError"
        assert engine.recorder.metrics.faulted._value.get() == 1
        with pytest.raises(ExecutorFaulted):
            _prefill(engine, "y", [1, 2, 3])
        with pytest.raises(ExecutorFaulted):
            engine.try_admit("z", [1, 2, 3], 0, 3, 0)
        status = descriptions.status_response(engine, descriptions.status_of(engine), True)
        assert status.status.state == pb.EXECUTOR_STATE_ERROR and not status.status.is_ready
        _, work = engine.complete_observed("held", held, 3, 1)
        assert work.kind == CompletionWorkKind.ADDITIONAL_OR_UNPROVEN
    finally:
        engine.shutdown()


def test_an_out_of_memory_is_not_a_fault() -> None:
    import torch

    engine = Engine(EngineConfig(block_size=4, kv_cache_bytes=1024**2, max_batch_tokens=32))
    try:

        def oom(*args: object) -> object:
            raise torch.OutOfMemoryError("CUDA out of memory")

        engine.runner.run = oom  # type: ignore[method-assign]
        item = StepItem(ItemKind.PREFILL_CHUNK, "x", "", [1, 2, 3], 0, 3)
        (result,) = engine.execute(Step([item])).results
        assert result.failure is not None and "out of memory" in result.failure.message
        assert engine.fault is None
    finally:
        engine.shutdown()


# -- execution events ------------------------------------------------------------------------


def _stamp() -> tuple[Epochs, list[tuple[tuple[object, int], int]]]:
    return Epochs(1, 0, 1), [(KV_BLOCKS, 1)]  # type: ignore[list-item]


def _released(n: int) -> CacheReleased:
    return CacheReleased(f"r{n}", f"c{n}", "released", 1, n)


def test_a_slow_reader_gets_a_dropped_marker_and_bounded_memory() -> None:
    async def scenario() -> None:
        dropped: list[int] = []
        hub = ExecutionEvents(_stamp, ring_capacity=4, on_drop=dropped.append)  # type: ignore[arg-type]
        assert not hub.active
        hub.publish(_released(0))  # nobody listens: nothing is made
        subscription = hub.subscribe()
        assert subscription.next_sequence == 1
        for n in range(10):
            hub.publish(_released(n))
        await asyncio.sleep(0)  # the one scheduled flush runs
        taken = await subscription.take()
        assert taken[0] == Dropped(6)
        events = [e for e in taken[1:] if isinstance(e, Event)]
        assert [e.sequence for e in events] == [7, 8, 9, 10]
        assert dropped == [6]
        hub.publish(StepCompleted(1, 1, 0, 0, 3, 0, 10))
        await asyncio.sleep(0)
        (step,) = await subscription.take()
        assert isinstance(step, Event) and step.sequence == 11
        hub.unsubscribe(subscription)
        assert not hub.active

    asyncio.run(scenario())


def test_subscriptions_are_bounded_in_number() -> None:
    async def scenario() -> None:
        hub = ExecutionEvents(_stamp, max_subscribers=2)  # type: ignore[arg-type]
        hub.subscribe()
        hub.subscribe()
        with pytest.raises(Exception, match="subscriptions are open"):
            hub.subscribe()

    asyncio.run(scenario())


def test_engine_publishes_steps_releases_and_completions(engine: Engine) -> None:
    async def scenario() -> list[Event | Dropped]:
        subscription = engine.events.subscribe()
        try:
            loop = asyncio.get_running_loop()
            cache = await loop.run_in_executor(None, _prefill, engine, "ev", [1, 2, 3])
            await loop.run_in_executor(None, engine.complete_observed, "ev", cache, 3, 1)
            other = await loop.run_in_executor(None, _prefill, engine, "ev2", [4, 5])
            await loop.run_in_executor(None, engine.release, other)
            taken: list[Event | Dropped] = []
            while len(taken) < 4:
                taken += await asyncio.wait_for(subscription.take(), 10)
            return taken
        finally:
            engine.events.unsubscribe(subscription)

    events = asyncio.run(scenario())
    kinds = [type(e.payload).__name__ for e in events if isinstance(e, Event)]
    assert kinds == ["StepCompleted", "CacheCompleted", "StepCompleted", "CacheReleased"]
    sequences = [e.sequence for e in events if isinstance(e, Event)]
    assert sequences == sorted(sequences) and len(set(sequences)) == 4
    response = convert.execution_event_to_pb(events[1])
    assert response.event.completed.request_id == "ev"
    assert response.event.completed.work.kind == pb.COMPLETION_WORK_KIND_NO_ADDITIONAL_WORK
    assert response.event.epochs.release_epoch > 0
