"""Client-side stream behaviours: many concurrent calls on one `AsyncExecutorClient` (more than
the server's HTTP/2 streams per connection), with and without cancellations, and step streams
that end under the caller (cancelled, left, or the server SIGKILLed)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import random
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from ferrum_client import (
    AsyncExecutorClient,
    BatchBuilder,
    ExecutorError,
    StreamClosedError,
    pb,
)
from ferrum_server.server_process import start_server_process
from helpers_server import tiny_block_bytes
from reliability.harness import (
    InProcessServer,
    Tally,
    code_name,
    report,
    rss_bytes,
    run_scenario,
    serve_in_process,
)

# The executor's default --max-concurrent-streams, stated here so the floods exceed it.
SERVER_STREAMS = 256
WAITS = 400
READS = 300
# Peak RSS growth allowed over a flood (the in-process server and its client).
RSS_BOUND_BYTES = 96 * 1024**2


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    """24 blocks of 4 tokens: an 80-token hog defers a 30-token prompt's admission."""
    with serve_in_process(
        engine={"kv_cache_bytes": 24 * tiny_block_bytes(4)},
        server={"max_concurrent_streams": SERVER_STREAMS},
    ) as live:
        yield live


class _PeakRss:
    """Samples this process's RSS (the in-process server lives here) while a flood runs."""

    def __init__(self) -> None:
        self.baseline = rss_bytes()
        self.peak = self.baseline
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, rss_bytes())
            await asyncio.sleep(0.05)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._sample())

    async def stop(self) -> int:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.peak = max(self.peak, rss_bytes())
        return self.peak - self.baseline


def _parked(server: InProcessServer) -> int:
    waiters = server.running.servicer.notifier._waiters
    return sum(1 for waiter in list(waiters) if not waiter.done())


async def _settle(done: Any, timeout_s: float) -> None:
    """Give `done()` up to timeout_s to hold; go on either way (the outcome is checked after)."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:  # noqa: ASYNC110 - polls server state
        await asyncio.sleep(0.05)


async def _deferred_condition(client: AsyncExecutorClient, name: str) -> pb.CapacityWaitCondition:
    hog = await client.try_admit_prefill(
        pb.TryAdmitPrefillRequest(request_id=name, input_tokens=[3] * 80, product_prompt_tokens=80)
    )
    assert hog.WhichOneof("decision") == "admitted"
    late = await client.try_admit_prefill(
        pb.TryAdmitPrefillRequest(
            request_id=f"{name}-late", input_tokens=[4] * 30, product_prompt_tokens=30
        )
    )
    assert late.WhichOneof("decision") == "deferred"
    return late.deferred.wait_condition


@pytest.mark.parametrize(
    "connections",
    [pytest.param(None, id="default"), pytest.param(1, id="one-connection-queued")],
)
def test_concurrent_waits_beyond_the_stream_limit_all_succeed(
    server: InProcessServer, connections: int | None
) -> None:
    """400 capacity waits on one client, all woken by one release. Before the client bounded
    its calls, grpc sent the waits beyond the server's 256 streams the moment the first 256
    ended, before the server had freed them: 45 to 94 of 400 were refused (UNAVAILABLE)."""
    label = "default" if connections is None else f"{connections}-connection"
    tally = Tally(f"client-waits[{WAITS} waits, {label}]")
    options: dict[str, Any] = {} if connections is None else {"max_connections": connections}

    async def scenario() -> None:
        rss = _PeakRss()
        rss.start()
        async with AsyncExecutorClient(server.target, **options) as client:
            condition = await _deferred_condition(client, f"waits-hog-{label}")
            request = pb.WaitForCapacityChangeRequest(condition=condition, timeout_ms=60_000)

            async def wait(name: str) -> None:
                tally.send(name)
                try:
                    answer = await client.wait_for_capacity_change(request)
                    tally.resolve(name, "OK" if answer.changed else "NOT_CHANGED")
                except ExecutorError as exc:
                    tally.resolve(name, code_name(exc))

            waits = [asyncio.ensure_future(wait(f"wait-{k}")) for k in range(WAITS)]
            # Park as many as the client lets through (all 400 by default) before the release.
            pool = client.pool
            await _settle(lambda: _parked(server) >= min(WAITS, pool.long_lived_limit), 30)
            tally.notes = f"parked={_parked(server)} queued_in_client={pool.queued}"
            await client.cancel_prefill_admission(
                pb.CancelPrefillAdmissionRequest(request_id=f"waits-hog-{label}")
            )
            await asyncio.gather(*waits)
            assert pool.in_flight == 0 and pool.queued == 0
        tally.rss_growth_bytes = await rss.stop()

    run_scenario(scenario(), 120)
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)
    assert tally.completed == WAITS, tally.line()
    assert tally.rss_growth_bytes is not None and tally.rss_growth_bytes < RSS_BOUND_BYTES


def test_concurrent_reads_with_cancellations_never_see_unavailable(
    server: InProcessServer,
) -> None:
    """300 reads queued behind a busy engine, half cancelled at random moments. Before the
    bound, the cancelled streams' slots were reused by grpc before the server had let go of
    them, and 43 to 140 of the reads that were not cancelled failed UNAVAILABLE."""
    tally = Tally(f"client-reads-cancelled[{READS} reads]")
    rng = random.Random(17)

    async def scenario() -> None:
        rss = _PeakRss()
        rss.start()
        async with AsyncExecutorClient(server.target) as client:
            hold = server.hold_engine(2.0)  # the reads queue behind it

            async def read(name: str) -> None:
                try:
                    await client.get_status()
                    tally.resolve(name)
                except ExecutorError as exc:
                    tally.resolve(name, code_name(exc))

            async def read_and_maybe_cancel(k: int) -> None:
                name = f"read-{k}"
                tally.send(name)
                task = asyncio.ensure_future(read(name))
                if k % 2:
                    await asyncio.sleep(rng.uniform(0.0, 1.5))
                    task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    tally.resolve(name, "CANCELLED")

            await asyncio.gather(*(read_and_maybe_cancel(k) for k in range(READS)))
            await hold
            assert client.pool.in_flight == 0 and client.pool.queued == 0
        tally.rss_growth_bytes = await rss.stop()

    run_scenario(scenario(), 120)
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)
    assert set(tally.codes) <= {"OK", "CANCELLED"}, tally.line()
    assert tally.completed >= READS // 2, tally.line()  # every read not cancelled, at least
    assert tally.rss_growth_bytes is not None and tally.rss_growth_bytes < RSS_BOUND_BYTES


def _step(request_id: str, tokens: list[int]) -> pb.UnifiedBatchRequest:
    builder = BatchBuilder()
    builder.add_prefill_chunk(request_id, "", tokens, 0, len(tokens))
    return pb.UnifiedBatchRequest(items=builder.build())


async def _outcome(stream: Any, request: pb.UnifiedBatchRequest, bound_s: float = 5.0) -> str:
    """A step's outcome, which must be known within bound_s: OK, or the typed error's code
    (StreamClosedError as STREAM_CLOSED). A hang fails the scenario."""
    try:
        await asyncio.wait_for(stream.submit(request), bound_s)
        return "OK"
    except StreamClosedError:
        return "STREAM_CLOSED"
    except ExecutorError as exc:
        return code_name(exc)


def test_streams_cancelled_and_left_fail_fast_and_leave_tasks_alone(
    server: InProcessServer,
) -> None:
    """20 streams in their own tasks: steps queued, the stream cancelled, then the block left
    and a step submitted after. Every step ends typed; no task is cancelled by the exit."""
    tally = Tally("client-streams-cancelled[20 streams]")
    rng = random.Random(23)

    async def one(client: AsyncExecutorClient, k: int) -> None:
        async with client.step_stream() as stream:
            names = [f"cs{k}-{j}" for j in range(3)]
            for name in names:
                tally.send(name)
            due = [
                asyncio.ensure_future(_outcome(stream, _step(name, [k % 7 + 1] * 24)))
                for name in names
            ]
            await asyncio.sleep(rng.uniform(0.0, 0.4))  # some steps run, some are dropped
            stream.cancel()
            for name, outcome in zip(names, await asyncio.gather(*due), strict=True):
                tally.resolve(name, outcome)
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        tally.send(f"cs{k}-late")
        tally.resolve(f"cs{k}-late", await _outcome(stream, _step(f"cs{k}-late", [1])))

    async def scenario() -> None:
        async with AsyncExecutorClient(server.target) as client:
            tasks = [asyncio.ensure_future(one(client, k)) for k in range(20)]
            await asyncio.gather(*tasks)
            assert not any(task.cancelled() for task in tasks)
            assert client.pool.in_flight == 0

    run_scenario(scenario(), 120)
    assert tally.codes["STREAM_CLOSED"] == 20, tally.line()  # every late submit
    assert set(tally.codes) <= {"OK", "CANCELLED", "STREAM_CLOSED"}, tally.line()
    deadline = time.monotonic() + 15
    while server.live_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


def test_stream_fails_fast_after_the_server_is_killed(tmp_path: pathlib.Path) -> None:
    """SIGKILL the executor under an open step stream: the step in flight and every step
    submitted after fail within seconds with typed errors; none waits forever."""
    tally = Tally("client-stream-server-killed")
    log = open(tmp_path / "server.log", "ab")  # noqa: SIM115 - owned by the child
    process, port = start_server_process(
        ["--metrics-port", "-1", "--log-level", "warning"], stdout=log, stderr=log
    )

    async def scenario() -> None:
        async with AsyncExecutorClient(f"127.0.0.1:{port}", timeout_s=10) as client:
            stream = client.step_stream()
            await stream.__aenter__()
            tally.send("alive")
            tally.resolve("alive", await _outcome(stream, _step("alive", [2, 3, 4])))
            long = _step("in-flight", [5] * 200)
            tally.send("in-flight")
            in_flight = asyncio.ensure_future(_outcome(stream, long, 10.0))
            await asyncio.sleep(0.01)
            os.kill(process.pid, 9)
            process.wait(timeout=10)
            tally.resolve("in-flight", await in_flight)
            for k in range(5):
                started = time.monotonic()
                tally.send(f"after-{k}")
                tally.resolve(f"after-{k}", await _outcome(stream, _step(f"after-{k}", [k + 1])))
                assert time.monotonic() - started < 1.0
            with pytest.raises(StreamClosedError) as caught:
                stream.submit(_step("last", [1]))
            assert caught.value.code == grpc.StatusCode.UNAVAILABLE
            assert isinstance(caught.value.cause, ExecutorError)
            await asyncio.wait_for(stream.__aexit__(None, None, None), 5)

    try:
        run_scenario(scenario(), 60)
    finally:
        process.kill()
        process.wait(timeout=10)
        log.close()
    report(tally)
    # The first step after the kill may still be sent before the stream notices (it then fails
    # with the stream, UNAVAILABLE); every later one is refused by submit itself.
    assert tally.codes["STREAM_CLOSED"] >= 4, tally.line()
    assert set(tally.codes) <= {"OK", "UNAVAILABLE", "STREAM_CLOSED"}, tally.line()
