"""Duplicate step ids, replays across unary calls and the step stream, fencing."""

from __future__ import annotations

import asyncio
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
    StaleExecutorError,
    pb,
)
from reliability.harness import InProcessServer, Tally, report, run_scenario, serve_in_process

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
    first, second = client.prefill(request), client.prefill(request)
    assert first.completed.kv_cache.cache_id != second.completed.kv_cache.cache_id
    for answer in (first, second):
        client.release_cache(pb.ReleaseCacheRequest(cache_id=answer.completed.kv_cache.cache_id))


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
    # Step 1000 was evicted: the same request is now a new step (documented bound).
    again = client.prefill(first).completed.kv_cache.cache_id
    assert again != opened
    client.release_cache(pb.ReleaseCacheRequest(cache_id=again))


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
