"""The capacity protocol end to end: admission answers, waits, preemption, prefix reuse, and
the reference scheduler completing every request in a pool too small for all of them."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator

import grpc
import pytest
from ferrum_client import AsyncExecutorClient, ExecutorClient, ExecutorError, pb
from ferrum_client.scheduler import GenerationParams, Scheduler, SchedulerConfig
from helpers_server import (
    TINY_VOCAB,
    LiveServer,
    assert_quiescent,
    random_prompts,
    start_live_server,
    tiny_block_bytes,
    tiny_split,
)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def tight(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    """24 blocks of 4 tokens: room for about three of the test's requests at once. Also as the
    tiny model split over 2 ranks (the protocol must not change with tensor parallelism)."""
    yield from start_live_server(
        block_size=4,
        max_batch_tokens=256,
        max_batch_size=16,
        **tiny_split(request.param, blocks=24, block_size=4),
    )


@pytest.fixture(scope="module")
def roomy() -> Iterator[LiveServer]:
    yield from start_live_server(
        block_size=4,
        kv_cache_bytes=4096 * tiny_block_bytes(4),
        max_batch_tokens=256,
        max_batch_size=64,
    )


@pytest.fixture(scope="module")
def prefix_server() -> Iterator[LiveServer]:
    yield from start_live_server(
        block_size=16,
        kv_cache_bytes=1024 * tiny_block_bytes(16),
        max_batch_tokens=2048,
        max_batch_size=64,
    )


@pytest.fixture(scope="module")
def no_prefix_server() -> Iterator[LiveServer]:
    yield from start_live_server(
        block_size=16,
        kv_cache_bytes=1024 * tiny_block_bytes(16),
        max_batch_tokens=2048,
        max_batch_size=64,
        prefix_caching=False,
    )


def _run_scheduler(
    server: LiveServer, prompts: list[list[int]], params: GenerationParams, config: SchedulerConfig
) -> tuple[list[list[int]], Scheduler]:
    async def scenario() -> tuple[list[list[int]], Scheduler]:
        async with AsyncExecutorClient(server.target) as client:
            scheduler = Scheduler(client, config)
            results = await scheduler.generate(prompts, params)
        assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
        return [r.output_ids for r in results], scheduler

    return server.run(scenario())  # type: ignore[return-value]


@pytest.mark.parametrize(
    "mode", [pb.PREEMPTION_MODE_RECOMPUTE, pb.PREEMPTION_MODE_SWAP], ids=["recompute", "swap"]
)
def test_small_pool_completes_everything_like_a_large_one(
    tight: LiveServer, roomy: LiveServer, mode: int
) -> None:
    prompts = random_prompts(7, 10, 6, 20)
    params = GenerationParams(max_new_tokens=12)
    config = SchedulerConfig(max_step_tokens=32, preemption_mode=mode)  # type: ignore[arg-type]
    expected, _ = _run_scheduler(roomy, prompts, params, SchedulerConfig(max_step_tokens=32))
    swaps_before = tight.engine.capacity.stats.swaps_in  # type: ignore[attr-defined]
    outputs, scheduler = _run_scheduler(tight, prompts, params, config)
    assert outputs == expected
    stats = scheduler.stats
    # The pool really was too small: requests waited, decodes were deferred, victims preempted.
    assert stats.admissions_deferred > 0 and stats.preemptions > 0
    # No polling: every re-probe of a deferred request followed a capacity change it waited
    # for, or a release this scheduler made itself.
    assert stats.admissions_deferred <= stats.wakeups + stats.own_releases
    if mode == pb.PREEMPTION_MODE_SWAP:
        assert tight.engine.capacity.stats.swaps_in > swaps_before  # type: ignore[attr-defined]
    assert_quiescent(tight)
    assert_quiescent(roomy)


def test_permanent_rejection_is_immediate(tight: LiveServer) -> None:
    with ExecutorClient(tight.target) as client:
        too_big = client.try_admit_prefill(
            pb.TryAdmitPrefillRequest(
                request_id="huge", input_tokens=[1] * 100, product_prompt_tokens=100
            )
        )
        assert too_big.WhichOneof("decision") == "rejected"
        assert too_big.rejected.blockers[0].kind == pb.SHORTFALL_KIND_PERMANENT_DOMAIN_MAXIMUM
        assert "pool" in too_big.rejected.reason
        too_long = client.try_admit_prefill(
            pb.TryAdmitPrefillRequest(
                request_id="long",
                input_tokens=[1] * 4,
                product_prompt_tokens=4,
                maximum_sequence_tokens=5000,
            )
        )
        assert too_long.rejected.blockers[0].kind == pb.SHORTFALL_KIND_SEQUENCE_LENGTH_MAXIMUM
        will_outgrow = client.try_admit_prefill(
            pb.TryAdmitPrefillRequest(
                request_id="grow",
                input_tokens=[1] * 4,
                product_prompt_tokens=4,
                maximum_sequence_tokens=97,
            )
        )
        assert will_outgrow.WhichOneof("decision") == "rejected"
    assert_quiescent(tight)


def test_bad_admission_requests_are_invalid(tight: LiveServer) -> None:
    with ExecutorClient(tight.target) as client:
        for request in (
            pb.TryAdmitPrefillRequest(request_id="a", input_tokens=[], product_prompt_tokens=1),
            pb.TryAdmitPrefillRequest(request_id="a", input_tokens=[1, 2], product_prompt_tokens=1),
            pb.TryAdmitPrefillRequest(
                request_id="a", input_tokens=[TINY_VOCAB], product_prompt_tokens=1
            ),
            pb.TryAdmitPrefillRequest(input_tokens=[1], product_prompt_tokens=1),
        ):
            with pytest.raises(ExecutorError) as caught:
                client.try_admit_prefill(request)
            assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert_quiescent(tight)


def test_deferral_wait_wakes_on_release_and_cancel_frees(tight: LiveServer) -> None:
    with ExecutorClient(tight.target) as client:
        hog = client.try_admit_prefill(
            pb.TryAdmitPrefillRequest(
                request_id="hog", input_tokens=[3] * 80, product_prompt_tokens=80
            )
        )
        assert hog.WhichOneof("decision") == "admitted"
        assert hog.admitted.held_blocks == 20
        late = client.try_admit_prefill(
            pb.TryAdmitPrefillRequest(
                request_id="late", input_tokens=[4] * 30, product_prompt_tokens=30
            )
        )
        deferred = late.deferred
        assert deferred.blockers[0].kind == pb.SHORTFALL_KIND_FIT_AVAILABILITY
        assert (deferred.blockers[0].requested, deferred.blockers[0].available) == (8, 4)
        condition = deferred.wait_condition
        # Nothing changed yet: a short wait times out.
        quiet = client.wait_for_capacity_change(
            pb.WaitForCapacityChangeRequest(condition=condition, timeout_ms=50)
        )
        assert not quiet.changed
        # A wait parked before the release returns as soon as the source advances.
        answer: list[pb.WaitForCapacityChangeResponse] = []
        waiter = threading.Thread(
            target=lambda: answer.append(
                client.wait_for_capacity_change(
                    pb.WaitForCapacityChangeRequest(condition=condition, timeout_ms=20_000)
                )
            )
        )
        waiter.start()
        sources = client.list_release_sources().entries
        assert [e.request_id for e in sources] == ["hog"]
        assert sources[0].authority == pb.PREEMPTION_AUTHORITY_RETAINED_PREFILL
        assert client.cancel_prefill_admission(
            pb.CancelPrefillAdmissionRequest(request_id="hog")
        ).released
        waiter.join(timeout=20)
        assert answer and answer[0].changed
        assert answer[0].sources[0].epoch > condition.observed[0].epoch
        # Waiting again on the old condition returns at once; a condition from the future or
        # another executor is refused.
        assert client.wait_for_capacity_change(
            pb.WaitForCapacityChangeRequest(condition=condition, timeout_ms=10_000)
        ).changed
        ahead = pb.CapacityWaitCondition(coordinator_id=condition.coordinator_id)
        ahead.observed.add(source=pb.CAPACITY_SOURCE_DOMAIN, epoch=10**9)
        with pytest.raises(ExecutorError) as caught:
            client.wait_for_capacity_change(pb.WaitForCapacityChangeRequest(condition=ahead))
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(ExecutorError) as caught:
            client.wait_for_capacity_change(
                pb.WaitForCapacityChangeRequest(
                    condition=pb.CapacityWaitCondition(coordinator_id=condition.coordinator_id)
                )
            )
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert not client.cancel_prefill_admission(
            pb.CancelPrefillAdmissionRequest(request_id="hog")
        ).released
    assert_quiescent(tight)


def test_preemption_receipt_retires_the_exact_incarnation(tight: LiveServer) -> None:
    with ExecutorClient(tight.target) as client:
        admitted = client.try_admit_prefill(
            pb.TryAdmitPrefillRequest(request_id="v", input_tokens=[5] * 9, product_prompt_tokens=9)
        ).admitted
        first = client.prefill(
            pb.PrefillRequest(request_id="v", input_tokens=[5] * 9, cache_id=admitted.cache_id)
        )
        assert first.completed.kv_cache.cache_id == admitted.cache_id
        receipt = client.preempt_execution_capacity(
            pb.PreemptExecutionCapacityRequest(request_id="v", cache_id=admitted.cache_id)
        ).receipt
        assert (receipt.request_id, receipt.cache_id) == ("v", admitted.cache_id)
        assert receipt.authority == pb.PREEMPTION_AUTHORITY_ACTIVE_SEQUENCE
        assert receipt.blocks_freed == 3
        # A stale decision about the old incarnation changes nothing.
        with pytest.raises(ExecutorError) as caught:
            client.preempt_execution_capacity(
                pb.PreemptExecutionCapacityRequest(request_id="v", cache_id=admitted.cache_id)
            )
        assert caught.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(ExecutorError):
            client.decode(pb.DecodeRequest(cache_id=admitted.cache_id, input_token=1, position=9))
        # Re-admission replays the generated token under a new incarnation.
        token = first.completed.output.token.token_id
        again = client.try_admit_prefill(
            pb.TryAdmitPrefillRequest(
                request_id="v",
                input_tokens=[5] * 9 + [token],
                product_prompt_tokens=9,
                replayed_output_tokens=1,
            )
        ).admitted
        assert again.cache_id != admitted.cache_id
        client.release_cache(pb.ReleaseCacheRequest(cache_id=again.cache_id))
    assert_quiescent(tight)


def test_watch_capacity_streams_changes(tight: LiveServer) -> None:
    async def scenario() -> None:
        async with AsyncExecutorClient(tight.target) as client:
            events = client.watch_capacity()
            first = await events.__anext__()
            admitted = await client.try_admit_prefill(
                pb.TryAdmitPrefillRequest(
                    request_id="w", input_tokens=[1] * 8, product_prompt_tokens=8
                )
            )
            await client.release_cache(pb.ReleaseCacheRequest(cache_id=admitted.admitted.cache_id))
            change = await asyncio.wait_for(events.__anext__(), 10)
            assert change.epochs.release_epoch > first.epochs.release_epoch
            await events.aclose()

    tight.run(scenario())
    assert_quiescent(tight)


def test_shared_prefix_is_computed_once(
    prefix_server: LiveServer, no_prefix_server: LiveServer
) -> None:
    rng = random.Random(3)
    prefix = [rng.randrange(TINY_VOCAB) for _ in range(256)]
    prompts = [
        prefix + [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 24))] for _ in range(32)
    ]
    params = GenerationParams(max_new_tokens=4)
    config = SchedulerConfig(max_step_tokens=2048)
    engine = prefix_server.engine
    before = engine.stats.prefill_tokens  # type: ignore[attr-defined]
    outputs, _ = _run_scheduler(prefix_server, prompts, params, config)
    computed = engine.stats.prefill_tokens - before  # type: ignore[attr-defined]
    assert computed == 256 + sum(len(p) - 256 for p in prompts)
    reference, _ = _run_scheduler(no_prefix_server, prompts, params, config)
    assert outputs == reference
    hits = engine.capacity.stats.prefix_hit_tokens  # type: ignore[attr-defined]
    assert hits >= 31 * 256
    assert_quiescent(prefix_server)
    assert_quiescent(no_prefix_server)


def test_a_chunk_that_does_not_fit_runs_its_fitting_prefix_only_when_allowed(
    tight: LiveServer,
) -> None:
    """Issue #14 item 4 through gRPC: narrowing on the step path and on Prefill, deferral
    without permission, and the exact admission hint and its re-probe."""
    from ferrum_client import BatchBuilder, item_views

    engine = tight.engine  # type: ignore[attr-defined]
    kv = engine.kv
    hog_prompt, prompt, other, late = random_prompts(31, 4, 60, 60)
    with ExecutorClient(tight.target) as client:
        hog = client.prefill(pb.PrefillRequest(request_id="hog", input_tokens=hog_prompt))
        hog_id = hog.completed.kv_cache.cache_id  # 15 of 24 blocks: 9 left, 36 tokens
        assert kv.pool.num_available == 9
        # Not allowed: deferred, nothing taken, no cache opened.
        caches_before = set(kv.caches)
        plain = BatchBuilder()
        plain.add_prefill_chunk("n", "", prompt[:48], 0, 60)
        view = item_views(client.unified_batch(pb.UnifiedBatchRequest(items=plain.build())).results)
        assert view[0].deferred and view[0].completed_num_tokens == 0
        assert view[0].deferral is not None
        assert view[0].deferral.capacity.narrower_prefill_tokens == 36
        assert set(kv.caches) == caches_before and kv.pool.num_available == 9
        # Allowed: the 36 tokens the 9 free blocks hold run, and only they are committed.
        allowed = BatchBuilder()
        allowed.add_prefill_chunk("n", "", prompt[:48], 0, 60, allow_narrowing=True)
        results = client.unified_batch(pb.UnifiedBatchRequest(items=allowed.build())).results
        view = item_views(results)
        assert list(results.completed_num_tokens) == [36]
        assert list(results.capacity_probe_counts) == [1]
        assert view[0].status == pb.ITEM_STATUS_INTERMEDIATE and view[0].committed_tokens == 36
        narrowed_id = view[0].cache_id
        assert kv.caches[narrowed_id].token_ids == prompt[:36]
        assert kv.pool.num_available == 0
        # The single-item Prefill reports planned and completed chunks once the hog is gone.
        client.release_cache(pb.ReleaseCacheRequest(cache_id=hog_id))
        blocker = client.prefill(pb.PrefillRequest(request_id="b", input_tokens=other[:52]))
        blocker_id = blocker.completed.kv_cache.cache_id  # 13 blocks: 2 left, 8 tokens
        rest = client.prefill(
            pb.PrefillRequest(
                request_id="n",
                input_tokens=prompt,
                cache_id=narrowed_id,
                chunk=pb.PrefillChunk(
                    tokens_processed=36, tokens_to_process=24, total_prompt_tokens=60
                ),
                allow_narrowing=True,
            )
        ).completed
        assert (rest.planned_chunk.tokens_processed, rest.planned_chunk.tokens_to_process) == (
            36,
            24,
        )
        assert (rest.completed_chunk.tokens_processed, rest.completed_chunk.tokens_to_process) == (
            36,
            8,
        )
        assert rest.capacity_probe_count == 1 and not rest.HasField("output")
        assert rest.kv_cache.num_tokens == 44 and kv.caches[narrowed_id].token_ids == prompt[:44]
        # Admission: the hint is exactly what the available blocks hold, and the re-probe with
        # it admits a claim of that many tokens.
        client.release_cache(pb.ReleaseCacheRequest(cache_id=narrowed_id))  # 11 blocks free
        probe = pb.TryAdmitPrefillRequest(
            request_id="late", input_tokens=late, product_prompt_tokens=60
        )
        answer = client.try_admit_prefill(probe)
        assert answer.WhichOneof("decision") == "deferred"
        deferred = answer.deferred
        assert deferred.narrower_prefill_tokens == 44
        assert deferred.blockers[0].kind == pb.SHORTFALL_KIND_FIT_AVAILABILITY
        probe.first_chunk_tokens = deferred.narrower_prefill_tokens
        admitted = client.try_admit_prefill(probe).admitted
        assert admitted.held_blocks == 11 and kv.pool.num_available == 0
        with pytest.raises(ExecutorError) as caught:
            client.try_admit_prefill(
                pb.TryAdmitPrefillRequest(
                    request_id="bad",
                    input_tokens=[1] * 4,
                    product_prompt_tokens=4,
                    first_chunk_tokens=5,
                )
            )
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        for cache_id in (admitted.cache_id, blocker_id):
            client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))
    assert_quiescent(tight)
