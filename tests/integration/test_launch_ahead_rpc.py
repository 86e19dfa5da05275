"""--launch-ahead over gRPC: each step is launched in its caller's turn and finished by a later
job on the engine thread, so a continuation step sent before the previous answer launches
first (docs/architecture.md, "Launching ahead"). Outputs, stop tokens, deferrals, preemption
and a cancellation with a continuation in flight come out as with steps run whole."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import pytest
from ferrum_client import AsyncExecutorClient
from ferrum_client.scheduler import GenerationParams, GenerationResult, Scheduler, SchedulerConfig
from helpers_server import LiveServer, random_prompts, start_live_server, tiny_block_bytes

CONTINUE = SchedulerConfig(max_step_tokens=64, decode_continuation=True)
PLAIN = SchedulerConfig(max_step_tokens=64)
ROOMY = {
    "block_size": 4,
    "kv_cache_bytes": 2048 * tiny_block_bytes(4),
    "max_batch_tokens": 512,
    "max_batch_size": 64,
    "prefix_caching": True,
}
TIGHT = {  # 24 blocks of 4 tokens: room for about three of the requests at once
    "block_size": 4,
    "kv_cache_bytes": 24 * tiny_block_bytes(4),
    "max_batch_tokens": 256,
    "max_batch_size": 16,
}


@pytest.fixture(scope="module")
def whole() -> Iterator[LiveServer]:
    yield from start_live_server(**ROOMY)


@pytest.fixture(scope="module")
def ahead() -> Iterator[LiveServer]:
    yield from start_live_server(**ROOMY, launch_ahead=True)


@pytest.fixture(scope="module")
def tight_ahead() -> Iterator[LiveServer]:
    yield from start_live_server(**TIGHT, launch_ahead=True)


def _generate(
    server: LiveServer,
    prompts: list[list[int]],
    params: Sequence[GenerationParams],
    config: SchedulerConfig,
) -> tuple[list[GenerationResult], Scheduler]:
    async def scenario() -> tuple[list[GenerationResult], Scheduler]:
        async with AsyncExecutorClient(server.target) as client:
            scheduler = Scheduler(client, config)
            result = await asyncio.wait_for(scheduler.generate(prompts, params), 120)
            return result, scheduler

    return server.run(scenario())  # type: ignore[return-value]


def _assert_quiescent(server: LiveServer) -> None:
    engine = server.engine  # type: ignore[attr-defined]
    assert not engine._launched  # every launched step was finished by its call
    kv = engine.kv
    kv.check()
    assert not kv.caches
    assert kv.pool.num_available == kv.pool.num_blocks


def test_outputs_and_stops_equal_steps_run_whole(whole: LiveServer, ahead: LiveServer) -> None:
    prompts = random_prompts(31, 7, 3, 40)
    lengths = [3 + (i * 5) % 13 for i in range(len(prompts))]
    plain, _ = _generate(
        whole, prompts, [GenerationParams(max_new_tokens=n) for n in lengths], PLAIN
    )
    # A stop token that ends the longest request mid-run.
    outputs = plain[lengths.index(max(lengths))].output_ids
    stop = next(t for k, t in enumerate(outputs) if k >= 4 and t not in outputs[:k])
    params = [GenerationParams(max_new_tokens=n, stop_token_ids=(stop,)) for n in lengths]
    expected, _ = _generate(whole, prompts, params, PLAIN)
    engine = ahead.engine  # type: ignore[attr-defined]
    before = engine.stats.launched_ahead_steps
    results, scheduler = _generate(ahead, prompts, params, CONTINUE)
    assert [r.output_ids for r in results] == [r.output_ids for r in expected]
    reasons = [r.finish_reason for r in results]
    assert reasons == [r.finish_reason for r in expected] and "stop" in reasons
    assert scheduler.stats.continuations > 0 and scheduler.stats.max_in_flight == 2
    # Steps did launch while the one before them was in flight.
    assert engine.stats.launched_ahead_steps > before
    _assert_quiescent(ahead)
    _assert_quiescent(whole)


def test_a_tight_pool_defers_and_preempts_to_the_same_outputs(
    whole: LiveServer, tight_ahead: LiveServer
) -> None:
    prompts = random_prompts(7, 10, 6, 20)
    params = [GenerationParams(max_new_tokens=12)] * len(prompts)
    config = SchedulerConfig(max_step_tokens=32, decode_continuation=True)
    expected, _ = _generate(whole, prompts, params, SchedulerConfig(max_step_tokens=32))
    results, scheduler = _generate(tight_ahead, prompts, params, config)
    assert [r.output_ids for r in results] == [r.output_ids for r in expected]
    stats = scheduler.stats
    assert stats.preemptions > 0 and stats.deferred_items > 0 and stats.continuations > 0
    _assert_quiescent(tight_ahead)


def test_a_cancellation_with_a_continuation_in_flight_gives_everything_back(
    whole: LiveServer, ahead: LiveServer
) -> None:
    prompts = random_prompts(47, 3, 8, 16)
    params = [GenerationParams(max_new_tokens=12)] * len(prompts)
    plain, _ = _generate(whole, prompts, params, PLAIN)

    async def scenario() -> list[GenerationResult]:
        async with AsyncExecutorClient(ahead.target) as client:
            scheduler = Scheduler(client, CONTINUE)
            seen = 0
            async for index, _ in scheduler.stream(prompts, params):
                seen += index == 0
                if seen == 3:
                    scheduler.cancel(0)
            return [
                r.result for r in sorted(scheduler._by_index.values(), key=lambda r: r.result.index)
            ]

    results = ahead.run(scenario())  # type: ignore[misc]
    assert [r.finish_reason for r in results] == ["cancelled", "length", "length"]
    assert results[0].output_ids == plain[0].output_ids[: len(results[0].output_ids)]
    assert [r.output_ids for r in results[1:]] == [r.output_ids for r in plain[1:]]
    _assert_quiescent(ahead)
