"""Network faults through the loopback proxy: latency, resets mid-call, half-open links."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from ferrum_client import AsyncExecutorClient, BatchBuilder, ExecutorError, pb
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
    solo_outputs,
    wait_until,
)
from reliability.proxy import TcpProxy


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    with serve_in_process() as live:
        yield live


def test_added_latency_changes_nothing_but_time(server: InProcessServer) -> None:
    tally = Tally("proxy-latency[20ms/chunk]")

    async def scenario() -> None:
        prompts = {"a": prompt(1, 11), "b": prompt(2, 19)}
        reference = await solo_outputs(server.target, prompts, 4)
        proxy = TcpProxy(server.running.port, latency_s=0.02)
        await proxy.start()
        try:
            async with AsyncExecutorClient(proxy.target) as client:
                gens = [Generation(f"lat-{n}", p, 4) for n, p in prompts.items()]
                await drive(client, gens, tally)
            assert [g.tokens for g in gens] == [reference["a"], reference["b"]]
        finally:
            await proxy.close()

    run_scenario(scenario())
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


def test_reset_mid_call_step_id_retry_runs_exactly_once(server: InProcessServer) -> None:
    tally = Tally("proxy-reset-mid-call")

    async def scenario() -> None:
        proxy = TcpProxy(server.running.port)
        await proxy.start()
        try:
            async with AsyncExecutorClient(proxy.target, timeout_s=20) as client:
                first = await client.prefill(pb.PrefillRequest(request_id="r", input_tokens=[5, 9]))
                ref = first.completed.kv_cache
                steps = server.engine.stats.steps
                decode = pb.DecodeRequest(
                    request_id="r",
                    cache_id=ref.cache_id,
                    input_token=first.completed.output.token.token_id,
                    position=ref.num_tokens,
                    step_id=777,
                )
                opener = BatchBuilder()
                opener.add_prefill_chunk("no-step-id", "", [1, 2, 3], 0, 3)
                start = threading.Event()  # both calls queue until the link is reset
                hold = server.hold_engine_until(start)
                queued = server.engine.queued_runs
                batches_ended = server.rpcs_handled("UnifiedBatch")
                tally.send("with-step-id")
                tally.send("without-step-id")
                with_id = asyncio.ensure_future(client.decode(decode))
                without_id = asyncio.ensure_future(
                    client.unified_batch(pb.UnifiedBatchRequest(items=opener.build()))
                )
                try:
                    # Both reached the server before the reset: after a fixed 0.3 s a loaded
                    # machine could still have one unsent, and a call the reset finds unsent
                    # is sent on the new connection and succeeds (no UNAVAILABLE to check).
                    await wait_until(
                        lambda: server.engine.queued_runs >= queued + 2, "both calls queued"
                    )
                    assert proxy.reset() >= 1  # both calls lose their connection mid-flight
                    # Start the work only once the server has seen the orphan's call end: a
                    # handler that finished first would send its answer into the dead link, and
                    # no server can tell that from a delivered one (the cache lease covers it).
                    await wait_until(
                        lambda: server.rpcs_handled("UnifiedBatch") > batches_ended,
                        "the server saw the orphan's call end",
                    )
                finally:
                    start.set()
                answer = await with_id  # retried by the client on UNAVAILABLE, deduplicated
                tally.resolve("with-step-id")
                with pytest.raises(ExecutorError) as caught:
                    await without_id  # never retried: it carries no step id
                tally.resolve("without-step-id", code_name(caught.value))
                assert caught.value.code == grpc.StatusCode.UNAVAILABLE
                await hold
                assert answer.completed.kv_cache.num_tokens == ref.num_tokens + 1
                assert server.engine.kv.caches[ref.cache_id].num_tokens == ref.num_tokens + 1
                # The decode ran once; the orphan's work was dropped before it started.
                assert server.engine.stats.steps - steps <= 2
                assert "no-step-id" not in server.live_requests()  # the orphan left no cache
                await client.release_cache(pb.ReleaseCacheRequest(cache_id=ref.cache_id))
        finally:
            await proxy.close()

    run_scenario(scenario())
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


def test_reset_of_a_step_stream_releases_its_caches(server: InProcessServer) -> None:
    tally = Tally("proxy-reset-stream")

    async def scenario() -> None:
        proxy = TcpProxy(server.running.port)
        await proxy.start()
        try:
            async with AsyncExecutorClient(proxy.target) as client:
                stream = client.step_stream()
                await stream.__aenter__()
                builder = BatchBuilder()
                builder.add_prefill_chunk("streamed", "", [3, 1, 4, 1, 5], 0, 5)
                tally.send("streamed")
                await stream.run(pb.UnifiedBatchRequest(items=builder.build()))
                tally.resolve("streamed")
                assert "streamed" in server.live_requests()
                proxy.reset()
                # The server learns of the reset from its transport; under load that can take
                # longer than any fixed sleep, so wait for the release, bounded. (grpc.aio first
                # reports the reset as the end of the requests, as for a half-close, and the
                # cancellation after it: see test_stream_cancelled_just_after_its_requests_end.)
                for _ in range(300):  # up to 15 s
                    if "streamed" not in server.live_requests():
                        break
                    await asyncio.sleep(0.05)
                assert "streamed" not in server.live_requests()
                await stream.__aexit__(None, None, None)
        finally:
            await proxy.close()

    run_scenario(scenario())
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


def test_half_open_link_times_out_and_recovers(server: InProcessServer) -> None:
    tally = Tally("proxy-half-open")

    async def scenario() -> None:
        proxy = TcpProxy(server.running.port)
        await proxy.start()
        try:
            async with AsyncExecutorClient(proxy.target, timeout_s=1.0) as client:
                await client.get_status()  # connected
                proxy.blackhole = True
                tally.send("silent")
                started = time.monotonic()
                with pytest.raises(ExecutorError) as caught:
                    await client.prefill(pb.PrefillRequest(request_id="silent", input_tokens=[1]))
                tally.resolve("silent", code_name(caught.value))
                assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
                assert time.monotonic() - started < 3
                proxy.blackhole = False
                proxy.reset()  # the dead link goes away; the channel reconnects
                tally.send("after")
                answer = await client.prefill(
                    # A step id makes the call safe to retry while the channel reconnects.
                    pb.PrefillRequest(request_id="after", input_tokens=[2], step_id=31)
                )
                tally.resolve("after")
                await client.release_cache(
                    pb.ReleaseCacheRequest(cache_id=answer.completed.kv_cache.cache_id)
                )
        finally:
            await proxy.close()

    run_scenario(scenario())
    assert "silent" not in server.live_requests()
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


class _Context:
    """What StepStream asks of its grpc.aio context: no deadline, and no metadata (the caller
    whose step ids these are is anonymous)."""

    def time_remaining(self) -> float | None:
        return None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


def _stream_after_requests_end(
    server: InProcessServer, request_id: str, grace_s: float, *, cancel: bool
) -> None:
    """Drive StepStream as grpc.aio does: one step, the end of the requests, then (cancel=True)
    the handler task cancelled a moment later, as when the connection was lost."""
    from ferrum_server.service import ExecutorServicer

    servicer = ExecutorServicer(
        server.engine, server.running.servicer.notifier, half_close_grace_s=grace_s
    )
    servicer.mark_serving()
    builder = BatchBuilder()
    builder.add_prefill_chunk(request_id, "", [3, 1, 4, 1, 5], 0, 5)
    step = pb.StepStreamRequest(step_id=1, batch=pb.UnifiedBatchRequest(items=builder.build()))

    async def scenario() -> None:
        requests_ended = asyncio.Event()

        async def requests() -> AsyncIterator[pb.StepStreamRequest]:
            yield step
            requests_ended.set()

        responses = servicer.StepStream(requests(), _Context())
        first = await anext(responses)
        assert first.step_id == 1 and first.HasField("result")
        rest = asyncio.ensure_future(anext(responses, None))
        await requests_ended.wait()
        if not cancel:
            assert await rest is None  # a half-close ends the stream after the grace
            return
        await asyncio.sleep(0.05)  # the cancellation comes after the end of the requests
        assert not rest.done(), "the stream ended before a late cancellation could reach it"
        rest.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rest
        await servicer.dispatch.settle()

    server.run(scenario())


def test_stream_cancelled_just_after_its_requests_end_releases_its_caches(
    server: InProcessServer,
) -> None:
    """grpc.aio reports a lost connection to the request iterator as a plain end of the
    requests and cancels the handler only afterwards; the stream must still be running then,
    or the lost stream's caches would be kept (the old flake of the proxy reset test)."""
    _stream_after_requests_end(server, "late-cancel", 30.0, cancel=True)
    assert "late-cancel" not in server.live_requests()
    assert server.blocks_leaked() == 0


def test_stream_half_closed_keeps_its_caches(server: InProcessServer) -> None:
    """A client that half-closes after its answers keeps its caches (it releases them)."""
    _stream_after_requests_end(server, "half-closed", 0.01, cancel=False)
    live = {s.request_id: c for c, s in server.engine.kv.caches.items()}
    assert "half-closed" in live
    server.run(server.engine.call(server.engine.release_caches, [live["half-closed"]]))
    assert server.blocks_leaked() == 0
