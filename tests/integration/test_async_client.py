"""The asyncio client against a real in-process executor: a step stream that has ended fails
fast and cleanly, and the client queues calls beyond its per-connection bound instead of letting
the server refuse them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from ferrum_client import (
    AsyncExecutorClient,
    BatchBuilder,
    ClientClosedError,
    DeadlineExceededError,
    ExecutorError,
    StreamClosedError,
    pb,
)
from helpers_server import tiny_block_bytes
from reliability.harness import InProcessServer, run_scenario, serve_in_process

# Bound on anything that must happen "at once"; a hang shows as a timeout, not a stuck run.
PROMPT_S = 5.0


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    """24 blocks of 4 tokens: an 80-token hog leaves too little room for a 30-token prompt, so
    the prompt's admission is deferred and its capacity waits park until the hog goes."""
    with serve_in_process(engine={"kv_cache_bytes": 24 * tiny_block_bytes(4)}) as live:
        yield live


def _step(request_id: str, tokens: list[int]) -> pb.UnifiedBatchRequest:
    builder = BatchBuilder()
    builder.add_prefill_chunk(request_id, "", tokens, 0, len(tokens))
    return pb.UnifiedBatchRequest(items=builder.build())


def _submit_now(stream: Any, request: pb.UnifiedBatchRequest) -> asyncio.Future[Any]:
    """Submit, and require the outcome (a result or an error) to be known within PROMPT_S."""
    try:
        future = stream.submit(request)
    except ExecutorError as exc:
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_exception(exc)
        return done
    return asyncio.ensure_future(asyncio.wait_for(future, PROMPT_S))


def _assert_released(server: InProcessServer) -> None:
    """The server releases a cancelled stream's caches once its transport reports the cancel,
    which under load can take a while: wait for it, bounded."""
    deadline = time.monotonic() + 15
    while server.live_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.live_requests()


# -- an ended step stream ---------------------------------------------------------------------


def test_submit_after_cancel_fails_at_once_with_a_typed_error(server: InProcessServer) -> None:
    async def scenario() -> None:
        async with AsyncExecutorClient(server.target) as client:
            stream = client.step_stream()
            await stream.__aenter__()
            await stream.run(_step("before-cancel", [5, 6, 7]))
            stream.cancel()
            started = time.monotonic()
            with pytest.raises(StreamClosedError) as caught:
                await _submit_now(stream, _step("after-cancel", [1, 2]))
            assert time.monotonic() - started < 1.0
            assert caught.value.code == grpc.StatusCode.CANCELLED
            assert caught.value.cause is None  # the caller ended it
            await stream.__aexit__(None, None, None)
            with pytest.raises(StreamClosedError):  # and stays closed
                stream.submit(_step("after-exit", [1]))

    run_scenario(scenario(), 60)
    _assert_released(server)  # the cancelled stream's cache


def test_submit_after_leaving_the_stream_fails_at_once(server: InProcessServer) -> None:
    async def scenario() -> None:
        async with AsyncExecutorClient(server.target) as client:
            async with client.step_stream() as stream:
                answer = await stream.run(_step("closed", [3, 4]))
            with pytest.raises(StreamClosedError) as caught:
                await _submit_now(stream, _step("late", [1]))
            assert caught.value.code == grpc.StatusCode.CANCELLED
            await client.release_cache(pb.ReleaseCacheRequest(cache_id=answer.results.cache_ids[0]))

    run_scenario(scenario(), 60)


def test_submit_after_the_server_died_fails_at_once_with_the_cause() -> None:
    with serve_in_process() as doomed:

        async def scenario() -> None:
            async with AsyncExecutorClient(doomed.target, timeout_s=10) as client:
                stream = client.step_stream()
                await stream.__aenter__()
                await stream.run(_step("alive", [2, 3]))
                doomed.run(doomed.running.server.stop(0))  # every call cut, listener gone
                # A step sent as the server went away fails with the stream, never hangs ...
                with pytest.raises(ExecutorError) as first:
                    await _submit_now(stream, _step("dying", [4]))
                # The code is gRPC core's: UNAVAILABLE or CANCELLED, or INTERNAL ("Internal
                # error from Core") when the stop cuts the stream mid-frame (seen once in 3 CI
                # runs on a 2-core machine).
                assert first.value.code in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.CANCELLED,
                    grpc.StatusCode.INTERNAL,
                ), first.value
                # ... and once the stream has ended, submit raises at once, with the cause.
                with pytest.raises(StreamClosedError) as later:
                    stream.submit(_step("dead", [5]))
                assert later.value.code == first.value.code
                if later.value.code != grpc.StatusCode.CANCELLED:
                    assert isinstance(later.value.cause, ExecutorError)
                await asyncio.wait_for(stream.__aexit__(None, None, None), PROMPT_S)

        run_scenario(scenario(), 60)


@pytest.mark.parametrize("pending", [0, 2])
def test_leaving_the_stream_after_cancel_leaves_the_task_alone(
    server: InProcessServer, pending: int
) -> None:
    """The body cancels the stream (with or without steps still due) and leaves the block:
    nothing is raised, and the task is not marked cancelled (it used to get a CancelledError)."""

    async def body(client: AsyncExecutorClient) -> list[BaseException | None]:
        outcomes: list[BaseException | None] = []
        async with client.step_stream() as stream:
            await stream.run(_step(f"cancel-exit-{pending}", [1, 2, 3]))
            due = [stream.submit(_step(f"due-{pending}-{k}", [k + 1] * 40)) for k in range(pending)]
            stream.cancel()
            for future in due:
                try:
                    await future
                    outcomes.append(None)
                except ExecutorError as exc:
                    outcomes.append(exc)
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        await asyncio.sleep(0)  # a task hit by a stray cancellation would stop here
        return outcomes

    async def scenario() -> None:
        async with AsyncExecutorClient(server.target) as client:
            task = asyncio.ensure_future(body(client))
            outcomes = await asyncio.wait_for(task, 30)
            assert not task.cancelled()
            for outcome in outcomes:  # each step either ran or was cancelled, typed
                assert outcome is None or (
                    isinstance(outcome, ExecutorError) and outcome.code == grpc.StatusCode.CANCELLED
                )

    run_scenario(scenario(), 60)
    _assert_released(server)


def test_cancelling_the_task_inside_the_stream_still_cancels_it(server: InProcessServer) -> None:
    """The fix must not swallow a real cancellation of the task that holds the stream."""

    async def body(client: AsyncExecutorClient, entered: asyncio.Event) -> None:
        async with client.step_stream() as stream:
            await stream.run(_step("held", [1, 2]))
            entered.set()
            await asyncio.sleep(30)

    async def scenario() -> None:
        async with AsyncExecutorClient(server.target) as client:
            entered = asyncio.Event()
            task = asyncio.ensure_future(body(client, entered))
            await asyncio.wait_for(entered.wait(), 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, PROMPT_S)
            assert task.cancelled()
            assert client.pool.in_flight == 0  # the stream gave its slot back

    run_scenario(scenario(), 60)
    _assert_released(server)  # the stream was cancelled, not half-closed


# -- the per-connection bound -----------------------------------------------------------------


class _Deferral:
    """A hog admission that fills the pool and a deferred prompt's wait condition."""

    def __init__(self, server: InProcessServer, name: str) -> None:
        self.server = server
        self.hog = f"{name}-hog"
        self.condition: pb.CapacityWaitCondition | None = None

    async def __aenter__(self) -> _Deferral:
        async with AsyncExecutorClient(self.server.target) as client:
            hog = await client.try_admit_prefill(
                pb.TryAdmitPrefillRequest(
                    request_id=self.hog, input_tokens=[3] * 80, product_prompt_tokens=80
                )
            )
            assert hog.WhichOneof("decision") == "admitted"
            late = await client.try_admit_prefill(
                pb.TryAdmitPrefillRequest(
                    request_id=f"{self.hog}-late", input_tokens=[4] * 30, product_prompt_tokens=30
                )
            )
            self.condition = late.deferred.wait_condition
        return self

    async def release(self) -> None:
        async with AsyncExecutorClient(self.server.target) as client:
            await client.cancel_prefill_admission(
                pb.CancelPrefillAdmissionRequest(request_id=self.hog)
            )

    async def __aexit__(self, *exc: object) -> None:
        await self.release()

    def wait(self, timeout_ms: int = 20_000) -> pb.WaitForCapacityChangeRequest:
        return pb.WaitForCapacityChangeRequest(condition=self.condition, timeout_ms=timeout_ms)

    def parked(self) -> int:
        """Waits parked on the server now (a cancelled wait's future is done)."""
        waiters = self.server.running.servicer.notifier._waiters
        return sum(1 for waiter in list(waiters) if not waiter.done())


async def _until(check: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_calls_beyond_the_bound_queue_in_the_client_then_all_succeed(
    server: InProcessServer,
) -> None:
    """4 calls per connection, 2 connections: 8 slots, of which waits may hold 6. Twenty waits:
    6 reach the server, 14 queue in the client; short calls still pass (one of them is the
    release that ends the waits, sent on the same client), then every wait succeeds."""

    async def scenario() -> None:
        async with (
            _Deferral(server, "queue") as deferral,
            AsyncExecutorClient(server.target, calls_per_connection=4, max_connections=2) as client,
        ):
            assert client.pool.long_lived_limit == 6
            waits = [
                asyncio.ensure_future(client.wait_for_capacity_change(deferral.wait()))
                for _ in range(20)
            ]
            await _until(lambda: client.pool.in_flight == 6 and deferral.parked() == 6)
            assert client.pool.queued == 14
            assert len(client.pool.lanes) == 2  # a second connection, and no third
            await asyncio.sleep(0.2)
            assert deferral.parked() == 6  # the bound holds: nothing else reached the server
            await asyncio.wait_for(client.get_status(), PROMPT_S)  # not behind the waits
            await asyncio.wait_for(
                client.cancel_prefill_admission(
                    pb.CancelPrefillAdmissionRequest(request_id=deferral.hog)
                ),
                PROMPT_S,
            )
            answers = await asyncio.wait_for(asyncio.gather(*waits), 30)
            assert all(answer.changed for answer in answers)
            assert client.pool.in_flight == 0 and client.pool.queued == 0

    run_scenario(scenario(), 90)


def test_cancelled_calls_give_their_slot_back(server: InProcessServer) -> None:
    async def scenario() -> None:
        async with (
            _Deferral(server, "cancel") as deferral,
            AsyncExecutorClient(server.target, calls_per_connection=1, max_connections=1) as client,
        ):
            parked = asyncio.ensure_future(client.wait_for_capacity_change(deferral.wait()))
            await _until(lambda: deferral.parked() == 1)
            queued = [
                asyncio.ensure_future(client.wait_for_capacity_change(deferral.wait()))
                for _ in range(3)
            ]
            await _until(lambda: client.pool.queued == 3)
            queued[1].cancel()  # a queued call cancelled: it leaves the queue
            await _until(lambda: client.pool.queued == 2)
            parked.cancel()  # the call in flight cancelled: its slot goes to the next in line
            await _until(lambda: client.pool.queued == 1 and client.pool.in_flight == 1)
            await _until(lambda: deferral.parked() == 1)
            for waiting in (queued[0], queued[2]):
                waiting.cancel()
            await asyncio.gather(*queued, parked, return_exceptions=True)
            assert client.pool.in_flight == 0 and client.pool.queued == 0
            assert (await client.get_status()).status  # the client is whole

    run_scenario(scenario(), 90)


def test_a_queued_call_times_out_and_close_fails_the_rest(server: InProcessServer) -> None:
    async def scenario() -> None:
        async with _Deferral(server, "timeout") as deferral:
            client = AsyncExecutorClient(
                server.target, timeout_s=0.3, calls_per_connection=1, max_connections=1
            )
            parked = asyncio.ensure_future(client.wait_for_capacity_change(deferral.wait()))
            await _until(lambda: client.pool.in_flight == 1)
            with pytest.raises(DeadlineExceededError):  # queued for its whole timeout
                await client.get_status()
            assert client.pool.queued == 0
            queued = asyncio.ensure_future(client.wait_for_capacity_change(deferral.wait()))
            await _until(lambda: client.pool.queued == 1)
            await client.close()
            for call in (queued, parked):  # queued, and running: typed, not CancelledError
                with pytest.raises(ClientClosedError):
                    await asyncio.wait_for(call, PROMPT_S)
            with pytest.raises(ClientClosedError):
                await client.get_status()

    run_scenario(scenario(), 60)


def test_bounds_must_be_positive(server: InProcessServer) -> None:
    for bad in ({"calls_per_connection": 0}, {"max_connections": 0}):
        with pytest.raises(ValueError, match=">= 1"):
            AsyncExecutorClient(server.target, **bad)  # type: ignore[arg-type]


def test_refused_streams_are_retried_when_the_bound_exceeds_the_servers() -> None:
    """A client set above the server's streams per connection (64 calls against 16 streams):
    grpc's own queue then lets the server refuse streams (36 to 44 of 64 waits failed
    UNAVAILABLE without the retry); the client resends refused streams, which never ran."""
    with serve_in_process(
        engine={"kv_cache_bytes": 24 * tiny_block_bytes(4)},
        server={"max_concurrent_streams": 16},
    ) as narrow:

        async def scenario() -> None:
            async with (
                _Deferral(narrow, "narrow") as deferral,
                AsyncExecutorClient(
                    narrow.target, calls_per_connection=64, max_connections=1
                ) as client,
            ):
                outcomes = await asyncio.gather(
                    *(client.wait_for_capacity_change(deferral.wait(500)) for _ in range(64)),
                    return_exceptions=True,
                )
                failed = [o for o in outcomes if isinstance(o, BaseException)]
                assert not failed, failed[:3]
                # Each answered (most at their timeout; a capacity change the executor makes on
                # its own, such as a prefix mark expiring on a slow run, answers changed=True).
                assert all(isinstance(a, pb.WaitForCapacityChangeResponse) for a in outcomes)

        run_scenario(scenario(), 90)
