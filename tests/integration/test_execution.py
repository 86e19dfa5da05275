"""End-to-end execution through gRPC: chunking, unified batches, verify/truncate, streams."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from ferrum_client import (
    AsyncExecutorClient,
    BatchBuilder,
    ExecutorClient,
    InvalidArgumentError,
    SamplingOptions,
    item_views,
    pb,
)

LOGITS = SamplingOptions(full_logits=True)
VOCAB = 512  # the tiny model


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def _logits(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype="<f4")


def _prefill_in_chunks(
    client: ExecutorClient, prompt: list[int], sizes: list[int], request_id: str
) -> tuple[str, np.ndarray]:
    assert sum(sizes) == len(prompt)
    cache_id, position = "", 0
    last = b""
    for size in sizes:
        response = client.prefill(
            pb.PrefillRequest(
                request_id=request_id,
                input_tokens=prompt,
                cache_id=cache_id,
                chunk=pb.PrefillChunk(
                    tokens_processed=position,
                    tokens_to_process=size,
                    total_prompt_tokens=len(prompt),
                ),
                sampling=LOGITS.to_pb(),
            )
        )
        completed = response.completed
        cache_id = completed.kv_cache.cache_id
        position += size
        assert completed.kv_cache.num_tokens == position
        assert completed.completed_chunk == completed.planned_chunk
        if position < len(prompt):
            assert not completed.HasField("output")
        else:
            last = completed.output.full_logits
    return cache_id, _logits(last)


def _release(client: ExecutorClient, *cache_ids: str) -> None:
    for cache_id in cache_ids:
        assert client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id)).released


def test_chunked_prefill_matches_one_piece(client: ExecutorClient) -> None:
    prompt = _prompt(1, 23)
    whole_id, whole = _prefill_in_chunks(client, prompt, [23], "whole")
    two_id, two = _prefill_in_chunks(client, prompt, [11, 12], "two")
    five_id, five = _prefill_in_chunks(client, prompt, [5, 5, 5, 4, 4], "five")
    np.testing.assert_allclose(two, whole, atol=1e-4)
    np.testing.assert_allclose(five, whole, atol=1e-4)
    assert whole.shape == (VOCAB,)
    _release(client, whole_id, two_id, five_id)


def _decode_logits(client: ExecutorClient, cache_id: str, token: int, position: int) -> np.ndarray:
    response = client.decode(
        pb.DecodeRequest(
            cache_id=cache_id, input_token=token, position=position, sampling=LOGITS.to_pb()
        )
    )
    assert response.completed.kv_cache.cache_id == cache_id
    return _logits(response.completed.output.full_logits)


def test_unified_batch_matches_items_alone(client: ExecutorClient) -> None:
    """3 prefill chunks (one opening, two continuing) and 5 decodes in one forward."""
    # Five sequences ready to decode, two half-prefilled ones, one fresh prompt; each twice,
    # so one copy runs batched and the other alone.
    decode_prompts = [_prompt(10 + i, 6 + 3 * i) for i in range(5)]
    chunk_prompts = [_prompt(20 + i, 14 + 5 * i) for i in range(2)]
    fresh = _prompt(30, 9)
    batched, alone = {}, {}
    # One live cache per request id: the copy run alone has its own request ids.
    for copy, suffix in ((batched, ""), (alone, "-solo")):
        for i, p in enumerate(decode_prompts):
            copy[f"d{i}"] = _prefill_in_chunks(client, p, [len(p)], f"d{i}{suffix}")[0]
        for i, p in enumerate(chunk_prompts):
            copy[f"c{i}"] = _open_partial(client, p, 7, f"c{i}{suffix}")
    builder = BatchBuilder()
    for i, p in enumerate(chunk_prompts):
        builder.add_prefill_chunk(f"c{i}", batched[f"c{i}"], p[7:], 7, len(p), sampling=LOGITS)
    builder.add_prefill_chunk("fresh", "", fresh, 0, len(fresh), sampling=LOGITS)
    for i, p in enumerate(decode_prompts):
        builder.add_decode(f"d{i}", batched[f"d{i}"], 5 + i, len(p), sampling=LOGITS)
    response = client.unified_batch(pb.UnifiedBatchRequest(items=builder.build()))
    views = item_views(response.results)
    assert [v.status for v in views] == [pb.ITEM_STATUS_LOGITS] * 8
    # Outputs come back in input order and keep each item's cache identity.
    assert [v.cache_id for v in views[:2]] == [batched["c0"], batched["c1"]]
    assert [v.cache_id for v in views[3:]] == [batched[f"d{i}"] for i in range(5)]
    for i, p in enumerate(chunk_prompts):
        solo = _chunk_logits(client, alone[f"c{i}"], p)
        np.testing.assert_allclose(_logits(views[i].logits), solo, atol=1e-4)
    fresh_id, fresh_solo = _prefill_in_chunks(client, fresh, [len(fresh)], "fresh-solo")
    np.testing.assert_allclose(_logits(views[2].logits), fresh_solo, atol=1e-4)
    for i, p in enumerate(decode_prompts):
        solo = _decode_logits(client, alone[f"d{i}"], 5 + i, len(p))
        np.testing.assert_allclose(_logits(views[3 + i].logits), solo, atol=1e-4)
    _release(client, *batched.values(), *alone.values(), views[2].cache_id, fresh_id)


def _open_partial(client: ExecutorClient, prompt: list[int], first: int, request_id: str) -> str:
    response = client.prefill(
        pb.PrefillRequest(
            request_id=request_id,
            input_tokens=prompt,
            chunk=pb.PrefillChunk(
                tokens_processed=0, tokens_to_process=first, total_prompt_tokens=len(prompt)
            ),
        )
    )
    return response.completed.kv_cache.cache_id


def _chunk_logits(client: ExecutorClient, cache_id: str, prompt: list[int]) -> np.ndarray:
    response = client.prefill(
        pb.PrefillRequest(
            input_tokens=prompt,
            cache_id=cache_id,
            sampling=LOGITS.to_pb(),
            chunk=pb.PrefillChunk(
                tokens_processed=7,
                tokens_to_process=len(prompt) - 7,
                total_prompt_tokens=len(prompt),
            ),
        )
    )
    return _logits(response.completed.output.full_logits)


def test_forward_verify_then_truncate_equals_stepwise_decoding(client: ExecutorClient) -> None:
    prompt = _prompt(40, 13)
    # Greedy continuation computed one step at a time.
    ref_id, _ = _prefill_in_chunks(client, prompt, [13], "ref")
    first = client.decode(pb.DecodeRequest(cache_id=ref_id, input_token=7, position=13))
    tokens = [first.completed.output.token.token_id]
    for k in range(2):  # ref ends at length 16 holding [prompt, 7, t0, t1]
        out = client.decode(
            pb.DecodeRequest(cache_id=ref_id, input_token=tokens[-1], position=14 + k)
        )
        tokens.append(out.completed.output.token.token_id)
    # Verify [7, t0, t1, wrong, wrong2]: the first two drafts are right, then rejection.
    spec_id, _ = _prefill_in_chunks(client, prompt, [13], "spec")
    drafts = [tokens[0], tokens[1], (tokens[2] + 1) % VOCAB, 3]
    verify = client.forward_verify(
        pb.ForwardVerifyRequest(cache_id=spec_id, token_ids=[7, *drafts], position=13)
    )
    out = verify.completed
    assert out.kv_cache.num_tokens == 13 + 5
    assert list(out.token_ids[:3]) == tokens[:3]
    assert out.num_accepted_greedy == 2
    # Keep the last token and the two accepted drafts: entry length 13 + 2 + 1.
    truncated = client.truncate_kv(pb.TruncateKvRequest(cache_id=spec_id, new_length=16))
    assert truncated.kv_cache.num_tokens == 16
    # Next logits after feeding the bonus token match the stepwise path exactly.
    ref_next = _decode_logits(client, ref_id, tokens[2], 16)
    spec_next = _decode_logits(client, spec_id, out.token_ids[2], 16)
    np.testing.assert_allclose(spec_next, ref_next, atol=1e-5)
    # Verify with full logits returns N+1 rows.
    rows = client.forward_verify(
        pb.ForwardVerifyRequest(
            cache_id=spec_id, token_ids=[1, 2], position=17, sampling=LOGITS.to_pb()
        )
    )
    assert len(rows.completed.logits) == 2 * VOCAB * 4
    _release(client, ref_id, spec_id)


def test_prefill_decode_greedy_matches_engine_tokens_and_logprobs(client: ExecutorClient) -> None:
    prompt = _prompt(50, 10)
    response = client.prefill(
        pb.PrefillRequest(
            request_id="lp", input_tokens=prompt, sampling=SamplingOptions(num_logprobs=5).to_pb()
        )
    )
    token = response.completed.output.token
    assert len(token.top_token_ids) == 5
    assert token.top_token_ids[0] == token.token_id  # greedy picks the most likely
    assert token.logprob == pytest.approx(token.top_logprobs[0])
    assert list(token.top_logprobs) == sorted(token.top_logprobs, reverse=True)
    _release(client, response.completed.kv_cache.cache_id)


def test_seeded_sampling_does_not_depend_on_batch_composition(client: ExecutorClient) -> None:
    prompt = _prompt(60, 12)
    hot = SamplingOptions(temperature=1.3, top_k=50, top_p=0.95, seed=1234)
    solo = client.prefill(pb.PrefillRequest(input_tokens=prompt, sampling=hot.to_pb()))
    builder = BatchBuilder()
    builder.add_prefill_chunk("other", "", _prompt(61, 30), 0, 30)
    builder.add_prefill_chunk("same", "", prompt, 0, len(prompt), sampling=hot)
    views = item_views(client.unified_batch(pb.UnifiedBatchRequest(items=builder.build())).results)
    assert views[1].token_id == solo.completed.output.token.token_id
    _release(client, solo.completed.kv_cache.cache_id, views[0].cache_id, views[1].cache_id)


def test_step_stream_pipelines_and_survives_a_bad_step(live_server: object) -> None:
    async def scenario() -> None:
        async with AsyncExecutorClient(live_server.target) as client:  # type: ignore[attr-defined]
            async with client.step_stream() as stream:
                first = BatchBuilder()
                first.add_prefill_chunk("s", "", _prompt(70, 8), 0, 8)
                bad = BatchBuilder()
                bad.add_decode("s", "no-such-cache", 1, 8)
                # Both queued before either result is read.
                f1 = stream.submit(pb.UnifiedBatchRequest(items=first.build()))
                f2 = stream.submit(pb.UnifiedBatchRequest(items=bad.build()))
                r1 = await f1
                with pytest.raises(Exception) as caught:
                    await f2
                assert caught.value.code.name == "NOT_FOUND"  # type: ignore[attr-defined]
                view = item_views(r1.results)[0]
                nxt = BatchBuilder()
                nxt.add_decode("s", view.cache_id, view.token_id, 8)
                r3 = await stream.run(pb.UnifiedBatchRequest(items=nxt.build()))
                assert item_views(r3.results)[0].committed_tokens == 9
            await client.release_cache(pb.ReleaseCacheRequest(cache_id=view.cache_id))

    live_server.run(scenario())  # type: ignore[attr-defined]


def test_reserve_release_complete_are_exact_and_idempotent(client: ExecutorClient) -> None:
    capacity = client.get_kv_slot_capacity().snapshot
    reserved = client.reserve_kv_slots(
        pb.ReserveKvSlotsRequest(cache_ids=[""], request_ids=["r"], target_lens=[9])
    ).reserved
    assert list(reserved.new_blocks) == [3]  # 9 tokens / block size 4
    assert reserved.free_blocks_before - reserved.free_blocks_after == 3
    cache_id = reserved.cache_ids[0]
    # Nothing is committed yet: a completion claiming a 9-token prompt is refused, and changes
    # nothing.
    with pytest.raises(InvalidArgumentError):
        client.complete_cache(
            pb.CompleteCacheRequest(request_id="r", cache_id=cache_id, input_tokens=9)
        )
    builder = BatchBuilder()
    builder.add_prefill_chunk("r", cache_id, _prompt(70, 9), 0, 9)
    ran = item_views(client.unified_batch(pb.UnifiedBatchRequest(items=builder.build())).results)
    assert ran[0].committed_tokens == 9
    done = client.complete_cache(
        pb.CompleteCacheRequest(request_id="r", cache_id=cache_id, input_tokens=9, output_tokens=1)
    )
    assert done.released and done.blocks_freed == 3
    assert done.outcome == pb.COMPLETION_OUTCOME_COMPLETED
    again = client.complete_cache(pb.CompleteCacheRequest(request_id="r", cache_id=cache_id))
    assert not again.released
    assert again.outcome == pb.COMPLETION_OUTCOME_ALREADY_COMPLETED
    assert not client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id)).released
    after = client.get_kv_slot_capacity().snapshot  # the full blocks stay as prefix cache
    assert after.free_blocks + after.cached_blocks == capacity.free_blocks + capacity.cached_blocks


def test_capacity_deferral_is_typed_and_runs_nothing(small_pool_server: object) -> None:
    engine = small_pool_server.engine  # type: ignore[attr-defined]
    with ExecutorClient(small_pool_server.target) as client:  # type: ignore[attr-defined]
        hog = client.prefill(pb.PrefillRequest(request_id="hog", input_tokens=_prompt(80, 48)))
        hog_id = hog.completed.kv_cache.cache_id  # 12 of 16 blocks
        steps_before = engine.stats.steps
        builder = BatchBuilder()
        builder.add_prefill_chunk("big", "", _prompt(81, 40), 0, 40)  # needs 10 blocks
        builder.add_prefill_chunk("small", "", _prompt(82, 8), 0, 8)  # needs 2 blocks
        views = item_views(
            client.unified_batch(pb.UnifiedBatchRequest(items=builder.build())).results
        )
        assert views[0].deferred and views[1].has_token
        deferral = views[0].deferral
        assert deferral is not None and deferral.request_id == "big"
        shortfall = deferral.capacity.evidence.logical.shortfalls[0]
        assert (shortfall.requested, shortfall.available) == (10, 4)
        assert deferral.capacity.narrower_prefill_tokens == 16  # 4 free blocks x 4 tokens
        observed = deferral.capacity.wait_condition.observed
        assert [o.source for o in observed] == [pb.CAPACITY_SOURCE_DOMAIN]
        assert engine.stats.steps == steps_before + 1  # one forward, for "small" only
        # Transactional batch: nothing runs when one item cannot fit.
        tx = BatchBuilder()
        tx.add_prefill_chunk("a", "", _prompt(83, 4), 0, 4)
        tx.add_prefill_chunk("b", "", _prompt(84, 40), 0, 40)
        free_before = engine.kv.pool.num_available
        response = client.batch_prefill(pb.BatchPrefillRequest(items=tx.build()))
        assert response.WhichOneof("outcome") == "not_submitted"
        assert response.not_submitted.item_index == 1
        assert engine.kv.pool.num_available == free_before
        # Release advances the generation named in the wait condition.
        release = client.release_cache(pb.ReleaseCacheRequest(cache_id=hog_id))
        assert release.blocks_freed == 12
        client.release_cache(pb.ReleaseCacheRequest(cache_id=views[1].cache_id))
        snapshot_gen = engine.kv.clock.generations[(1, 0)]
        assert snapshot_gen > observed[0].epoch
    engine.kv.check()
    assert engine.kv.pool.num_available == engine.kv.pool.num_blocks


def test_health_and_info(client: ExecutorClient) -> None:
    assert client.health() == 1
    assert client.health("ferrum.executor.v1.ExecutorService") == 1
    info = client.get_info()
    assert info.model_info.vocab_size == VOCAB
    assert info.capabilities.supports_native_unified_decode
    assert info.executor_instance_id != 0
    status = client.get_status().status
    assert status.state == pb.EXECUTOR_STATE_READY and status.is_ready


def test_async_client_mirrors_sync(live_server: object) -> None:
    async def scenario() -> None:
        async with AsyncExecutorClient(live_server.target) as client:  # type: ignore[attr-defined]
            response = await client.prefill(pb.PrefillRequest(input_tokens=[1, 2, 3]))
            cache_id = response.completed.kv_cache.cache_id
            decoded = await client.decode(
                pb.DecodeRequest(
                    cache_id=cache_id,
                    input_token=response.completed.output.token.token_id,
                    position=3,
                )
            )
            assert decoded.completed.kv_cache.num_tokens == 4
            await client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))

    live_server.run(scenario())  # type: ignore[attr-defined]
    asyncio.get_event_loop_policy()


def test_warmup_status_and_metrics_rpcs(client: ExecutorClient) -> None:
    warm = client.warmup(pb.WarmupRequest(num_tokens=64))
    assert warm.num_tokens == 64 and warm.forward_ms > 0
    assert (
        warm.max_supported_total_tokens
        == warm.total_blocks * warm.block_size
        == (client.get_kv_slot_capacity().snapshot.total_blocks * 4)
    )
    metrics = client.get_metrics().metrics
    assert metrics.total_operations >= 1 and metrics.prefill_operations >= 1
    assert metrics.throughput_tps > 0
    status = client.get_status().status
    assert status.steps_executed == metrics.total_operations
    assert status.memory_usage.allocated_bytes >= status.memory_usage.used_bytes > 0
    capacity = client.get_capacity_snapshot()
    assert capacity.epochs.coordinator_id == client.get_info().executor_instance_id
    assert capacity.limits.maximum_scheduled_tokens == 512
    assert [s.source for s in capacity.sources] == [
        pb.CAPACITY_SOURCE_DOMAIN,
        pb.CAPACITY_SOURCE_ACTIVE_SEQUENCE_SLOTS,
    ]
    assert client.maintain_prefill_backing(
        pb.MaintainPrefillBackingRequest(request_id="x")
    ).HasField("no_longer_pending")
