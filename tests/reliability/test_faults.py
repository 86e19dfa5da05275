"""Faults survived in-process: injected device OOM (only the affected items fail), deadlines and
cancellations before and during a step, and abandoned step streams."""

from __future__ import annotations

import asyncio
import json
import pathlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from ferrum_client import (
    AsyncExecutorClient,
    BatchBuilder,
    ExecutorError,
    ResourceExhaustedError,
    item_views,
    pb,
)
from reliability.harness import (
    Generation,
    InProcessServer,
    Tally,
    code_name,
    drive,
    prompt,
    report,
    run_scenario,
    serve_in_process,
    wait_until,
)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("faults") / "plan.json"


@pytest.fixture(scope="module")
def server(plan_file: pathlib.Path) -> Iterator[InProcessServer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FERRUM_ENABLE_FAULT_INJECTION", "1")
        patch.setenv("FERRUM_FAULT_PLAN", str(plan_file))
        with serve_in_process() as live:
            yield live


@pytest.fixture
def plan(plan_file: pathlib.Path, server: InProcessServer) -> Iterator[Any]:
    def write(*rules: dict[str, Any]) -> None:
        plan_file.write_text(json.dumps({"rules": list(rules)}))
        # A new mtime is what makes the engine re-read the plan.
        stamp = time.time_ns() + 1_000_000
        import os

        os.utime(plan_file, ns=(stamp, stamp))

    yield write
    plan_file.unlink(missing_ok=True)
    assert server.blocks_leaked() == 0


def _snapshot(server: InProcessServer) -> dict[str, tuple[int, tuple[int, ...]]]:
    server.settle()
    return {c: (s.num_tokens, tuple(s.block_ids)) for c, s in server.engine.kv.caches.items()}


def test_injected_oom_fails_only_the_affected_items(server: InProcessServer, plan: Any) -> None:
    tally = Tally("oom-in-forward")

    async def scenario() -> None:
        async with AsyncExecutorClient(server.target) as client:
            # A live sequence that will be extended (and fail) in the faulty batch.
            warm = Generation("victim-old", prompt(7, 9), 1)
            await drive(client, [warm], Tally("setup"))
            opened = await client.prefill(
                pb.PrefillRequest(request_id="victim-old", input_tokens=prompt(7, 9))
            )
            old = opened.completed
            before = _snapshot(server)
            plan({"kind": "oom", "request_ids": ["victim-new", "victim-old"]})
            builder = BatchBuilder()
            names = ["ok-0", "victim-new", "ok-1", "ok-2", "victim-old"]
            for i, name in enumerate(names[:4]):
                tally.send(name)
                builder.add_prefill_chunk(name, "", prompt(i, 6 + i), 0, 6 + i)
            tally.send("victim-old")
            builder.add_decode(
                "victim-old",
                old.kv_cache.cache_id,
                old.output.token.token_id,
                old.kv_cache.num_tokens,
            )
            response = await client.unified_batch(pb.UnifiedBatchRequest(items=builder.build()))
            views = item_views(response.results)
            for name, view in zip(names, views, strict=True):
                tally.resolve(name, "RESOURCE_EXHAUSTED" if view.failed else "OK")
            assert [v.failed for v in views] == [False, True, False, False, True]
            assert {e.request_id for e in response.results.errors} == {"victim-new", "victim-old"}
            exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert all(e.code == exhausted for e in response.results.errors)
            assert views[1].cache_id == "" and views[4].cache_id == old.kv_cache.cache_id
            after = _snapshot(server)
            # The failed decode committed nothing and gave its reserved blocks back.
            assert after[old.kv_cache.cache_id] == before[old.kv_cache.cache_id]
            # Single-item and transactional calls fail whole with RESOURCE_EXHAUSTED.
            with pytest.raises(ResourceExhaustedError):
                await client.prefill(
                    pb.PrefillRequest(request_id="victim-new", input_tokens=prompt(1, 7))
                )
            plan()  # the fault is gone: the server kept serving and the victims now run
            retry = await client.prefill(
                pb.PrefillRequest(request_id="victim-new", input_tokens=prompt(1, 7))
            )
            ok_alone = await client.prefill(
                pb.PrefillRequest(request_id="ok-1-solo", input_tokens=prompt(2, 8))
            )
            assert ok_alone.completed.output.token.token_id == views[2].token_id
            caches = [v.cache_id for v in views if not v.failed]
            caches += [
                old.kv_cache.cache_id,
                retry.completed.kv_cache.cache_id,
                ok_alone.completed.kv_cache.cache_id,
            ]
            for cache_id in caches:
                await client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))

    run_scenario(scenario())
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


def test_real_out_of_memory_errors_take_the_same_path(server: InProcessServer) -> None:
    from ferrum_server.domain import ItemKind, ItemStatus, Step, StepItem

    engine = server.engine
    real_run = engine.runner.run

    def flaky(items: list[Any], seqs: list[Any], *rest: Any) -> Any:
        if any(item.request_id == "big" for item in items):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_run(items, seqs, *rest)

    items = [
        StepItem(ItemKind.PREFILL_CHUNK, name, "", prompt(i, 5), 0, 5)
        for i, name in enumerate(["a", "big", "b"])
    ]
    engine.runner.run = flaky
    try:
        outcome = server.run(engine.call(engine.execute, Step(items)))
    finally:
        engine.runner.run = real_run
    statuses = [r.status for r in outcome.results]
    assert statuses == [ItemStatus.TOKEN, ItemStatus.FAILED, ItemStatus.TOKEN]
    server.run(engine.call(engine.release_caches, [r.cache_id for r in outcome.results]))
    assert server.blocks_leaked() == 0


def test_deadline_and_cancel_before_the_step_starts_run_nothing(server: InProcessServer) -> None:
    tally = Tally("queued-then-cancelled")

    async def scenario() -> None:
        steps_before = server.engine.stats.steps
        start = threading.Event()  # the engine stays busy until both calls have gone
        hold = server.hold_engine_until(start)
        async with AsyncExecutorClient(server.target, timeout_s=0.3) as short:
            tally.send("late")
            with pytest.raises(ExecutorError) as caught:
                await short.prefill(pb.PrefillRequest(request_id="late", input_tokens=[5, 6, 7]))
            tally.resolve("late", code_name(caught.value))
        try:
            async with AsyncExecutorClient(server.target) as client:
                tally.send("gone")
                queued = server.engine.queued_runs
                call = asyncio.ensure_future(
                    client.prefill(pb.PrefillRequest(request_id="gone", input_tokens=[5, 6, 7]))
                )
                await wait_until(  # it reached the server and queues behind the held engine
                    lambda: server.engine.queued_runs > queued, "the call queued"
                )
                cancelled = server.rpcs_handled("Prefill", "CANCELLED")
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                tally.resolve("gone", "CANCELLED")
            # The client's cancel only starts the server's: released before the server's
            # handler had left the ticket, the engine would run the step (a loaded machine
            # can delay that handler past the client closing its channel).
            await wait_until(
                lambda: server.rpcs_handled("Prefill", "CANCELLED") > cancelled,
                "the server saw the cancel",
            )
        finally:
            start.set()
        await hold
        assert server.engine.stats.steps == steps_before  # neither step ran

    run_scenario(scenario())
    assert not server.live_requests() & {"late", "gone"}
    assert tally.codes["DEADLINE_EXCEEDED"] == 1
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


def test_caller_gone_during_the_step_releases_what_it_opened(
    server: InProcessServer, plan: Any
) -> None:
    tally = Tally("cancelled-mid-step")

    async def scenario() -> None:
        async with AsyncExecutorClient(server.target) as client:
            kept = await client.prefill(pb.PrefillRequest(request_id="kept", input_tokens=[9, 8]))
            ref = kept.completed.kv_cache
            plan({"kind": "slow", "request_ids": ["slow-open"], "delay_s": 0.8})
            builder = BatchBuilder()
            builder.add_prefill_chunk("slow-open", "", [1, 2, 3], 0, 3)
            builder.add_decode("kept", ref.cache_id, kept.completed.output.token.token_id, 2)
            for name in ("slow-open", "kept-step"):
                tally.send(name)
            async with AsyncExecutorClient(server.target, timeout_s=0.3) as short:
                with pytest.raises(ExecutorError) as caught:
                    await short.unified_batch(pb.UnifiedBatchRequest(items=builder.build()))
            for name in ("slow-open", "kept-step"):
                tally.resolve(name, code_name(caught.value))
            assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(1.0)  # the step finishes after its caller left
            plan()
            assert server.live_requests() == {"kept"}  # the opened cache was released
            # The other sequence of that batch is intact and usable (its step committed).
            seq = server.engine.kv.caches[ref.cache_id]
            assert seq.num_tokens == 3
            await client.release_cache(pb.ReleaseCacheRequest(cache_id=ref.cache_id))

    run_scenario(scenario())
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


@pytest.mark.parametrize("method", ["reserve_slots", "try_admit", "try_admit_batch"])
def test_caller_gone_during_a_reservation_releases_what_it_opened(
    server: InProcessServer, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """ReserveKvSlots without a cache id, TryAdmitPrefill and TryAdmitPrefillBatch open caches
    whose ids only the response carries: when the caller has left by the time it is ready, the
    caches are released."""
    tally = Tally(f"cancelled-mid-{method}")
    engine = server.engine
    owner = engine.capacity if method == "reserve_slots" else engine
    real = getattr(owner, method)

    def slow(*args: Any) -> Any:
        time.sleep(0.8)  # on the engine thread, after the call started: its caller leaves
        return real(*args)

    monkeypatch.setattr(owner, method, slow)

    async def scenario() -> None:
        async with AsyncExecutorClient(server.target, timeout_s=0.3) as short:
            tally.send(method)
            with pytest.raises(ExecutorError) as caught:
                if method == "reserve_slots":
                    request = pb.ReserveKvSlotsRequest(
                        request_ids=["gone-reserve"], target_lens=[9]
                    )
                    await short.reserve_kv_slots(request)
                elif method == "try_admit":
                    admit = pb.TryAdmitPrefillRequest(
                        request_id="gone-admit", input_tokens=[4, 5, 6], product_prompt_tokens=3
                    )
                    await short.try_admit_prefill(admit)
                else:
                    probes = [
                        pb.TryAdmitPrefillRequest(
                            request_id=f"gone-batch-{k}",
                            input_tokens=[4 + k, 5, 6],
                            product_prompt_tokens=3,
                        )
                        for k in range(2)
                    ]
                    await short.try_admit_prefill_batch(
                        pb.TryAdmitPrefillBatchRequest(probes=probes)
                    )
            tally.resolve(method, code_name(caught.value))
            assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(1.0)  # the call finishes after its caller left

    run_scenario(scenario())
    monkeypatch.undo()
    assert not server.live_requests() & {
        "gone-reserve",
        "gone-admit",
        "gone-batch-0",
        "gone-batch-1",
    }
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


class _Gate:
    """The engine's fault injector, but a forward of `request_id` waits on the engine thread
    (`running` set) until the test sets `finish`: a test decides when the step ends instead
    of racing a fixed delay."""

    def __init__(self, inner: Any, request_id: str) -> None:
        self.inner = inner
        self.request_id = request_id
        self.running = threading.Event()
        self.finish = threading.Event()

    def before_forward(self, request_ids: list[str]) -> None:
        if self.request_id in request_ids:
            self.running.set()
            self.finish.wait(30)
        self.inner.before_forward(request_ids)


@pytest.mark.parametrize("release_on_disconnect", [True, False])
def test_abandoned_step_stream_drops_queued_steps(
    server: InProcessServer,
    plan: Any,
    monkeypatch: pytest.MonkeyPatch,
    release_on_disconnect: bool,
) -> None:
    tally = Tally(f"stream-abandoned[release_on_disconnect={release_on_disconnect}]")
    server.running.servicer.release_on_disconnect = release_on_disconnect
    # Step 1 runs until the server has seen the stream cancelled. A fixed slow step (0.8 s)
    # and a 0.3 s sleep before the cancel raced on a loaded machine: step 1 could still be
    # unstarted at the cancel (nothing ran), or finish before the server saw it (step 2 ran).
    gate = _Gate(server.engine.faults, "s1")
    running, finish = gate.running, gate.finish
    monkeypatch.setattr(server.engine, "faults", gate)

    async def scenario() -> None:
        async with AsyncExecutorClient(server.target) as client:
            old = await client.prefill(pb.PrefillRequest(request_id="old", input_tokens=[4, 4]))
            ref = old.completed.kv_cache
            steps_before = server.engine.stats.steps
            stream = client.step_stream()
            await stream.__aenter__()
            first = BatchBuilder()
            first.add_prefill_chunk("s1", "", [1, 2, 3], 0, 3)
            first.add_decode("old", ref.cache_id, old.completed.output.token.token_id, 2)
            futures = [stream.submit(pb.UnifiedBatchRequest(items=first.build()))]
            tally.send("s1")
            for k in range(2, 5):
                builder = BatchBuilder()
                builder.add_prefill_chunk(f"s{k}", "", [k, k, k], 0, 3)
                futures.append(stream.submit(pb.UnifiedBatchRequest(items=builder.build())))
                tally.send(f"s{k}")
            try:
                await wait_until(  # step 1 runs; steps 2-4 queue
                    lambda: running.is_set() and server.engine.queued_runs >= 3,
                    "step 1 running and steps 2-4 queued",
                )
                cancelled = server.rpcs_handled("StepStream", "CANCELLED")
                stream.cancel()  # the scheduler vanishes
                for k, future in enumerate(futures, 1):
                    try:
                        await future
                        tally.resolve(f"s{k}")
                    except ExecutorError as exc:
                        tally.resolve(f"s{k}", code_name(exc))
                await wait_until(
                    lambda: server.rpcs_handled("StepStream", "CANCELLED") > cancelled,
                    "the server saw the stream cancelled",
                )
            finally:
                finish.set()
            live = server.live_requests()  # settled: step 1 and the cleanups are done
            assert server.engine.stats.steps == steps_before + 1  # only step 1 ran
            assert not live & {"s1", "s2", "s3", "s4"}
            assert ("old" in live) is not release_on_disconnect
            if not release_on_disconnect:
                await client.release_cache(pb.ReleaseCacheRequest(cache_id=ref.cache_id))

    try:
        run_scenario(scenario())
    finally:
        server.running.servicer.release_on_disconnect = True
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


def test_retry_after_a_mid_step_deadline_replays_the_stored_result(
    server: InProcessServer, plan: Any
) -> None:
    tally = Tally("retry-after-deadline[step id]")

    async def scenario() -> None:
        async with AsyncExecutorClient(server.target) as client:
            opened = await client.prefill(pb.PrefillRequest(request_id="d", input_tokens=[6, 7]))
            ref = opened.completed.kv_cache
            request = pb.DecodeRequest(
                request_id="d",
                cache_id=ref.cache_id,
                input_token=opened.completed.output.token.token_id,
                position=ref.num_tokens,
                step_id=4242,
            )
            plan({"kind": "slow", "request_ids": ["d"], "delay_s": 0.8})
            tally.send("d")
            async with AsyncExecutorClient(server.target, timeout_s=0.3) as short:
                with pytest.raises(ExecutorError) as caught:
                    await short.decode(request)
            assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            retry = await client.decode(request)  # joins or replays: never runs twice
            plan()
            again = await client.decode(request)
            tally.resolve("d")
            assert retry == again
            assert retry.completed.kv_cache.num_tokens == ref.num_tokens + 1
            assert server.engine.kv.caches[ref.cache_id].num_tokens == ref.num_tokens + 1
            await client.release_cache(pb.ReleaseCacheRequest(cache_id=ref.cache_id))

    run_scenario(scenario())
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)
