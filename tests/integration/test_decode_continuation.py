"""Decode continuation (issue #19): a decode item fed the token its cache's last item selected
(BatchItems.continue_decode), and the reference scheduler's mode that keeps two steps in flight
with every running request in each.

Executor side: a continuation equals a decode that carries the token; a continuation on a cache
holding no selected token (a non-final chunk, full logits, a truncation, a stale position, a
released cache) fails alone in a unified step, whole in a transactional one, and changes
nothing; a retried step id replays its stored answer and a re-sent step never reads a token a
later step selected. Scheduler side: outputs equal plain greedy runs, a request that stops has
exactly one extra item whose token nobody sees and whose blocks all come back, step N+1 reaches
the executor before step N's answer is processed, and every running request is in every step;
planned late (continuation_lead_ms), a prompt arriving during a step starts in the next one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from collections.abc import Awaitable, Iterator, Sequence

import grpc
import pytest
from ferrum_client import (
    AsyncExecutorClient,
    BatchBuilder,
    ExecutorClient,
    InvalidArgumentError,
    PositionMismatchError,
    SamplingOptions,
    item_views,
    pb,
)
from ferrum_client.scheduler import (
    GenerationParams,
    GenerationResult,
    GrpcBackend,
    ItemKind,
    PlannedItem,
    Scheduler,
    SchedulerConfig,
    StepResult,
    StepTiming,
)
from helpers_server import (
    LiveServer,
    assert_quiescent,
    random_prompts,
    start_live_server,
    tiny_block_bytes,
)

VOCAB = 512  # the tiny model
ABORTED = grpc.StatusCode.ABORTED.value[0]
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
CONTINUE = SchedulerConfig(max_step_tokens=64, decode_continuation=True)
PLAIN = SchedulerConfig(max_step_tokens=64)


# Every scheduler test runs against steps run whole and against --launch-ahead, where a step
# queued behind the one in flight launches before that one is finished (continuations then
# read their token on the device; docs/architecture.md, "Launching ahead").
LAUNCH_MODES = pytest.fixture(scope="module", params=[False, True], ids=["whole", "ahead"])


@LAUNCH_MODES
def roomy(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    """Prefix caching on: blocks a finished request leaves behind stay cached, and come back."""
    yield from start_live_server(
        block_size=4,
        kv_cache_bytes=2048 * tiny_block_bytes(4),
        max_batch_tokens=512,
        max_batch_size=64,
        prefix_caching=True,
        launch_ahead=request.param,
    )


@LAUNCH_MODES
def tight(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    """24 blocks of 4 tokens: room for about three of the requests at once."""
    yield from start_live_server(
        block_size=4,
        kv_cache_bytes=24 * tiny_block_bytes(4),
        max_batch_tokens=256,
        max_batch_size=16,
        launch_ahead=request.param,
    )


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def _open(
    client: ExecutorClient, request_id: str, prompt: list[int], *, logits: bool = False
) -> tuple[str, int]:
    """Prefill a whole prompt; return its cache and selected token (0 under full logits)."""
    sampling = SamplingOptions(full_logits=logits).to_pb()
    response = client.prefill(
        pb.PrefillRequest(request_id=request_id, input_tokens=prompt, sampling=sampling)
    )
    return response.completed.kv_cache.cache_id, response.completed.output.token.token_id


def _unified(client: ExecutorClient, batch: BatchBuilder, step_id: int = 0) -> list[object]:
    request = pb.UnifiedBatchRequest(items=batch.build(), step_id=step_id)
    return item_views(client.unified_batch(request).results)  # type: ignore[return-value]


def _release(client: ExecutorClient, *cache_ids: str) -> None:
    for cache_id in cache_ids:
        client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))


# -- the executor ----------------------------------------------------------------------------


def test_capabilities_say_continuation_is_supported(client: ExecutorClient) -> None:
    assert client.get_capabilities().capabilities.supports_decode_continuation


def test_a_continuation_equals_a_decode_that_carries_the_token(client: ExecutorClient) -> None:
    prompt = _prompt(3, 13)
    plain, token = _open(client, "cont-plain", prompt)
    continued, first = _open(client, "cont-cont", prompt)
    assert first == token
    position = len(prompt)
    for _ in range(6):
        batch = BatchBuilder()
        batch.add_decode("cont-plain", plain, token, position)
        batch.add_continuation("cont-cont", continued, position)
        items = batch.build()
        # The continuation carries no token: the columns stay unambiguous.
        assert list(items.num_tokens) == [1, 0] and list(items.token_ids) == [token]
        assert list(items.continue_decode) == [False, True]
        a, c = item_views(client.unified_batch(pb.UnifiedBatchRequest(items=items)).results)
        assert a.has_token and c.has_token
        assert c.token_id == a.token_id and c.logprob == pytest.approx(a.logprob, abs=1e-5)
        assert c.committed_tokens == a.committed_tokens == position + 1
        token, position = a.token_id, position + 1
    _release(client, plain, continued)


def test_bad_continuations_fail_alone_and_change_nothing(client: ExecutorClient) -> None:
    prompt = _prompt(5, 12)
    good, _ = _open(client, "bad-good", prompt)
    twin, _ = _open(client, "bad-twin", prompt)
    chunked = client.prefill(
        pb.PrefillRequest(
            request_id="bad-chunk",
            input_tokens=prompt,
            chunk=pb.PrefillChunk(tokens_processed=0, tokens_to_process=8, total_prompt_tokens=12),
        )
    ).completed.kv_cache.cache_id
    logits, _ = _open(client, "bad-logits", prompt, logits=True)
    truncated, token = _open(client, "bad-trunc", prompt)
    decode = BatchBuilder()
    decode.add_decode("bad-trunc", truncated, token, 12)
    assert _unified(client, decode)[0].has_token  # type: ignore[attr-defined]
    client.truncate_kv(pb.TruncateKvRequest(cache_id=truncated, new_length=12))
    released, _ = _open(client, "bad-released", prompt)
    _release(client, released)

    batch = BatchBuilder()
    batch.add_continuation("bad-good", good, 12)  # fine
    batch.add_continuation("bad-chunk", chunked, 8)  # the last item selected nothing
    batch.add_continuation("bad-logits", logits, 12)  # full logits select nothing
    batch.add_continuation("bad-trunc", truncated, 12)  # truncated since it selected
    batch.add_continuation("bad-released", released, 12)  # the cache is gone
    batch.add_continuation("bad-twin", twin, 13)  # not the committed length
    views = _unified(client, batch)
    ok, *bad = views
    assert ok.has_token and ok.committed_tokens == 13  # type: ignore[attr-defined]
    assert [v.failed for v in bad] == [True] * 5  # type: ignore[attr-defined]
    codes = [v.error.code for v in bad]  # type: ignore[attr-defined]
    assert codes == [ABORTED, ABORTED, ABORTED, NOT_FOUND, ABORTED]
    assert "no selected token" in bad[0].error.message  # type: ignore[attr-defined]
    assert "position 13" in bad[4].error.message  # type: ignore[attr-defined]
    # Nothing changed: committed lengths as before, and what each cache holds still works.
    assert [v.committed_tokens for v in bad] == [8, 12, 12, 0, 12]  # type: ignore[attr-defined]
    again = BatchBuilder()
    again.add_continuation("bad-twin", twin, 12)  # its selected token is untouched
    again.add_prefill_chunk("bad-chunk", chunked, prompt[8:], 8, 12)
    again.add_decode("bad-trunc", truncated, token, 12)
    twin_view, chunk_view, trunc_view = _unified(client, again)
    assert twin_view.token_id == ok.token_id  # type: ignore[attr-defined]
    assert chunk_view.has_token and trunc_view.has_token  # type: ignore[attr-defined]

    # A transactional call is refused whole: the good item does not run either.
    all_or_nothing = BatchBuilder()
    all_or_nothing.add_continuation("bad-good", good, 13)
    all_or_nothing.add_continuation("bad-logits", logits, 12)
    with pytest.raises(PositionMismatchError, match="no selected token"):
        client.batch_decode(pb.BatchDecodeRequest(items=all_or_nothing.build()))
    check = BatchBuilder()
    check.add_continuation("bad-good", good, 13)
    assert _unified(client, check)[0].committed_tokens == 14  # type: ignore[attr-defined]

    # Malformed continuations are refused whole, before anything runs.
    shapes = []
    chunk = BatchBuilder()
    chunk.add_prefill_chunk("bad-x", "", prompt, 0, 12)
    shapes.append(chunk.build())
    shapes[-1].continue_decode.append(True)
    carrying = BatchBuilder()
    carrying.add_decode("bad-good", good, 1, 14)
    shapes.append(carrying.build())
    shapes[-1].continue_decode.append(True)
    for items in shapes:
        with pytest.raises(InvalidArgumentError, match="num_tokens 0"):
            client.unified_batch(pb.UnifiedBatchRequest(items=items))
    _release(client, good, twin, chunked, logits, truncated)


def test_a_retried_step_replays_and_a_resent_one_reads_no_later_token(
    client: ExecutorClient,
) -> None:
    """Step ids replay the stored answer, even after a later continuation changed the cache's
    selected token; the same step re-sent without its id is refused by position (it would
    otherwise feed the later step's token) and changes nothing."""
    prompt = _prompt(7, 10)
    reference, token = _open(client, "idem-ref", prompt)
    expected = []
    for position in (10, 11, 12):
        batch = BatchBuilder()
        batch.add_decode("idem-ref", reference, token, position)
        token = _unified(client, batch)[0].token_id  # type: ignore[attr-defined]
        expected.append(token)
    cache, _ = _open(client, "idem", prompt)
    first_id, second_id = random.getrandbits(60) + 1, random.getrandbits(60) + 1

    def step(position: int, step_id: int) -> pb.UnifiedBatchResponse:
        batch = BatchBuilder()
        batch.add_continuation("idem", cache, position)
        return client.unified_batch(pb.UnifiedBatchRequest(items=batch.build(), step_id=step_id))

    first = step(10, first_id)
    second = step(11, second_id)
    assert [first.results.token_ids[0], second.results.token_ids[0]] == expected[:2]
    assert step(10, first_id) == first  # the stored answer, byte for byte
    assert step(11, second_id) == second
    resent = item_views(step(10, 0).results)[0]
    assert resent.failed and resent.error.code == ABORTED and resent.committed_tokens == 12
    third = item_views(step(12, 0).results)[0]
    assert third.token_id == expected[2] and third.committed_tokens == 13
    _release(client, reference, cache)


def test_a_stream_runs_continuations_sent_back_to_back(live_server: LiveServer) -> None:
    """Step N+1 continues step N before step N's answer is read; a retry of step N on the
    stream replays its answer."""
    prompt = _prompt(9, 11)

    async def scenario() -> tuple[list[int], list[int], bool]:
        async with AsyncExecutorClient(live_server.target) as client:
            opened = await client.prefill(
                pb.PrefillRequest(request_id="stream", input_tokens=prompt)
            )
            cache = opened.completed.kv_cache.cache_id
            token = opened.completed.output.token.token_id
            ref = await client.prefill(
                pb.PrefillRequest(request_id="stream-ref", input_tokens=prompt)
            )
            ref_cache = ref.completed.kv_cache.cache_id
            expected = []
            for position in range(11, 16):
                batch = BatchBuilder()
                batch.add_decode("stream-ref", ref_cache, token, position)
                answer = await client.unified_batch(pb.UnifiedBatchRequest(items=batch.build()))
                token = answer.results.token_ids[0]
                expected.append(token)
            base = random.getrandbits(60) + 1
            async with client.step_stream() as stream:
                futures = []
                for k, position in enumerate(range(11, 16)):
                    batch = BatchBuilder()
                    batch.add_continuation("stream", cache, position)
                    request = pb.UnifiedBatchRequest(items=batch.build(), step_id=base + k)
                    futures.append(stream.submit(request))
                answers = [await f for f in futures]
                batch = BatchBuilder()
                batch.add_continuation("stream", cache, 11)
                retry = await stream.submit(
                    pb.UnifiedBatchRequest(items=batch.build(), step_id=base)
                )
            for cache_id in (cache, ref_cache):
                await client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))
        got = [a.results.token_ids[0] for a in answers]
        return got, expected, retry == answers[0]

    got, expected, replayed = live_server.run(scenario())  # type: ignore[misc]
    assert got == expected and replayed


# -- the reference scheduler -----------------------------------------------------------------


def _generate(
    server: LiveServer,
    prompts: list[list[int]],
    params: Sequence[GenerationParams],
    config: SchedulerConfig,
    backend: type[GrpcBackend] = GrpcBackend,
) -> tuple[list[GenerationResult], Scheduler]:
    async def scenario() -> tuple[list[GenerationResult], Scheduler]:
        async with AsyncExecutorClient(server.target) as client:
            scheduler = Scheduler(backend(client), config)
            return await scheduler.generate(prompts, params), scheduler

    return server.run(scenario())  # type: ignore[return-value]


def _stop_params(
    server: LiveServer, prompts: list[list[int]], lengths: list[int]
) -> tuple[list[GenerationParams], int]:
    """Per-prompt params with one stop token that ends the longest request mid-run (at its
    fifth output or later)."""
    plain = [GenerationParams(max_new_tokens=n) for n in lengths]
    results, _ = _generate(server, prompts, plain, PLAIN)
    outputs = results[lengths.index(max(lengths))].output_ids
    stop = next(t for k, t in enumerate(outputs) if k >= 4 and t not in outputs[:k])
    return [GenerationParams(max_new_tokens=n, stop_token_ids=(stop,)) for n in lengths], stop


def test_continued_outputs_equal_plain_greedy(roomy: LiveServer) -> None:
    """Mixed output lengths and a stop token that ends some requests mid-run: the same tokens,
    none duplicated or skipped, over gRPC and over the in-process backend."""
    from ferrum_server.config import EngineConfig
    from ferrum_server.engine import Engine
    from ferrum_server.tools.bench.inproc import InProcessBackend

    prompts = random_prompts(31, 7, 3, 40)
    lengths = [3 + (i * 5) % 13 for i in range(len(prompts))]
    params, _ = _stop_params(roomy, prompts, lengths)
    plain, _ = _generate(roomy, prompts, params, PLAIN)
    engine_stats = roomy.engine.stats  # type: ignore[attr-defined]
    launched_ahead = engine_stats.launched_ahead_steps
    continued, scheduler = _generate(roomy, prompts, params, CONTINUE)
    assert [r.output_ids for r in continued] == [r.output_ids for r in plain]
    reasons = [r.finish_reason for r in continued]
    assert reasons == [r.finish_reason for r in plain]
    assert "stop" in reasons and "length" in reasons
    stats = scheduler.stats
    assert stats.continuations > 0 and stats.max_in_flight == 2
    if roomy.engine.config.launch_ahead:  # type: ignore[attr-defined]
        # Steps did launch while the one before them was in flight (about a third of them
        # on a 2-core CPU, where a launch runs its whole forward before it returns).
        assert engine_stats.launched_ahead_steps > launched_ahead
    assert_quiescent(roomy)

    engine = Engine(EngineConfig(block_size=4, kv_cache_bytes=1024 * tiny_block_bytes(4)))
    try:
        in_process = asyncio.run(
            Scheduler(InProcessBackend(engine), CONTINUE).generate(prompts, params)
        )
        assert not engine.kv.caches
    finally:
        engine.shutdown()
    assert [r.output_ids for r in in_process] == [r.output_ids for r in plain]


class _Recording(GrpcBackend):
    """Records every item sent and the token each answer carried for it."""

    def __init__(self, client: AsyncExecutorClient) -> None:
        super().__init__(client)
        self.sent: list[tuple[PlannedItem, int, int]] = []  # item, status, token

    def submit(self, items: Sequence[PlannedItem]) -> Awaitable[StepResult]:
        pending = super().submit(items)

        async def recorded() -> StepResult:
            result = await pending
            for k, item in enumerate(items):
                self.sent.append((item, result.statuses[k], result.token_ids[k]))
            return result

        return recorded()


def test_a_request_that_stops_has_one_extra_item_and_gives_back_every_block(
    roomy: LiveServer,
) -> None:
    """A request that selects its stop token at step N was already sent in step N+1: exactly
    one extra decode runs for it, its token reaches neither the results nor the stream, the
    completion finds the last output fed back (committed = prompt + outputs), and with prefix
    caching on every block comes back."""
    prompts = random_prompts(37, 5, 6, 30)
    lengths = [12] * len(prompts)
    params, stop = _stop_params(roomy, prompts, lengths)
    plain, _ = _generate(roomy, prompts, params, PLAIN)
    engine = roomy.engine
    committed_at_completion: dict[str, int] = {}
    complete = engine.complete  # type: ignore[attr-defined]

    def recording_complete(request_id: str, cache_id: str, *args: int) -> object:
        cache = engine.kv.caches.get(cache_id)  # type: ignore[attr-defined]
        committed_at_completion[request_id] = cache.num_tokens if cache else -1
        return complete(request_id, cache_id, *args)

    engine.complete = recording_complete  # type: ignore[attr-defined]
    try:

        async def scenario() -> tuple[dict[int, list[int]], list[GenerationResult], _Recording]:
            async with AsyncExecutorClient(roomy.target) as client:
                backend = _Recording(client)
                scheduler = Scheduler(backend, CONTINUE)
                streamed: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
                async for index, token in scheduler.stream(prompts, params):
                    streamed[index].append(token)
                results = list(sorted(scheduler._by_index.values(), key=lambda r: r.result.index))
                assert scheduler.stats.discarded_items == sum(
                    r.result.finish_reason == "stop" for r in results
                )
            return streamed, [r.result for r in results], backend

        streamed, results, backend = roomy.run(scenario())  # type: ignore[misc]
    finally:
        del engine.complete  # type: ignore[attr-defined]
    assert [r.output_ids for r in results] == [r.output_ids for r in plain]
    assert [streamed[i] for i in range(len(prompts))] == [r.output_ids for r in plain]
    stopped = [r for r in results if r.finish_reason == "stop"]
    assert stopped and any(r.finish_reason == "length" for r in results)
    for result, prompt in zip(results, prompts, strict=True):
        decodes = [
            (status, token)
            for item, status, token in backend.sent
            if item.request_id == result.request_id and item.kind == pb.ITEM_KIND_DECODE
        ]
        outputs = result.output_ids
        committed = committed_at_completion[result.request_id]
        if result.finish_reason == "stop":
            assert outputs[-1] == stop
            # Outputs 2..n came from n - 1 decodes; the n-th decode fed the stop token back.
            assert len(decodes) == len(outputs)
            assert decodes[-1][0] == pb.ITEM_STATUS_TOKEN
            assert committed == len(prompt) + len(outputs)
        else:
            # Ended by length: never continued past its last token.
            assert len(decodes) == len(outputs) - 1
            assert committed == len(prompt) + len(outputs) - 1
    assert_quiescent(roomy)


def test_steps_overlap_and_every_running_request_is_in_every_step(roomy: LiveServer) -> None:
    """Each step's answer is held from the scheduler until the executor has started the next
    step: with continuation every step but the last has its successor running by then (it was
    sent before the answer was processed), and each decode step carries the whole batch, with
    no alternating cohorts."""
    prompts = random_prompts(43, 6, 5, 20)
    params = [GenerationParams(max_new_tokens=6)] * len(prompts)
    plain, _ = _generate(roomy, prompts, params, PLAIN)
    engine = roomy.engine
    # What the servicer calls to start a step: the whole step, or its launch.
    entry = "launch" if engine.config.launch_ahead else "execute"  # type: ignore[attr-defined]
    execute = getattr(engine, entry)
    started = [threading.Event() for _ in range(64)]
    executed = iter(started)

    def marking_execute(*args: object) -> object:
        next(executed).set()
        return execute(*args)

    class Gated(GrpcBackend):
        steps = 0
        overlapped = 0

        def submit(self, items: Sequence[PlannedItem]) -> Awaitable[StepResult]:
            index, Gated.steps = Gated.steps, Gated.steps + 1
            pending = super().submit(items)

            async def gated() -> StepResult:
                result = await pending
                if await asyncio.to_thread(started[index + 1].wait, 1.0):
                    Gated.overlapped += 1
                return result

            return gated()

    setattr(engine, entry, marking_execute)
    try:
        continued, scheduler = _generate(roomy, prompts, params, CONTINUE, Gated)
    finally:
        delattr(engine, entry)
    assert [r.output_ids for r in continued] == [r.output_ids for r in plain]
    records = scheduler.stats.records
    # One step prefills every prompt, then five steps decode all six requests together.
    assert [r.num_decodes for r in records] == [0] + [len(prompts)] * 5
    assert Gated.steps == len(records) and Gated.overlapped == len(records) - 1
    assert scheduler.stats.max_in_flight == 2
    assert_quiescent(roomy)


def test_a_pool_too_small_completes_everything_like_a_large_one(
    tight: LiveServer, roomy: LiveServer
) -> None:
    """Deferred decodes and preemption with continuations in flight: the scheduler drains the
    pipeline before it preempts (a victim has no item in flight), and the outputs equal a
    roomy run."""
    prompts = random_prompts(7, 10, 6, 20)
    params = [GenerationParams(max_new_tokens=12)] * len(prompts)
    config = SchedulerConfig(max_step_tokens=32, decode_continuation=True)
    expected, _ = _generate(roomy, prompts, params, SchedulerConfig(max_step_tokens=32))
    results, scheduler = _generate(tight, prompts, params, config)
    assert [r.output_ids for r in results] == [r.output_ids for r in expected]
    assert all(r.finish_reason == "length" for r in results)
    stats = scheduler.stats
    assert stats.preemptions > 0 and stats.deferred_items > 0 and stats.continuations > 0
    assert_quiescent(tight)
    assert_quiescent(roomy)


def test_decodes_that_outgrow_the_pool_preempt_once_the_pipeline_drains(
    tight: LiveServer, roomy: LiveServer
) -> None:
    """Three requests decode together until their KV outgrows the pool. Every running request
    is in every step, so a deferred decode finds no victim without an item in flight; the
    scheduler stops sending until the step in flight returns, then preempts (without that it
    never preempts and the decodes are deferred forever)."""
    prompts = random_prompts(5, 3, 20, 20)
    params = [GenerationParams(max_new_tokens=16)] * len(prompts)
    expected, _ = _generate(roomy, prompts, params, PLAIN)

    async def scenario() -> tuple[list[GenerationResult], Scheduler]:
        async with AsyncExecutorClient(tight.target) as client:
            scheduler = Scheduler(client, CONTINUE)
            return await asyncio.wait_for(scheduler.generate(prompts, params), 60), scheduler

    results, scheduler = tight.run(scenario())  # type: ignore[misc]
    assert [r.output_ids for r in results] == [r.output_ids for r in expected]
    assert scheduler.stats.deferred_items > 0 and scheduler.stats.preemptions > 0
    assert_quiescent(tight)


def test_a_request_cancelled_with_its_continuation_in_flight_gives_everything_back(
    roomy: LiveServer,
) -> None:
    """Cancelled while its continuation is in flight: the request keeps its cache until that
    item is back, then it is completed (every token fed into its KV was recorded, so the counts
    match) and the pool ends whole; the others finish as without it."""
    prompts = random_prompts(47, 3, 8, 16)
    params = [GenerationParams(max_new_tokens=12)] * len(prompts)
    plain, _ = _generate(roomy, prompts, params, PLAIN)

    async def scenario() -> list[GenerationResult]:
        async with AsyncExecutorClient(roomy.target) as client:
            scheduler = Scheduler(client, CONTINUE)
            seen = 0
            async for index, _ in scheduler.stream(prompts, params):
                seen += index == 0
                if seen == 3:
                    scheduler.cancel(0)
            return [
                r.result for r in sorted(scheduler._by_index.values(), key=lambda r: r.result.index)
            ]

    results = roomy.run(scenario())  # type: ignore[misc]
    assert [r.finish_reason for r in results] == ["cancelled", "length", "length"]
    assert results[0].output_ids == plain[0].output_ids[: len(results[0].output_ids)]
    assert [r.output_ids for r in results[1:]] == [r.output_ids for r in plain[1:]]
    assert_quiescent(roomy)


# -- planning a continued step late (continuation_lead_ms) -------------------------------------

# A paced executor's step: this long, plus a millisecond per token it holds.
PACE_FIXED_MS = 300.0


class _Paced(GrpcBackend):
    """An executor whose steps run one after another and take PACE_FIXED_MS plus 1 ms a token
    (a decode counts one): each answer is held until its step would have ended and reports that
    time as the step's forward, so the scheduler's step-time fit predicts every step exactly.
    `spans` records each step's simulated start and end and its items."""

    def __init__(self, client: AsyncExecutorClient) -> None:
        super().__init__(client)
        self.spans: list[tuple[float, float, list[PlannedItem]]] = []
        self._free_at = 0.0

    def submit(self, items: Sequence[PlannedItem]) -> Awaitable[StepResult]:
        tokens = sum(1 if i.kind == ItemKind.DECODE else len(i.tokens) for i in items)
        seconds = (PACE_FIXED_MS + tokens) / 1e3
        start = max(time.perf_counter(), self._free_at)
        end = self._free_at = start + seconds
        self.spans.append((start, end, list(items)))
        pending = super().submit(items)

        async def paced() -> StepResult:
            result = await pending
            await asyncio.sleep(max(0.0, end - time.perf_counter()))
            ns = round(seconds * 1e9)
            return dataclasses.replace(result, timing=StepTiming(0, ns, 0, ns))

        return paced()


@pytest.mark.parametrize("lead_ms", [100.0, None], ids=["late", "at-once"])
def test_a_prompt_arriving_mid_step_joins_the_next_step_when_planned_late(
    live_server: LiveServer, lead_ms: float | None
) -> None:
    """Prompt B arrives about 100 ms into one of A's paced 301 ms decode steps, once the step-time
    fit has its four steps. Planned late (100 ms before the step's predicted end) the next step
    is not yet planned, so B's prefill is in it; planned at once, the next step left when the
    one in flight started, so B waits out that one too. The outputs are the same either way,
    and an offline run (every prompt there from the start) never holds."""
    prompts = [_prompt(61, 20), _prompt(62, 10)]
    params = [GenerationParams(max_new_tokens=9), GenerationParams(max_new_tokens=2)]
    config = dataclasses.replace(CONTINUE, continuation_lead_ms=lead_ms)
    arrival = 1.33  # s: A's prefill (320 ms), then about 100 ms into its fourth decode step

    async def scenario() -> tuple[list[GenerationResult], Scheduler, _Paced]:
        async with AsyncExecutorClient(live_server.target) as client:
            backend = _Paced(client)
            scheduler = Scheduler(backend, config)
            results = await scheduler.generate(prompts, params, arrivals_s=[0.0, arrival])
            return results, scheduler, backend

    results, scheduler, backend = live_server.run(scenario())  # type: ignore[misc]
    plain, _ = _generate(live_server, prompts, params, PLAIN)
    assert [r.output_ids for r in results] == [r.output_ids for r in plain]
    b_id = results[1].request_id
    arrived = results[1].arrival_s
    running = next(k for k, (s, e, _) in enumerate(backend.spans) if s <= arrived < e)
    start, end, items = backend.spans[running]
    assert scheduler.cost.fit() is not None and running >= 4
    # The premise: B came at least 50 ms after that step started and 50 ms before the late
    # plan was due (end less the late case's 100 ms lead), so a slow moment of the machine
    # cannot decide the outcome.
    assert arrived - start >= 0.05 and end - 0.1 - arrived >= 0.05
    assert all(i.request_id != b_id for i in items)
    joined = next(
        k for k, (_, _, its) in enumerate(backend.spans) if any(i.request_id == b_id for i in its)
    )
    if lead_ms is not None:
        assert joined == running + 1
        assert scheduler.stats.held_plans > 0
    else:
        assert joined == running + 2
        assert scheduler.stats.held_plans == 0
    # Offline: nothing is still to arrive, so no step waits.
    offline, offline_scheduler = _generate(live_server, prompts, params, config)
    assert [r.output_ids for r in offline] == [r.output_ids for r in plain]
    assert offline_scheduler.stats.held_plans == 0
    assert_quiescent(live_server)
