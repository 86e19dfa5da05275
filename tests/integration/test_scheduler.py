"""The reference scheduler: continuous batching equals one-at-a-time greedy, budgets and chunking
hold at every step, steps are pipelined, stop tokens end requests, cancellation frees capacity,
and the in-process backend runs the same policy to the same outputs."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator

import pytest
from ferrum_client import AsyncExecutorClient
from ferrum_client.scheduler import GenerationParams, ItemKind, Scheduler, SchedulerConfig
from helpers_server import (
    LiveServer,
    assert_quiescent,
    random_prompts,
    start_live_server,
    tiny_block_bytes,
    tiny_split,
)


def _server(tp: int) -> Iterator[LiveServer]:
    yield from start_live_server(
        block_size=4,
        max_batch_tokens=512,
        max_batch_size=64,
        prefix_caching=False,
        **tiny_split(tp, blocks=2048, block_size=4),
    )


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    yield from _server(1)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def either(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    """The tiny model on one rank, and split over 2: the scheduler must see the same executor
    (a subset of this file's tests runs on both, to keep CI's time)."""
    yield from _server(request.param)


@pytest.fixture(scope="module")
def small() -> Iterator[LiveServer]:
    """40 blocks of 4 tokens: one long request leaves no room for another."""
    yield from start_live_server(
        block_size=4,
        kv_cache_bytes=40 * tiny_block_bytes(4),
        max_batch_tokens=256,
        max_batch_size=8,
    )


@pytest.fixture(scope="module")
def narrow() -> Iterator[LiveServer]:
    """An executor that takes at most 24 tokens and 3 items a forward."""
    yield from start_live_server(
        block_size=4,
        kv_cache_bytes=512 * tiny_block_bytes(4),
        max_batch_tokens=24,
        max_batch_size=3,
        prefix_caching=False,
    )


def _generate(
    server: LiveServer,
    prompts: list[list[int]],
    params: GenerationParams | list[GenerationParams],
    config: SchedulerConfig,
) -> tuple[list[list[int]], list[str], Scheduler]:
    async def scenario() -> tuple[list[list[int]], list[str], Scheduler]:
        async with AsyncExecutorClient(server.target) as client:
            scheduler = Scheduler(client, config)
            results = await scheduler.generate(prompts, params)
        return [r.output_ids for r in results], [r.finish_reason for r in results], scheduler

    return server.run(scenario())  # type: ignore[return-value]


def test_mixed_batches_equal_single_request_greedy(either: LiveServer) -> None:
    prompts = random_prompts(11, 14, 3, 40)
    lengths = [3 + (i * 5) % 13 for i in range(len(prompts))]  # mixed output lengths
    params = [GenerationParams(max_new_tokens=n) for n in lengths]
    # Prompts start as soon as they are prefilled, so decodes and chunks share steps.
    config = SchedulerConfig(max_step_tokens=24, pipeline_depth=2, align_first_tokens=False)
    outputs, reasons, scheduler = _generate(either, prompts, params, config)
    assert reasons == ["length"] * len(prompts)
    assert [len(o) for o in outputs] == lengths
    alone_config = SchedulerConfig(max_step_tokens=512, pipeline_depth=1)
    for prompt, p, got in zip(prompts, params, outputs, strict=True):
        want, _, _ = _generate(either, [prompt], p, alone_config)
        assert got == want[0]
    # The batches really were mixed: some steps carried decodes and prefill chunks together.
    records = scheduler.stats.records
    assert any(r.num_decodes and r.num_prefill_tokens for r in records)
    assert_quiescent(either)


@pytest.mark.parametrize("depth", [1, 2])
def test_aligned_first_tokens_start_the_burst_together(server: LiveServer, depth: int) -> None:
    """A burst is prefilled up to each prompt's last token, in prefill-only steps within
    max_prefill_step_tokens (larger than the budget); one step within the budget then yields
    every first token and the whole batch decodes together. Outputs equal single-request
    greedy runs."""
    prompts = random_prompts(7, 6, 5, 60)
    params = GenerationParams(max_new_tokens=5)
    budget, held = 40, 80
    config = SchedulerConfig(
        max_step_tokens=budget, max_prefill_step_tokens=held, pipeline_depth=depth
    )
    outputs, reasons, scheduler = _generate(server, prompts, params, config)
    assert reasons == ["length"] * len(prompts)
    records = scheduler.stats.records
    assert sum(r.num_prefill_tokens for r in records) == sum(len(p) for p in prompts)
    first_decode = next(i for i, r in enumerate(records) if r.num_decodes)
    # Several prefill-only steps (the prompts need more than one of them), then decodes only:
    # no prompt started while another was still being prefilled.
    assert first_decode >= 2 and sum(len(p) for p in prompts) > held
    assert all(r.num_decodes == 0 for r in records[:first_decode])
    # The held steps use the larger size; the step of first tokens and every decode step keep
    # to the budget.
    assert all(r.num_tokens <= held for r in records[: first_decode - 1])
    assert records[0].num_tokens > budget
    assert all(r.num_tokens <= budget for r in records[first_decode - 1 :])
    assert all(r.num_prefill_tokens == 0 for r in records[first_decode:])
    # The step before the first decode computed every prompt's last token (depth 1: the whole
    # batch decodes in every later step).
    assert records[first_decode - 1].num_prefill_items == len(prompts)
    if depth == 1:
        assert all(r.num_decodes == len(prompts) for r in records[first_decode:])
    alone = SchedulerConfig(max_step_tokens=512, pipeline_depth=1)
    for prompt, got in zip(prompts, outputs, strict=True):
        want, _, _ = _generate(server, [prompt], params, alone)
        assert got == want[0]
    assert_quiescent(server)


def test_aligned_first_tokens_cost_a_lone_prompt_no_extra_step(server: LiveServer) -> None:
    """Holding back a last token only to compute it alone would add a step: when what is left
    fits one ordinary step the prompt simply completes, aligned or not."""
    params = GenerationParams(max_new_tokens=3)
    for length in (20, 50):  # within one 40-token budget, and split across two steps
        prompt = random_prompts(1, 1, length, length)
        steps = []
        for align in (True, False):
            # Held steps at the plain budget too, so the two runs' steps compare one for one.
            config = SchedulerConfig(
                max_step_tokens=40, max_prefill_step_tokens=40, align_first_tokens=align
            )
            _, _, scheduler = _generate(server, prompt, params, config)
            steps.append([(r.num_decodes, r.num_prefill_tokens) for r in scheduler.stats.records])
        assert steps[0] == steps[1]
        assert sum(1 for _, prefill in steps[0] if prefill) == (1 if length <= 40 else 2)
    assert_quiescent(server)


@pytest.mark.parametrize("continuation", [False, True])
def test_first_token_hold_is_bounded(server: LiveServer, continuation: bool) -> None:
    """max_first_token_hold_ms = 0: a held prompt starts at once, so the burst's later prompts
    are prefilled beside its decodes, as without alignment. With decode continuation too, whose
    steps are nearly always in flight (the bound once held every prompt to the burst's end)."""
    prompts = random_prompts(9, 6, 30, 60)
    # Held steps of 40 too: with larger ones every prompt would reach its last token at once.
    config = SchedulerConfig(
        max_step_tokens=40,
        max_prefill_step_tokens=40,
        max_first_token_hold_ms=0,
        decode_continuation=continuation,
    )
    _, reasons, scheduler = _generate(server, prompts, GenerationParams(max_new_tokens=4), config)
    assert reasons == ["length"] * len(prompts)
    assert any(r.num_decodes and r.num_prefill_tokens for r in scheduler.stats.records)
    assert_quiescent(server)


# pipeline_depth 1 and 2 without decode continuation; with it (the default) two steps in flight.
@pytest.mark.parametrize(("depth", "continuation"), [(1, False), (2, False), (1, True)])
def test_budget_and_chunking_hold_at_every_step(
    either: LiveServer, depth: int, continuation: bool
) -> None:
    prompts = random_prompts(5, 10, 20, 70)
    budget = 32
    # The burst's held, prefill-only steps kept to the budget too (they may be larger).
    config = SchedulerConfig(
        max_step_tokens=budget,
        max_prefill_step_tokens=budget,
        pipeline_depth=depth,
        decode_continuation=continuation,
    )
    _, reasons, scheduler = _generate(either, prompts, GenerationParams(max_new_tokens=6), config)
    assert reasons == ["length"] * len(prompts)
    records = scheduler.stats.records
    assert records and all(r.num_tokens <= budget for r in records)
    assert all(size <= budget for r in records for size in r.chunk_sizes)
    # Prompts longer than the budget were split across steps.
    assert sum(r.num_prefill_tokens for r in records) == sum(len(p) for p in prompts)
    assert max(len(p) for p in prompts) > budget
    assert scheduler.stats.max_in_flight == (2 if continuation else depth)
    assert (scheduler.stats.continuations > 0) == continuation
    assert_quiescent(either)


def test_stop_token_ends_a_request(server: LiveServer) -> None:
    prompt = random_prompts(9, 1, 12, 12)[0]
    config = SchedulerConfig()
    full, _, _ = _generate(server, [prompt], GenerationParams(max_new_tokens=12), config)
    stop = full[0][4]
    cut = full[0].index(stop) + 1
    stopped, reasons, _ = _generate(
        server, [prompt], GenerationParams(max_new_tokens=12, stop_token_ids=(stop,)), config
    )
    assert stopped[0] == full[0][:cut] and reasons == ["stop"]
    assert_quiescent(server)


def test_stream_yields_every_token_in_order(either: LiveServer) -> None:
    prompts = random_prompts(3, 4, 5, 30)

    async def scenario() -> tuple[dict[int, list[int]], list[list[int]]]:
        async with AsyncExecutorClient(either.target) as client:
            streamed: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
            async for index, token in Scheduler(client).stream(
                prompts, GenerationParams(max_new_tokens=5)
            ):
                streamed[index].append(token)
            results = await Scheduler(client).generate(prompts, GenerationParams(5))
        return streamed, [r.output_ids for r in results]

    streamed, whole = either.run(scenario())  # type: ignore[misc]
    assert [streamed[i] for i in range(len(prompts))] == whole
    assert_quiescent(either)


def test_cancellation_frees_capacity_for_a_waiting_request(small: LiveServer) -> None:
    """A hog holds the pool; the second request waits for capacity; cancelling the hog lets
    it run, and the pool ends whole."""
    hog, late = random_prompts(4, 2, 100, 100)

    async def scenario() -> tuple[list[str], list[int], int]:
        async with AsyncExecutorClient(small.target) as client:
            scheduler = Scheduler(client, SchedulerConfig(max_step_tokens=64))
            params = [GenerationParams(max_new_tokens=50), GenerationParams(max_new_tokens=4)]
            late_tokens = 0
            hog_tokens = 0
            async for index, _ in scheduler.stream([hog, late], params):
                if index == 0:
                    hog_tokens += 1
                    if hog_tokens == 3:
                        # Before the cancel, the late request has been deferred, not run.
                        assert scheduler.stats.admissions_deferred >= 1
                        assert late_tokens == 0
                        scheduler.cancel(0)
                else:
                    late_tokens += 1
            reasons = [r.result.finish_reason for r in scheduler._by_index.values()]
            outputs = [len(r.result.output_ids) for r in scheduler._by_index.values()]
            return reasons, outputs, late_tokens

    reasons, outputs, late_tokens = small.run(scenario())  # type: ignore[misc]
    assert reasons == ["cancelled", "length"]
    assert outputs[0] < 50 and late_tokens == 4
    assert_quiescent(small)


def test_in_process_backend_matches_grpc(server: LiveServer) -> None:
    from ferrum_server.config import EngineConfig
    from ferrum_server.engine import Engine
    from ferrum_server.tools.bench.inproc import InProcessBackend

    prompts = random_prompts(21, 8, 4, 50)
    config = SchedulerConfig(max_step_tokens=40)
    params = GenerationParams(max_new_tokens=7)
    over_grpc, _, _ = _generate(server, prompts, params, config)
    engine = Engine(
        EngineConfig(block_size=4, kv_cache_bytes=1024 * tiny_block_bytes(4), prefix_caching=False)
    )
    try:
        results = asyncio.run(Scheduler(InProcessBackend(engine), config).generate(prompts, params))
    finally:
        engine.shutdown()
    assert [r.output_ids for r in results] == over_grpc
    assert not engine.kv.caches


def test_in_process_backend_waits_for_capacity_without_polling(server: LiveServer) -> None:
    """A pool too small for the workload: deferred admissions park on the engine's epoch
    bumps (CapacityNotifier), and the outputs still equal the roomy gRPC run."""
    from ferrum_server.config import EngineConfig
    from ferrum_server.engine import Engine
    from ferrum_server.tools.bench.inproc import InProcessBackend

    prompts = random_prompts(23, 8, 6, 20)
    config = SchedulerConfig(max_step_tokens=32)
    params = GenerationParams(max_new_tokens=10)
    expected, _, _ = _generate(server, prompts, params, config)
    engine = Engine(
        EngineConfig(block_size=4, kv_cache_bytes=24 * tiny_block_bytes(4), prefix_caching=False)
    )
    try:
        scheduler = Scheduler(InProcessBackend(engine), config)
        results = asyncio.run(scheduler.generate(prompts, params))
    finally:
        engine.shutdown()
    assert [r.output_ids for r in results] == expected
    assert scheduler.stats.admissions_deferred > 0
    assert scheduler.stats.admissions_deferred <= scheduler.stats.wakeups + (
        scheduler.stats.own_releases
    )
    # The backend's notifier unsubscribed on close; only the engine's gauge listener is left.
    assert engine.kv.clock.listeners == [engine.publish_gauges]


def _run_with_step_times(
    server: LiveServer,
    step_ms: Callable[[int, int], float],
    prompts: list[list[int]],
    max_new_tokens: int,
    config: SchedulerConfig,
) -> Scheduler:
    """Generate on the live server with every step reported as taking step_ms(decodes,
    prefill tokens): the scheduler's step-time fit then sees costs chosen by the test."""
    from ferrum_client.scheduler import GrpcBackend, StepResult, StepTiming

    class SyntheticTiming(GrpcBackend):
        def submit(self, items):  # type: ignore[no-untyped-def]
            decodes = sum(1 for item in items if item.kind == ItemKind.DECODE)
            prefill = sum(len(item.tokens) for item in items if item.kind != ItemKind.DECODE)
            pending = super().submit(items)

            async def timed() -> StepResult:
                result = await pending
                ns = round(step_ms(decodes, prefill) * 1e6)
                return dataclasses.replace(result, timing=StepTiming(0, ns, 0, ns))

            return timed()

    async def scenario() -> Scheduler:
        async with AsyncExecutorClient(server.target) as client:
            scheduler = Scheduler(SyntheticTiming(client), config)
            params = GenerationParams(max_new_tokens=max_new_tokens)
            results = await scheduler.generate(prompts, params)
            assert [r.finish_reason for r in results] == ["length"] * len(prompts)
        return scheduler

    return server.run(scenario())


# With decode continuation a step is planned while the one before runs: the model has then
# learned one step later.
@pytest.mark.parametrize("continuation", [False, True])
def test_step_time_target_lowers_the_budget_and_keeps_decodes(
    server: LiveServer, continuation: bool
) -> None:
    """With a step-time target the budget follows the executor's reported step times: a
    synthetic cost of 5 ms + 1 ms per token and a 40 ms target allow 35 tokens a step."""
    prompts = random_prompts(8, 12, 30, 90)
    config = SchedulerConfig(
        max_step_tokens=128,
        target_step_ms=40,
        align_first_tokens=False,
        decode_continuation=continuation,
    )
    scheduler = _run_with_step_times(server, lambda d, p: 5 + d + p, prompts, 8, config)
    records = scheduler.stats.records
    # The first steps run at max_step_tokens while the model learns; then none exceeds the
    # 35 tokens the target allows, unless running decodes alone need more (the floor).
    lag = 1 if continuation else 0
    learned = records[scheduler.cost.min_observations + lag :]
    assert any(r.num_tokens > 35 for r in records[: scheduler.cost.min_observations])
    assert learned and all(r.num_tokens <= max(35, r.num_decodes + 32) for r in learned)
    assert any(r.num_prefill_tokens and r.num_decodes for r in learned)
    assert_quiescent(server)


@pytest.mark.parametrize("continuation", [False, True])
def test_prefill_keeps_its_share_of_the_target_when_the_decodes_alone_exceed_it(
    server: LiveServer, continuation: bool
) -> None:
    """Synthetic costs where a decode is dear (12 ms) and a prefill token cheap (0.1 ms), as
    on a GPU: 3 decodes already take 41 ms of a 40 ms target. The fit tells the two apart, so
    prompts still prefill 20 ms (200 tokens' worth) a step beside them instead of 32 tokens,
    and no step holds more prefill than the target and that share allow."""
    from ferrum_client.scheduler import MIN_PREFILL_TOKENS

    prompts = random_prompts(9, 16, 60, 200)
    config = SchedulerConfig(
        max_step_tokens=256,
        target_step_ms=40,
        min_prefill_share=0.5,
        align_first_tokens=False,
        decode_continuation=continuation,
    )
    scheduler = _run_with_step_times(server, lambda d, p: 5 + 12 * d + 0.1 * p, prompts, 12, config)
    lag = 1 if continuation else 0  # as above: with continuation the model learns a step later
    learned = scheduler.stats.records[scheduler.cost.min_observations + lag :]
    fitted = scheduler.cost.fit()
    assert fitted is not None and fitted.per_decode_s > 10 * fitted.per_prefill_token_s

    def allowed(decodes: int) -> int:  # prefill tokens the true costs and the share allow
        left_ms = max(40 - 5 - 12 * decodes, 0.5 * 40)
        return max(MIN_PREFILL_TOKENS, int(left_ms / 0.1 + 1e-6))

    assert all(r.num_prefill_tokens <= allowed(r.num_decodes) for r in learned)
    # Steps whose decodes alone exceed the target and that still prefill more than the floor.
    # With min_prefill_share=0 there is one: planned before the fit told the costs apart.
    over = [r for r in learned if r.num_decodes >= 3 and r.num_prefill_tokens > MIN_PREFILL_TOKENS]
    assert len(over) >= 3, [(r.num_decodes, r.num_prefill_tokens) for r in learned]
    assert_quiescent(server)


@pytest.mark.parametrize("align", [True, False])
def test_steps_stay_within_the_executors_limits(
    narrow: LiveServer, server: LiveServer, align: bool
) -> None:
    """The scheduler reads the executor's per-forward limits (capabilities) and keeps every
    step within them whatever its own max_step_tokens, running at most as many requests as
    one step can carry; outputs still equal single-request greedy runs."""
    prompts = random_prompts(17, 5, 10, 40)
    params = GenerationParams(max_new_tokens=4)
    config = SchedulerConfig(max_step_tokens=512, align_first_tokens=align)
    outputs, reasons, scheduler = _generate(narrow, prompts, params, config)
    assert reasons == ["length"] * len(prompts)
    records = scheduler.stats.records
    assert records and all(r.num_tokens <= 24 for r in records)
    assert all(r.num_decodes + r.num_prefill_items <= 3 for r in records)
    assert max(r.num_tokens for r in records) == 24  # the limit, not 512, was the budget
    for prompt, got in zip(prompts, outputs, strict=True):
        want, _, _ = _generate(server, [prompt], params, SchedulerConfig())
        assert got == want[0]
    assert_quiescent(narrow)


def test_a_prompt_that_does_not_fit_starts_with_the_narrower_chunk_the_executor_hints(
    small: LiveServer, narrow: LiveServer
) -> None:
    """Another client's cache holds 30 of the 40 blocks. An 80-token prompt (20 blocks) is
    deferred with a hint of 40 tokens (the 10 free blocks); the scheduler re-probes with that
    first chunk, prefills those 40 tokens at once (its chunk narrowed to them), then parks its
    next chunk on the KV source, never polling; once the blocker is released the prompt
    finishes with the same tokens as in a roomy pool (issue #14, items 4 and 8)."""
    from ferrum_client import pb

    blocker_prompt, prompt = random_prompts(41, 2, 120, 120)
    prompt = prompt[:80]
    params = GenerationParams(max_new_tokens=4)
    config = SchedulerConfig(max_step_tokens=128)
    # The reference: the same prompt in a pool with room (in chunks of 24: the same tokens).
    expected, _, _ = _generate(narrow, [prompt], params, SchedulerConfig())
    kv = small.engine.kv  # type: ignore[attr-defined]

    from ferrum_client.scheduler import GrpcBackend

    class ReleaseBlockerOnWait(GrpcBackend):
        """Releases the blocker the first time the scheduler parks (no sleeps, no polling)."""

        blocker_id = ""
        committed_when_parked = -1

        async def wait_for_capacity(self, wait: object, timeout_ms: int) -> bool:
            if self.blocker_id:
                ours = [c for c in kv.caches.values() if c.request_id != "blocker"]
                self.committed_when_parked = ours[0].num_tokens if ours else 0
                await self.client.release_cache(pb.ReleaseCacheRequest(cache_id=self.blocker_id))
                self.blocker_id = ""
            return await super().wait_for_capacity(wait, timeout_ms)

    async def scenario() -> tuple[list[int], Scheduler, int]:
        async with AsyncExecutorClient(small.target) as client:
            blocker = await client.prefill(
                pb.PrefillRequest(request_id="blocker", input_tokens=blocker_prompt)
            )
            backend = ReleaseBlockerOnWait(client)
            backend.blocker_id = blocker.completed.kv_cache.cache_id
            scheduler = Scheduler(backend, config)
            results = await scheduler.generate([prompt], params)
        return results[0].output_ids, scheduler, backend.committed_when_parked

    output, scheduler, committed = small.run(scenario())  # type: ignore[misc]
    assert output == expected[0]
    stats = scheduler.stats
    assert stats.narrowed_admissions == 1 and stats.narrowed_chunks >= 1
    assert committed == 40  # the hinted prefix ran while the blocker held the rest
    # One deferred chunk, then a wait on its source: no step was resubmitted meanwhile.
    assert stats.deferred_items == 1 and stats.capacity_waits == 1
    assert_quiescent(small)
