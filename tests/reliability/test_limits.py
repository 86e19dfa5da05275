"""Every configured limit, just under (accepted) and just over (refused with the documented code),
plus malformed bytes on the wire."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from ferrum_client import (
    AsyncExecutorClient,
    BatchBuilder,
    ExecutorClient,
    ExecutorError,
    InvalidArgumentError,
    SamplingOptions,
    pb,
)
from reliability.harness import (
    InProcessServer,
    Tally,
    report,
    run_scenario,
    serve_in_process,
    wait_until,
)

LIMIT = 64 * 1024
MAX_RPCS = 4
MAX_METADATA = 2048
MAX_TOKENS = 64
MAX_ITEMS = 8
METHOD = "/ferrum.executor.v1.ExecutorService/"


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    with serve_in_process(
        engine={"max_batch_tokens": MAX_TOKENS, "max_batch_size": MAX_ITEMS},
        server={
            "max_message_bytes": LIMIT,
            "max_concurrent_rpcs": MAX_RPCS,
            "max_metadata_bytes": MAX_METADATA,
        },
    ) as live:
        yield live


@pytest.fixture
def channel(server: InProcessServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(
        server.target,
        [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
    ) as ch:
        yield ch
    assert server.blocks_leaked() == 0


def _raw(channel: grpc.Channel, method: str) -> grpc.UnaryUnaryMultiCallable:  # type: ignore[type-arg]
    return channel.unary_unary(METHOD + method)


def _prefill_of_size(size: int) -> bytes:
    """A PrefillRequest serialised to exactly `size` bytes (token id 1 is one byte)."""
    request = pb.PrefillRequest(request_id="big", input_tokens=[1] * (size - 16))
    while request.ByteSize() < size:
        request.input_tokens.append(1)
    while request.ByteSize() > size:
        request.input_tokens.pop()
    data = request.SerializeToString()
    assert len(data) == size
    return data


def _code(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_message_size_at_and_over_the_limit(channel: grpc.Channel) -> None:
    tally = Tally("limit[max_message_bytes]")
    prefill = _raw(channel, "Prefill")
    for name, size, expected in (
        ("at-limit", LIMIT, grpc.StatusCode.INVALID_ARGUMENT),  # parsed: too long a prompt
        ("over-limit", LIMIT + 1, grpc.StatusCode.RESOURCE_EXHAUSTED),  # refused unread
    ):
        tally.send(name)
        code = _code(lambda size=size: prefill(_prefill_of_size(size), timeout=10))
        tally.resolve(name, code.name)
        assert code == expected, name
    report(tally)


def test_responses_that_could_not_be_sent_are_refused_before_running(
    server: InProcessServer,
) -> None:
    logits = SamplingOptions(full_logits=True).to_pb()
    with ExecutorClient(server.target) as client:
        opened = client.prefill(pb.PrefillRequest(request_id="v", input_tokens=[1, 2]))
        ref = opened.completed.kv_cache

        def verify(count: int) -> pb.ForwardVerifyRequest:
            return pb.ForwardVerifyRequest(
                cache_id=ref.cache_id, token_ids=[3] * count, position=2, sampling=logits
            )

        steps = server.engine.stats.steps
        with pytest.raises(InvalidArgumentError, match="message limit"):
            client.forward_verify(verify(40))  # 40 logits rows of 2 KiB > 64 KiB
        assert server.engine.stats.steps == steps
        answer = client.forward_verify(verify(20))
        assert len(answer.completed.logits) == 20 * 512 * 4
        client.release_cache(pb.ReleaseCacheRequest(cache_id=ref.cache_id))
    assert server.blocks_leaked() == 0


def test_metadata_size_at_and_over_the_limit(channel: grpc.Channel) -> None:
    status = _raw(channel, "GetStatus")
    request = pb.GetStatusRequest().SerializeToString()
    under = _code(lambda: status(request, metadata=[("x-pad", "a" * (MAX_METADATA // 2))]))
    over = _code(lambda: status(request, metadata=[("x-pad", "a" * (MAX_METADATA * 2))]))
    assert under == grpc.StatusCode.OK
    assert over == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_batch_tokens_and_items_at_and_over_the_limit(server: InProcessServer) -> None:
    tally = Tally("limit[batch tokens/items]")

    def batch(items: int, tokens_each: int) -> pb.UnifiedBatchRequest:
        builder = BatchBuilder()
        for i in range(items):
            builder.add_prefill_chunk(f"b{i}", "", [3] * tokens_each, 0, tokens_each)
        return pb.UnifiedBatchRequest(items=builder.build())

    with ExecutorClient(server.target) as client:
        for name, request, ok in (
            ("tokens-at", batch(1, MAX_TOKENS), True),
            ("tokens-over", batch(1, MAX_TOKENS + 1), False),
            ("items-at", batch(MAX_ITEMS, 2), True),
            ("items-over", batch(MAX_ITEMS + 1, 2), False),
        ):
            tally.send(name)
            try:
                answer = client.unified_batch(request)
            except InvalidArgumentError:
                tally.resolve(name, "INVALID_ARGUMENT")
                assert not ok, name
                continue
            tally.resolve(name)
            assert ok, name
            for cache_id in filter(None, answer.results.cache_ids):
                client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))
        with pytest.raises(InvalidArgumentError):
            client.prefill(pb.PrefillRequest(request_id="x" * 257, input_tokens=[1]))
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


def test_concurrent_rpc_limit_refuses_fast_and_recovers_exactly(server: InProcessServer) -> None:
    tally = Tally(f"limit[max_concurrent_rpcs={MAX_RPCS}]")

    async def scenario() -> None:
        # Held until the refusals are in: a timed hold (1 s) could end on a loaded machine
        # before the first calls were counted or the over-limit calls arrived, and then those
        # were admitted instead of refused.
        release = threading.Event()
        hold = server.hold_engine_until(release)
        async with AsyncExecutorClient(server.target) as client:

            async def status(name: str) -> float:
                tally.send(name)
                started = time.monotonic()
                try:
                    await client.get_status()  # queues behind the held engine thread
                    tally.resolve(name)
                except ExecutorError as exc:
                    tally.resolve(name, exc.code.name)
                return time.monotonic() - started

            try:
                first = [asyncio.ensure_future(status(f"a{i}")) for i in range(MAX_RPCS)]
                await wait_until(
                    lambda: server.rpcs_in_progress("GetStatus") == MAX_RPCS,
                    f"{MAX_RPCS} calls in progress on the server",
                )
                refused = await asyncio.gather(*(status(f"x{i}") for i in range(3)))
            finally:
                release.set()
            assert tally.codes["RESOURCE_EXHAUSTED"] == 3
            assert max(refused) < 0.5
            await asyncio.gather(*first, hold)
            await asyncio.gather(*(status(f"b{i}") for i in range(MAX_RPCS)))
        assert tally.completed == 2 * MAX_RPCS

    run_scenario(scenario())
    report(tally)


@pytest.mark.parametrize(
    "method", ["UnifiedBatch", "Prefill", "TryAdmitPrefill", "TryAdmitPrefillBatch", "ReleaseCache"]
)
def test_malformed_bytes_never_reach_a_handler(
    server: InProcessServer, channel: grpc.Channel, method: str
) -> None:
    steps = server.engine.stats.steps
    rng = __import__("random").Random(method)
    codes = set()
    for length in (1, 7, 64, 999):
        garbage = bytes([0xFF]) + bytes(rng.randrange(256) for _ in range(length))
        try:
            _raw(channel, method)(garbage, timeout=10)
        except grpc.RpcError as error:
            codes.add(error.code())
            assert "Error" not in (error.details() or "")  # no parser internals
    # Unparseable bytes get a fixed INVALID_ARGUMENT; bytes that happen to parse get a normal
    # validation answer. Either way nothing ran and the server is alive.
    assert codes <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
    assert server.engine.stats.steps == steps
    with ExecutorClient(server.target) as client:
        assert client.get_status().status.is_ready


SHARED_RPCS, PER_CALLER_RPCS = 6, 4


def test_probes_answer_and_other_callers_keep_their_share_under_exhaustion() -> None:
    """Caller A parks as many WatchCapacity streams as its share allows, then B parks the
    rest of the total: health Check, the liveness probe and health Watch still answer SERVING
    on the serving port; only the caller over a limit gets RESOURCE_EXHAUSTED."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    tally = Tally("probes under exhaustion")
    serving = health_pb2.HealthCheckResponse.SERVING

    async def scenario(server: InProcessServer) -> None:
        async with grpc.aio.insecure_channel(server.target) as channel:
            watch = channel.unary_stream(
                METHOD + "WatchCapacity",
                request_serializer=pb.WatchCapacityRequest.SerializeToString,
                response_deserializer=pb.WatchCapacityResponse.FromString,
            )
            status = channel.unary_unary(
                METHOD + "GetStatus",
                request_serializer=pb.GetStatusRequest.SerializeToString,
                response_deserializer=pb.GetStatusResponse.FromString,
            )
            health = health_pb2_grpc.HealthStub(channel)
            parked: list[Any] = []

            async def park(caller: str, name: str) -> str:
                tally.send(name)
                call = watch(pb.WatchCapacityRequest(), metadata=[("ferrum-session", caller)])
                try:
                    await call.read()
                except grpc.aio.AioRpcError as exc:
                    tally.resolve(name, exc.code().name)
                    return str(exc.code().name)
                parked.append((name, call))
                return "OK"

            async def probes() -> None:
                for service in ("", "ferrum.executor.v1.Liveness"):
                    reply = await health.Check(
                        health_pb2.HealthCheckRequest(service=service), timeout=2
                    )
                    assert reply.status == serving, service
                watcher = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=2)
                assert (await watcher.read()).status == serving
                watcher.cancel()

            assert [await park("a", f"a{i}") for i in range(PER_CALLER_RPCS)] == ["OK"] * 4
            assert await park("a", "a-over") == "RESOURCE_EXHAUSTED"  # A's share is taken
            await probes()
            # B is not held back by A's share: it gets the rest of the total ...
            rest = SHARED_RPCS - PER_CALLER_RPCS
            assert [await park("b", f"b{i}") for i in range(rest)] == ["OK"] * rest
            # ... and once the total is taken, a third caller is refused, probes are not.
            tally.send("c")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await status(pb.GetStatusRequest(), metadata=[("ferrum-session", "c")])
            tally.resolve("c", refused.value.code().name)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limit of 6 concurrent calls" in (refused.value.details() or "")
            await probes()
            for name, call in parked:
                call.cancel()
                tally.resolve(name)
            # The cancelled streams end on the server (a fixed 0.2 s could pass first on a
            # loaded machine, and the call below was then refused as over the total).
            await wait_until(
                lambda: server.rpcs_in_progress("WatchCapacity") == 0,
                "the cancelled watches ended on the server",
            )
            # Every slot is back.
            tally.send("after")
            await status(pb.GetStatusRequest(), metadata=[("ferrum-session", "c")])
            tally.resolve("after")

    with serve_in_process(
        server={
            "max_concurrent_rpcs": SHARED_RPCS,
            "max_concurrent_rpcs_per_caller": PER_CALLER_RPCS,
        }
    ) as server:
        run_scenario(scenario(server))
    report(tally)
    assert tally.codes["RESOURCE_EXHAUSTED"] == 2
