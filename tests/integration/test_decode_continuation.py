"""Decode continuation (issue #19): a decode item fed the token its cache's last item selected
(BatchItems.continue_decode), and the reference scheduler's mode that keeps two steps in flight
with every running request in each.

Executor side: a continuation equals a decode that carries the token; a continuation on a cache
holding no selected token (a non-final chunk, full logits, a truncation, a stale position, a
released cache) fails alone in a unified step, whole in a transactional one, and changes
nothing; a retried step id replays its stored answer and a re-sent step never reads a token a
later step selected. Scheduler side: outputs equal plain greedy runs, a request that stops has
exactly one extra item whose token nobody sees and whose blocks all come back, step N+1 reaches
the executor before step N's answer is processed, and every running request is in every step.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

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
from helpers_server import LiveServer, start_live_server, tiny_block_bytes

VOCAB = 512  # the tiny model
ABORTED = grpc.StatusCode.ABORTED.value[0]
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]


@pytest.fixture(scope="module")
def roomy() -> Iterator[LiveServer]:
    """Prefix caching on: blocks a finished request leaves behind stay cached, and come back."""
    yield from start_live_server(
        block_size=4,
        kv_cache_bytes=2048 * tiny_block_bytes(4),
        max_batch_tokens=512,
        max_batch_size=64,
        prefix_caching=True,
    )


@pytest.fixture(scope="module")
def tight() -> Iterator[LiveServer]:
    """24 blocks of 4 tokens: room for about three of the requests at once."""
    yield from start_live_server(
        block_size=4,
        kv_cache_bytes=24 * tiny_block_bytes(4),
        max_batch_tokens=256,
        max_batch_size=16,
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


def _assert_quiescent(server: LiveServer) -> None:
    kv = server.engine.kv  # type: ignore[attr-defined]
    kv.check()
    assert not kv.caches
    assert kv.pool.num_available == kv.pool.num_blocks


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
