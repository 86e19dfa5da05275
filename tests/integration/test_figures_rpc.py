"""Live figures, snapshots, events, penalty scope and completion work through gRPC (issue #14,
items 5, 6, 7 and 9): a real server on 127.0.0.1, the thin client."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from ferrum_client import ExecutorClient, ExecutorError, pb
from helpers_server import LiveServer, start_live_server

PENALTY = 50.0


def _metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


# -- item 5: status, metrics, memory, origin ----------------------------------------------------


def test_status_is_busy_while_a_step_runs_and_keeps_the_last_batch_size(
    live_server: LiveServer, client: ExecutorClient
) -> None:
    engine = live_server.engine
    real = engine.runner.run  # type: ignore[attr-defined]
    started = threading.Event()

    def slow(*args: object) -> object:
        started.set()
        time.sleep(0.5)
        return real(*args)

    engine.runner.run = slow  # type: ignore[attr-defined]
    batch = pb.BatchItems(
        request_ids=["busy-a", "busy-b"],
        kinds=[pb.ITEM_KIND_PREFILL_CHUNK] * 2,
        num_tokens=[3, 3],
        token_ids=[1, 2, 3, 4, 5, 6],
        positions=[0, 0],
        total_prompt_tokens=[3, 3],
    )
    result: list[pb.UnifiedBatchResponse] = []
    worker = threading.Thread(
        target=lambda: result.append(client.unified_batch(pb.UnifiedBatchRequest(items=batch)))
    )
    worker.start()
    try:
        assert started.wait(10)
        busy = client.get_status().status
    finally:
        worker.join(30)
        engine.runner.run = real  # type: ignore[attr-defined]
    assert busy.state == pb.EXECUTOR_STATE_BUSY and busy.current_batch_size == 2
    idle = client.get_status().status
    assert idle.state == pb.EXECUTOR_STATE_READY and idle.current_batch_size == 2
    for cache_id in result[0].results.cache_ids:
        client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))


def test_metrics_report_p95_latencies_after_work(client: ExecutorClient) -> None:
    first = client.prefill(pb.PrefillRequest(request_id="p95", input_tokens=list(range(20))))
    cache = first.completed.kv_cache.cache_id
    token = first.completed.output.token.token_id
    for position in range(20, 23):
        token = client.decode(
            pb.DecodeRequest(cache_id=cache, input_token=token, position=position)
        ).completed.output.token.token_id
    client.release_cache(pb.ReleaseCacheRequest(cache_id=cache))
    metrics = client.get_metrics().metrics
    assert metrics.p95_prefill_latency > 0 and metrics.p95_decode_latency > 0
    assert metrics.p95_decode_latency >= metrics.avg_decode_latency * 0.2


def test_config_and_capabilities_carry_live_memory_figures(client: ExecutorClient) -> None:
    info = client.get_info()
    assert info.config.memory_config.enable_kv_cache_sharing  # prefix caching is on
    capabilities = info.capabilities
    pool_tokens = capabilities.memory_plan.kv_blocks * capabilities.block_size
    assert capabilities.kv_capacity == min(capabilities.max_sequence_length, pool_tokens)
    needs = capabilities.memory_requirements
    assert needs.parameter_memory == capabilities.memory_plan.weights_bytes
    # CPU: no activation measurement, no CUDA graphs.
    assert needs.activation_memory_per_token == 0 and needs.overhead_memory == 0


def test_request_origin_is_validated_and_counted(
    live_server: LiveServer, client: ExecutorClient
) -> None:
    with pytest.raises(ExecutorError) as caught:
        client.try_admit_prefill(
            pb.TryAdmitPrefillRequest(
                request_id="bad-origin",
                input_tokens=[1, 2],
                product_prompt_tokens=2,
                request_origin=7,  # type: ignore[arg-type]
            )
        )
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "request origin 7" in str(caught.value)
    name = "ferrum_executor_admission_probes_total"
    before = _metric(live_server.metrics_url, name, origin="diagnostic")
    admitted = client.try_admit_prefill(
        pb.TryAdmitPrefillRequest(
            request_id="diag",
            input_tokens=[1, 2],
            product_prompt_tokens=2,
            request_origin=pb.REQUEST_ORIGIN_DIAGNOSTIC,
        )
    ).admitted
    assert _metric(live_server.metrics_url, name, origin="diagnostic") == before + 1
    client.release_cache(pb.ReleaseCacheRequest(cache_id=admitted.cache_id))


# -- item 6: snapshots and events --------------------------------------------------------------


def test_resource_snapshot_and_cache_metrics(client: ExecutorClient) -> None:
    prompt = list(range(200, 217))  # 4 full blocks + 1
    before = client.get_cache_metrics().snapshot
    caches = []
    for request_id in ("snap-1", "snap-2"):
        admitted = client.try_admit_prefill(
            pb.TryAdmitPrefillRequest(
                request_id=request_id, input_tokens=prompt, product_prompt_tokens=len(prompt)
            )
        ).admitted
        done = admitted.cached_prompt_tokens
        client.prefill(
            pb.PrefillRequest(
                request_id=request_id,
                input_tokens=prompt,
                cache_id=admitted.cache_id,
                chunk=pb.PrefillChunk(
                    tokens_processed=done,
                    tokens_to_process=len(prompt) - done,
                    total_prompt_tokens=len(prompt),
                ),
            )
        )
        caches.append(admitted.cache_id)
    after = client.get_cache_metrics().snapshot
    assert after.prefix_caching_enabled
    assert after.lookups - before.lookups == 2
    assert after.hit_tokens - before.hit_tokens >= 16  # the second found 4 blocks
    assert after.miss_tokens == after.query_tokens - after.hit_tokens
    snapshot = client.get_resource_snapshot().snapshot
    device = snapshot.domains[0]
    assert device.kind == pb.RESOURCE_DOMAIN_KIND_DEVICE_KV
    assert device.used_blocks >= 5  # 4 shared + 1 + 1 of their own
    assert device.free_blocks + device.cached_blocks + device.used_blocks == device.total_blocks
    assert snapshot.sequence_slots.used == 2
    assert snapshot.plan_claimed_bytes <= snapshot.usable_capacity_bytes
    assert snapshot.epochs.coordinator_id == client.get_info().executor_instance_id
    for cache_id in caches:
        client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))


def _read_events(live_server: LiveServer, count: int, action: object) -> list[pb.ExecutionEvent]:
    """Subscribe, run action() once subscribed, then read `count` events after `subscribed`."""
    from ferrum_client import AsyncExecutorClient

    async def scenario() -> list[pb.ExecutionEvent]:
        async with AsyncExecutorClient(live_server.target) as async_client:
            stream = async_client.watch_execution_events()
            first = await stream.__anext__()
            assert first.WhichOneof("event") == "subscribed"
            await asyncio.get_running_loop().run_in_executor(None, action)  # type: ignore[arg-type]
            events = []
            while len(events) < count:
                events.append(await asyncio.wait_for(stream.__anext__(), 10))
            await stream.aclose()
            return events

    return asyncio.run(scenario())


def test_execution_events_stream_steps_preemptions_releases_and_completions(
    live_server: LiveServer, client: ExecutorClient
) -> None:
    def work() -> None:
        first = client.prefill(pb.PrefillRequest(request_id="ev-a", input_tokens=[1, 2, 3]))
        client.complete_cache(
            pb.CompleteCacheRequest(
                request_id="ev-a",
                cache_id=first.completed.kv_cache.cache_id,
                input_tokens=3,
                output_tokens=1,
            )
        )
        second = client.prefill(pb.PrefillRequest(request_id="ev-b", input_tokens=[4, 5]))
        client.preempt_execution_capacity(
            pb.PreemptExecutionCapacityRequest(
                request_id="ev-b", cache_id=second.completed.kv_cache.cache_id
            )
        )
        third = client.prefill(pb.PrefillRequest(request_id="ev-c", input_tokens=[6]))
        client.release_cache(pb.ReleaseCacheRequest(cache_id=third.completed.kv_cache.cache_id))

    events = _read_events(live_server, 6, work)
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == [
        "step_completed",
        "completed",
        "step_completed",
        "preempted",
        "step_completed",
        "released",
    ]
    sequences = [e.sequence for e in events]
    assert sequences == list(range(sequences[0], sequences[0] + 6))
    assert events[1].completed.request_id == "ev-a" and events[1].completed.output_tokens == 1
    assert events[3].preempted.mode == pb.PREEMPTION_MODE_RECOMPUTE
    assert events[5].released.reason == pb.CACHE_RELEASE_REASON_RELEASED
    epochs = [e.epochs.release_epoch for e in events]
    assert epochs == sorted(epochs) and epochs[-1] > epochs[0]
    assert events[0].step_completed.prefill_tokens == 3


def test_a_reader_that_falls_behind_gets_a_dropped_marker(
    live_server: LiveServer, client: ExecutorClient
) -> None:
    engine = live_server.engine
    hub = engine.events  # type: ignore[attr-defined]
    hub.ring_capacity = 2  # this subscription's ring
    caches = [
        client.prefill(
            pb.PrefillRequest(request_id=f"lag-{i}", input_tokens=[i + 1])
        ).completed.kv_cache.cache_id
        for i in range(5)
    ]

    def expire_all() -> None:
        # The server's loop stalls (as behind a slow reader) while one engine call releases all
        # five caches (lease expiry): five events reach a ring of two in one hand-off.
        stalled = threading.Event()

        def stall() -> None:
            stalled.set()
            time.sleep(0.5)

        live_server.loop.call_soon_threadsafe(stall)
        assert stalled.wait(10)
        sweep = engine.sweep  # type: ignore[attr-defined]
        engine.call_sync(sweep, time.monotonic() + 1e6)  # type: ignore[attr-defined]

    try:
        events = _read_events(live_server, 3, expire_all)
    finally:
        hub.ring_capacity = 1024
    assert events[0].events_dropped.count == 3
    assert [e.released.reason for e in events[1:]] == [pb.CACHE_RELEASE_REASON_EXPIRED] * 2
    assert {e.released.cache_id for e in events[1:]} <= set(caches)
    assert events[2].sequence == events[1].sequence + 1


# -- item 7: repetition penalty scope ----------------------------------------------------------


def _penalised_argmax(logits: np.ndarray, tokens: set[int]) -> int:
    ids = sorted(tokens)
    row = logits.copy()
    row[ids] = np.where(row[ids] > 0, row[ids] / PENALTY, row[ids] * PENALTY)
    return int(row.argmax())


def _logits(response: pb.PrefillResponse | pb.DecodeResponse) -> np.ndarray:
    return np.frombuffer(response.completed.output.full_logits, dtype="<f4")


def _sampling(scope: int) -> pb.SamplingParams:
    return pb.SamplingParams(repetition_penalty=PENALTY, repetition_penalty_scope=scope)  # type: ignore[arg-type]


def test_repetition_penalty_scope_matches_a_hand_computed_expectation(
    client: ExecutorClient,
) -> None:
    full = pb.SamplingParams(logits_return_policy=pb.LOGITS_RETURN_POLICY_FULL_LOGITS)
    rng = np.random.default_rng(7)
    # A prompt whose greedy next token is one of its own tokens, so the two scopes differ.
    for _ in range(40):
        prompt = [int(t) for t in rng.integers(0, 512, 60)]
        raw = client.prefill(
            pb.PrefillRequest(request_id="raw", input_tokens=prompt, sampling=full)
        )
        client.release_cache(pb.ReleaseCacheRequest(cache_id=raw.completed.kv_cache.cache_id))
        first_logits = _logits(raw)
        if int(first_logits.argmax()) in prompt:
            break
    else:
        pytest.fail("no prompt found whose argmax is a prompt token")
    whole = _penalised_argmax(first_logits, set(prompt))
    assert whole != int(first_logits.argmax())
    outcomes = {}
    for scope in (
        pb.REPETITION_PENALTY_SCOPE_UNSPECIFIED,
        pb.REPETITION_PENALTY_SCOPE_PROMPT_AND_OUTPUTS,
        pb.REPETITION_PENALTY_SCOPE_OUTPUTS_ONLY,
    ):
        response = client.prefill(
            pb.PrefillRequest(
                request_id=f"s{scope}", input_tokens=prompt, sampling=_sampling(scope)
            )
        )
        outcomes[scope] = response.completed
    assert outcomes[pb.REPETITION_PENALTY_SCOPE_UNSPECIFIED].output.token.token_id == whole
    assert outcomes[pb.REPETITION_PENALTY_SCOPE_PROMPT_AND_OUTPUTS].output.token.token_id == whole
    only = outcomes[pb.REPETITION_PENALTY_SCOPE_OUTPUTS_ONLY]
    first = int(first_logits.argmax())
    assert only.output.token.token_id == first  # no output yet: nothing penalised
    # The next position: the outputs so far are [first].
    twin = client.prefill(pb.PrefillRequest(request_id="twin", input_tokens=prompt))
    twin_cache = twin.completed.kv_cache.cache_id
    assert twin.completed.output.token.token_id == first
    step = pb.DecodeRequest(input_token=first, position=len(prompt))
    step.cache_id = twin_cache
    step.sampling.CopyFrom(full)
    next_logits = _logits(client.decode(step))
    step.cache_id = only.kv_cache.cache_id
    step.sampling.CopyFrom(_sampling(pb.REPETITION_PENALTY_SCOPE_OUTPUTS_ONLY))
    chosen = client.decode(step).completed.output.token.token_id
    assert chosen == _penalised_argmax(next_logits, {first})
    for completed in outcomes.values():
        client.release_cache(pb.ReleaseCacheRequest(cache_id=completed.kv_cache.cache_id))
    client.release_cache(pb.ReleaseCacheRequest(cache_id=twin_cache))
    with pytest.raises(ExecutorError) as caught:
        client.prefill(pb.PrefillRequest(input_tokens=[1], sampling=_sampling(9)))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_outputs_only_scope_counts_replayed_outputs_as_outputs(client: ExecutorClient) -> None:
    full = pb.SamplingParams(logits_return_policy=pb.LOGITS_RETURN_POLICY_FULL_LOGITS)
    prompt, replayed = list(range(300, 330)), [7, 9, 11]
    context = prompt + replayed
    raw = client.prefill(
        pb.PrefillRequest(request_id="re-raw", input_tokens=context, sampling=full)
    )
    client.release_cache(pb.ReleaseCacheRequest(cache_id=raw.completed.kv_cache.cache_id))
    admitted = client.try_admit_prefill(
        pb.TryAdmitPrefillRequest(
            request_id="replay",
            input_tokens=context,
            product_prompt_tokens=len(prompt),
            replayed_output_tokens=len(replayed),
        )
    ).admitted
    done = admitted.cached_prompt_tokens
    response = client.prefill(
        pb.PrefillRequest(
            request_id="replay",
            input_tokens=context,
            cache_id=admitted.cache_id,
            chunk=pb.PrefillChunk(
                tokens_processed=done,
                tokens_to_process=len(context) - done,
                total_prompt_tokens=len(context),
            ),
            sampling=_sampling(pb.REPETITION_PENALTY_SCOPE_OUTPUTS_ONLY),
        )
    )
    expected = _penalised_argmax(_logits(raw), set(replayed))
    assert response.completed.output.token.token_id == expected
    client.release_cache(pb.ReleaseCacheRequest(cache_id=admitted.cache_id))


# -- item 9: completion and cancellation observations -------------------------------------------


def test_complete_and_cancel_answer_the_work_left_behind(
    live_server: LiveServer, client: ExecutorClient
) -> None:
    first = client.prefill(pb.PrefillRequest(request_id="obs", input_tokens=[1, 2, 3]))
    name = "ferrum_executor_completion_work_total"
    before = _metric(live_server.metrics_url, name, call="complete", work="none")
    done = client.complete_cache(
        pb.CompleteCacheRequest(
            request_id="obs",
            cache_id=first.completed.kv_cache.cache_id,
            input_tokens=3,
            output_tokens=1,
        )
    )
    assert done.released and done.work.kind == pb.COMPLETION_WORK_KIND_NO_ADDITIONAL_WORK
    assert _metric(live_server.metrics_url, name, call="complete", work="none") == before + 1
    client.try_admit_prefill(
        pb.TryAdmitPrefillRequest(request_id="obs-c", input_tokens=[4, 5], product_prompt_tokens=2)
    )
    cancelled = client.cancel_prefill_admission(
        pb.CancelPrefillAdmissionRequest(request_id="obs-c")
    )
    assert cancelled.released
    assert cancelled.work.kind == pb.COMPLETION_WORK_KIND_NO_ADDITIONAL_WORK


# -- a fault: ERROR, poisoned, refused, unproven work, health ----------------------------------


@pytest.fixture
def faulty_server(tmp_path: object) -> Iterator[tuple[LiveServer, object]]:
    plan = os.path.join(str(tmp_path), "plan.json")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FERRUM_ENABLE_FAULT_INJECTION", "1")
        patch.setenv("FERRUM_FAULT_PLAN", plan)
        yield from ((server, plan) for server in start_live_server(block_size=4))


def test_a_device_fault_reports_error_poisons_capacity_and_refuses_work(
    faulty_server: tuple[LiveServer, str],
) -> None:
    server, plan = faulty_server
    with ExecutorClient(server.target, timeout_s=30) as client:
        held = client.prefill(pb.PrefillRequest(request_id="held", input_tokens=[1, 2, 3]))
        with open(plan, "w", encoding="utf-8") as handle:
            json.dump({"rules": [{"kind": "fault", "request_ids": ["boom"]}]}, handle)
        with pytest.raises(ExecutorError) as caught:
            client.prefill(pb.PrefillRequest(request_id="boom", input_tokens=[4, 5]))
        assert caught.value.code == grpc.StatusCode.INTERNAL
        status = client.get_status().status
        assert status.state == pb.EXECUTOR_STATE_ERROR and not status.is_ready
        assert client.get_capacity_snapshot().capacity.poisoned
        with pytest.raises(ExecutorError) as refused:
            client.prefill(pb.PrefillRequest(request_id="after", input_tokens=[6]))
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert "faulted" in str(refused.value)
        done = client.complete_cache(
            pb.CompleteCacheRequest(
                request_id="held",
                cache_id=held.completed.kv_cache.cache_id,
                input_tokens=3,
                output_tokens=1,
            )
        )
        assert done.work.kind == pb.COMPLETION_WORK_KIND_ADDITIONAL_OR_UNPROVEN
        assert done.work.submission_indeterminate
        assert _metric(server.metrics_url, "ferrum_executor_faulted") == 1
        # The watchdog (every 5 s) takes readiness and liveness down: restart needed.
        deadline = time.monotonic() + 15
        while client.health("ferrum.executor.v1.Liveness") != 2:
            assert time.monotonic() < deadline, "liveness stayed SERVING after a fault"
            time.sleep(0.2)
        assert client.health() == 2
