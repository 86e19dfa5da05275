"""Duplicate step ids, replays across unary calls and the step stream, fencing."""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import Iterator

import grpc
import pytest
from ferrum_client import (
    AlreadyExistsError,
    AsyncExecutorClient,
    BatchBuilder,
    ExecutorClient,
    InvalidArgumentError,
    SamplingOptions,
    StaleExecutorError,
    StepResultEvictedError,
    pb,
)
from ferrum_client.pb import executor_pb2_grpc as pb_grpc
from ferrum_server.security import SecurityConfig
from reliability.harness import (
    InProcessServer,
    Tally,
    report,
    rss_bytes,
    run_scenario,
    serve_in_process,
)

LEDGER = 8


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    with serve_in_process(server={"step_ledger_size": LEDGER}) as live:
        yield live


@pytest.fixture
def client(server: InProcessServer) -> Iterator[ExecutorClient]:
    with ExecutorClient(server.target) as c:
        yield c
    assert server.blocks_leaked() == 0


def _steps(server: InProcessServer) -> int:
    server.settle()
    return int(server.engine.stats.steps)


def test_same_step_id_and_payload_runs_once(
    server: InProcessServer, client: ExecutorClient
) -> None:
    tally = Tally("duplicate-step-id")
    request = pb.PrefillRequest(request_id="dup", input_tokens=[3, 4, 5], step_id=101)
    before = _steps(server)
    answers = []
    for attempt in range(3):
        tally.send(f"dup#{attempt}")
        answers.append(client.prefill(request))
        tally.resolve(f"dup#{attempt}")
    assert _steps(server) == before + 1
    assert answers[0] == answers[1] == answers[2]
    different = pb.PrefillRequest(request_id="dup", input_tokens=[3, 4, 6], step_id=101)
    tally.send("dup#other")
    with pytest.raises(AlreadyExistsError):
        client.prefill(different)
    tally.resolve("dup#other", "ALREADY_EXISTS")
    client.release_cache(pb.ReleaseCacheRequest(cache_id=answers[0].completed.kv_cache.cache_id))
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


def test_step_id_zero_is_never_deduplicated(
    server: InProcessServer, client: ExecutorClient
) -> None:
    request = pb.PrefillRequest(request_id="nodup", input_tokens=[3, 4, 5])
    first = client.prefill(request)
    # A request holds one cache at a time: release the first before the identical call.
    client.release_cache(pb.ReleaseCacheRequest(cache_id=first.completed.kv_cache.cache_id))
    second = client.prefill(request)
    assert first.completed.kv_cache.cache_id != second.completed.kv_cache.cache_id
    client.release_cache(pb.ReleaseCacheRequest(cache_id=second.completed.kv_cache.cache_id))


def test_refusals_are_forgotten_so_a_corrected_retry_runs(client: ExecutorClient) -> None:
    bad = pb.PrefillRequest(request_id="fix", input_tokens=[3, 99999], step_id=202)
    with pytest.raises(InvalidArgumentError):
        client.prefill(bad)
    good = pb.PrefillRequest(request_id="fix", input_tokens=[3, 4], step_id=202)
    answer = client.prefill(good)
    client.release_cache(pb.ReleaseCacheRequest(cache_id=answer.completed.kv_cache.cache_id))


def test_in_flight_duplicates_join_the_running_step(server: InProcessServer) -> None:
    tally = Tally("in-flight-duplicates")

    async def scenario() -> list[pb.UnifiedBatchResponse]:
        builder = BatchBuilder()
        builder.add_prefill_chunk("joined", "", [7, 8, 9], 0, 3)
        request = pb.UnifiedBatchRequest(items=builder.build(), step_id=303)
        hold = asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(server.engine.call(time.sleep, 0.5), server.loop)
        )
        async with AsyncExecutorClient(server.target) as client:
            for k in range(4):
                tally.send(f"joined#{k}")
            answers = await asyncio.gather(*(client.unified_batch(request) for _ in range(4)))
            for k in range(4):
                tally.resolve(f"joined#{k}")
            # The step stream shares the ledger: the same batch replays there too.
            async with client.step_stream() as stream:
                tally.send("joined#stream")
                replay = await stream.run(request)
                tally.resolve("joined#stream")
            await hold
            return [*answers, replay]

    before = _steps(server)
    answers = run_scenario(scenario())
    assert _steps(server) == before + 1
    assert all(a == answers[0] for a in answers)
    with ExecutorClient(server.target) as client:
        client.release_cache(pb.ReleaseCacheRequest(cache_id=answers[0].results.cache_ids[0]))
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


def test_the_ledger_is_bounded(server: InProcessServer, client: ExecutorClient) -> None:
    ledger = server.running.servicer.dispatch.ledger
    first = pb.PrefillRequest(request_id="old", input_tokens=[5, 5], step_id=1000)
    opened = client.prefill(first).completed.kv_cache.cache_id
    for step_id in range(1001, 1001 + 2 * LEDGER):
        client.release_cache(pb.ReleaseCacheRequest(cache_id=opened, step_id=step_id))
    assert len(ledger) == LEDGER
    # Step 1000 was evicted: a retry answers the typed "result no longer held", never runs again.
    before = _steps(server)
    with pytest.raises(StepResultEvictedError) as caught:
        client.prefill(first)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert _steps(server) == before
    assert not server.engine.kv.caches  # step 1001 released it; the retry opened nothing


def test_fencing_refuses_stale_and_unfenced_calls_without_changing_anything() -> None:
    with serve_in_process(engine={"require_fencing": True}) as server:
        tally = Tally("fencing[require]")
        with ExecutorClient(server.target) as client:
            instance = client.get_info().executor_instance_id
            before = (_steps(server), len(server.engine.kv.caches))
            for name, claimed in (("unfenced", 0), ("stale", instance ^ 2)):
                tally.send(name)
                with pytest.raises(StaleExecutorError) as caught:
                    client.prefill(
                        pb.PrefillRequest(
                            request_id=name,
                            input_tokens=[1, 2],
                            executor_instance_id=claimed,
                            step_id=9,
                        )
                    )
                assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
                tally.resolve(name, caught.value.code.name)
            assert (_steps(server), len(server.engine.kv.caches)) == before
            tally.send("fenced")
            answer = client.prefill(
                pb.PrefillRequest(
                    request_id="fenced", input_tokens=[1, 2], executor_instance_id=instance
                )
            )
            tally.resolve("fenced")
            client.release_cache(
                pb.ReleaseCacheRequest(
                    cache_id=answer.completed.kv_cache.cache_id, executor_instance_id=instance
                )
            )
            tally.blocks_leaked = server.blocks_leaked()
    report(tally)


# -- the ledger's byte bound ---------------------------------------------------------------------

LEDGER_BYTES = 1024**2
VERIFY_TOKENS = 64  # 64 logits rows of 2 KiB (tiny vocabulary 512): 128 KiB per response
VERIFY_CALLS = 300  # 37.5 MiB of responses, 37 times the bound


def test_ledger_bytes_are_bounded_and_an_evicted_id_is_never_run_again() -> None:
    tally = Tally("ledger-bytes")
    logits = SamplingOptions(full_logits=True).to_pb()
    with (
        serve_in_process(server={"step_ledger_max_bytes": LEDGER_BYTES}) as server,
        ExecutorClient(server.target) as client,
    ):
        opened = client.prefill(pb.PrefillRequest(request_id="lb", input_tokens=[3, 4, 5, 6]))
        cache = opened.completed.kv_cache.cache_id

        def verify(step_id: int) -> pb.ForwardVerifyResponse:
            request = pb.ForwardVerifyRequest(
                request_id="lb",
                cache_id=cache,
                token_ids=[7] * VERIFY_TOKENS,
                position=4,
                sampling=logits,
                step_id=step_id,
            )
            answer = client.forward_verify(request)
            if answer.completed.kv_cache.num_tokens > 4:
                client.truncate_kv(pb.TruncateKvRequest(cache_id=cache, new_length=4))
            return answer

        for _ in range(20):  # the same traffic without step ids first: a warm allocator
            verify(0)
        base = peak = rss_bytes()
        for step_id in range(1, VERIFY_CALLS + 1):
            tally.send(f"verify#{step_id}")
            answer = verify(step_id)
            assert len(answer.completed.logits) == VERIFY_TOKENS * 512 * 4
            tally.resolve(f"verify#{step_id}")
            peak = max(peak, rss_bytes())
        tally.rss_growth_bytes = peak - base
        ledger = server.running.servicer.dispatch.ledger
        assert 0 < ledger.num_bytes <= LEDGER_BYTES
        exported = server.running.metrics.registry.get_sample_value(
            "ferrum_executor_step_ledger_bytes"
        )
        assert exported == ledger.num_bytes
        # The oldest ids were evicted: a retry gets the typed code and nothing runs.
        steps = _steps(server)
        for step_id in (1, VERIFY_CALLS // 2):
            tally.send(f"verify#{step_id}-retry")
            with pytest.raises(StepResultEvictedError) as caught:
                verify(step_id)
            assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "no longer held" in str(caught.value)
            tally.resolve(f"verify#{step_id}-retry", caught.value.code.name)
        # The newest is still held and replayed.
        tally.send("verify#last-retry")
        assert verify(VERIFY_CALLS).completed.logits == answer.completed.logits
        tally.resolve("verify#last-retry")
        assert _steps(server) == steps
        client.release_cache(pb.ReleaseCacheRequest(cache_id=cache))
        tally.blocks_leaked = server.blocks_leaked()
    tally.notes = f"ledger={ledger.num_bytes / 2**20:.2f}MiB of {LEDGER_BYTES / 2**20:.0f}MiB"
    report(tally)
    # Unbounded, the ledger kept every response (37.5 MiB here, twice over with the engine's
    # copy of the logits); bounded, the growth is the bound plus allocator noise.
    assert tally.rss_growth_bytes < 16 * 1024**2, tally.line()


# -- step ids are per caller ---------------------------------------------------------------------

TOKEN_A, TOKEN_B = "caller-a-t0ken", "caller-b-t0ken"


def _two_callers_one_step_id(
    server: InProcessServer,
    first: ExecutorClient,
    second: ExecutorClient,
    tally: Tally,
    label: str = "",
) -> None:
    """Both callers send a prefill under step id 1: each gets its own result (were step ids
    shared, the second payload would be ALREADY_EXISTS under the used id); a retry still
    deduplicates per caller; the first caller's next decode works. Each caller names its own
    request (a request id holds one live cache, whoever opens it)."""
    requests = {
        name: pb.PrefillRequest(request_id=f"shared-{name}", input_tokens=[3, 4, 5], step_id=1)
        for name in ("first", "second")
    }
    request = requests["first"]
    steps = _steps(server)
    answers = {}
    for name, client in (("first", first), ("second", second)):
        tally.send(f"{label}{name}#prefill")
        answers[name] = client.prefill(requests[name]).completed
        tally.resolve(f"{label}{name}#prefill")
    assert _steps(server) == steps + 2
    caches = {name: answer.kv_cache.cache_id for name, answer in answers.items()}
    assert caches["first"] != caches["second"]
    tally.send(f"{label}first#retry")
    assert first.prefill(request).completed == answers["first"]
    tally.resolve(f"{label}first#retry")
    assert _steps(server) == steps + 2
    for name, client in (("first", first), ("second", second)):
        tally.send(f"{label}{name}#decode")
        decoded = client.decode(
            pb.DecodeRequest(
                request_id=f"shared-{name}",
                cache_id=caches[name],
                input_token=answers[name].output.token.token_id,
                position=3,
                step_id=2,
            )
        )
        assert decoded.completed.kv_cache.num_tokens == 4
        tally.resolve(f"{label}{name}#decode")
        client.release_cache(pb.ReleaseCacheRequest(cache_id=caches[name]))


def test_two_callers_with_one_step_id_by_token(tmp_path: pathlib.Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"execute:{TOKEN_A}\nexecute:{TOKEN_B}\n")
    security = SecurityConfig(auth_token_file=str(tokens))
    tally = Tally("two-callers-one-step-id[tokens]")
    with (
        serve_in_process(server={"security": security}) as server,
        ExecutorClient(server.target, token=TOKEN_A) as first,
        ExecutorClient(server.target, token=TOKEN_B) as second,
    ):
        _two_callers_one_step_id(server, first, second, tally)
        # One token, two sessions: kept apart too (schedulers sharing a token).
        with (
            ExecutorClient(server.target, token=TOKEN_A, session_id="replica-1") as one,
            ExecutorClient(server.target, token=TOKEN_A, session_id="replica-2") as two,
        ):
            _two_callers_one_step_id(server, one, two, tally, "sessions-under-a-token:")
        tally.blocks_leaked = server.blocks_leaked()
    report(tally)


def test_two_callers_with_one_step_id_by_session(server: InProcessServer) -> None:
    tally = Tally("two-callers-one-step-id[sessions]")
    with (
        ExecutorClient(server.target, session_id="scheduler-a") as first,
        ExecutorClient(server.target, session_id="scheduler-b") as second,
    ):
        _two_callers_one_step_id(server, first, second, tally)

    async def streams() -> tuple[str, str, str]:
        """A unified step on a stream is scoped the same way, and shares the caller's ledger
        with its unary calls."""
        builder = BatchBuilder()
        # One payload for both callers: an anonymous cache (no request id), since a request id
        # holds one live cache whoever opens it.
        builder.add_prefill_chunk("", "", [5, 6, 7], 0, 3)
        step = pb.UnifiedBatchRequest(items=builder.build(), step_id=3)
        async with (
            AsyncExecutorClient(server.target, session_id="scheduler-a") as first,
            AsyncExecutorClient(server.target, session_id="scheduler-b") as second,
        ):
            tally.send("first#unary-step")
            mine = (await first.unified_batch(step)).results.cache_ids[0]
            tally.resolve("first#unary-step")
            async with second.step_stream() as stream:
                tally.send("second#stream-step")
                theirs = (await stream.run(step)).results.cache_ids[0]
                tally.resolve("second#stream-step")
            async with first.step_stream() as stream:
                tally.send("first#stream-retry")
                again = (await stream.run(step)).results.cache_ids[0]
                tally.resolve("first#stream-retry")
            return mine, theirs, again

    mine, theirs, again = run_scenario(streams())
    assert mine != theirs and again == mine
    with ExecutorClient(server.target) as client:
        for cache_id in (mine, theirs):
            client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


def test_an_overlong_session_header_is_refused(server: InProcessServer) -> None:
    overlong = (("ferrum-session", "s" * 257),)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.ExecutorServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Prefill(
                pb.PrefillRequest(request_id="s", input_tokens=[1], step_id=5),
                metadata=overlong,
                timeout=10,
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "256 bytes" in caught.value.details()
        stream = stub.StepStream(iter(()), metadata=overlong, timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            list(stream)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not server.engine.kv.caches
