"""Every bad-input case, alone and inside a batch with valid items: the documented status code,
the whole batch rejected, nothing changed, and the valid items then run fine on their own."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from ferrum_client import BatchBuilder, ExecutorClient, ExecutorError, SamplingOptions, pb

VOCAB = 512
MAX_LEN = 2048  # tiny model positions
MASK_BYTES = VOCAB // 8


def _state(engine: object) -> tuple[object, ...]:
    kv = engine.kv  # type: ignore[attr-defined]
    seqs = {cid: (s.num_tokens, tuple(s.block_ids)) for cid, s in kv.caches.items()}
    return (seqs, kv.pool.num_free, kv.pool.num_cached, engine.stats.steps)  # type: ignore[attr-defined]


@pytest.fixture
def ready(client: ExecutorClient) -> dict[str, str]:
    """Two live caches: 'a' holds 5 tokens, 'b' holds 6."""
    ids = {}
    for name, length in (("a", 5), ("b", 6)):
        r = client.prefill(pb.PrefillRequest(request_id=name, input_tokens=list(range(length))))
        ids[name] = r.completed.kv_cache.cache_id
    released = client.prefill(pb.PrefillRequest(request_id="gone", input_tokens=[1, 2]))
    gone = released.completed.kv_cache.cache_id
    client.release_cache(pb.ReleaseCacheRequest(cache_id=gone))
    ids["gone"] = gone
    yield ids
    for name in ("a", "b"):
        client.release_cache(pb.ReleaseCacheRequest(cache_id=ids[name]))


BadItem = Callable[[BatchBuilder, dict[str, str]], None]

CASES: dict[str, tuple[BadItem, grpc.StatusCode]] = {
    "token outside vocabulary": (
        lambda b, ids: b.add_decode("a", ids["a"], VOCAB, 5),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "empty token list": (
        lambda b, ids: b.add_prefill_chunk("n", "", [], 0, 4),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "chunk outside the prompt": (
        lambda b, ids: b.add_prefill_chunk("n", "", [1, 2, 3], 0, 2),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "position beyond max length": (
        lambda b, ids: b.add_prefill_chunk("n", "", [1, 2], 0, MAX_LEN + 1),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "beyond the item's own maximum": (
        lambda b, ids: b.add_prefill_chunk("n", "", [1, 2, 3], 0, 3, maximum_sequence_tokens=2),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "unknown cache id": (
        lambda b, ids: b.add_decode("x", "no-such-cache", 1, 0),
        grpc.StatusCode.NOT_FOUND,
    ),
    "released cache id": (
        lambda b, ids: b.add_decode("gone", ids["gone"], 1, 2),
        grpc.StatusCode.NOT_FOUND,
    ),
    "position not the committed length": (
        lambda b, ids: b.add_decode("b", ids["b"], 1, 4),
        grpc.StatusCode.ABORTED,
    ),
    "same cache twice": (
        lambda b, ids: (b.add_decode("b", ids["b"], 1, 6), b.add_decode("b", ids["b"], 2, 6)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "mask of the wrong length": (
        lambda b, ids: b.add_decode(
            "b", ids["b"], 1, 6, sampling=SamplingOptions(token_mask=b"\xff" * 3)
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "mask allowing nothing": (
        lambda b, ids: b.add_decode(
            "b", ids["b"], 1, 6, sampling=SamplingOptions(token_mask=bytes(MASK_BYTES))
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "NaN temperature": (
        lambda b, ids: b.add_decode(
            "b", ids["b"], 1, 6, sampling=SamplingOptions(temperature=float("nan"))
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "negative top_p": (
        lambda b, ids: b.add_decode("b", ids["b"], 1, 6, sampling=SamplingOptions(top_p=-0.5)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "infinite repetition penalty": (
        lambda b, ids: b.add_decode(
            "b", ids["b"], 1, 6, sampling=SamplingOptions(repetition_penalty=float("inf"))
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "decode opening a cache": (
        lambda b, ids: b.add_decode("n", "", 1, 0),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "cache of another request": (
        lambda b, ids: b.add_decode("not-a", ids["a"], 1, 5),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
}


def _valid(builder: BatchBuilder, ids: dict[str, str]) -> None:
    builder.add_prefill_chunk("fresh", "", [3, 4, 5], 0, 3)
    builder.add_decode("a", ids["a"], 9, 5)


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "in-batch"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_item_rejects_whole_batch_and_changes_nothing(
    case: str, alone: bool, client: ExecutorClient, ready: dict[str, str], live_server: object
) -> None:
    add_bad, code = CASES[case]
    engine = live_server.engine  # type: ignore[attr-defined]
    builder = BatchBuilder()
    if not alone:
        _valid(builder, ready)
    add_bad(builder, ready)
    before = _state(engine)
    with pytest.raises(ExecutorError) as caught:
        client.unified_batch(pb.UnifiedBatchRequest(items=builder.build()))
    assert caught.value.code == code, str(caught.value)
    assert str(caught.value)  # a clear message, not empty
    assert "Traceback" not in str(caught.value)
    assert _state(engine) == before
    if not alone:
        valid = BatchBuilder()
        _valid(valid, ready)
        response = client.unified_batch(pb.UnifiedBatchRequest(items=valid.build()))
        assert list(response.results.statuses) == [pb.ITEM_STATUS_TOKEN] * 2
        assert response.results.committed_tokens[1] == 6
        client.release_cache(pb.ReleaseCacheRequest(cache_id=response.results.cache_ids[0]))
        client.truncate_kv(pb.TruncateKvRequest(cache_id=ready["a"], new_length=5))


def test_malformed_columns_are_rejected(client: ExecutorClient) -> None:
    items = pb.BatchItems(kinds=[pb.ITEM_KIND_DECODE], num_tokens=[1], token_ids=[1, 2])
    with pytest.raises(ExecutorError) as caught:
        client.unified_batch(pb.UnifiedBatchRequest(items=items))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    items = pb.BatchItems(kinds=[pb.ITEM_KIND_DECODE, pb.ITEM_KIND_DECODE], cache_ids=["x"])
    with pytest.raises(ExecutorError) as caught:
        client.unified_batch(pb.UnifiedBatchRequest(items=items))
    assert "cache_ids" in str(caught.value)
    with pytest.raises(ExecutorError) as caught:
        client.unified_batch(pb.UnifiedBatchRequest())
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_single_item_rpcs_validate_too(client: ExecutorClient, ready: dict[str, str]) -> None:
    cases = [
        (
            lambda: client.prefill(pb.PrefillRequest(input_tokens=[])),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            lambda: client.prefill(
                pb.PrefillRequest(
                    input_tokens=[1, 2],
                    chunk=pb.PrefillChunk(
                        tokens_processed=1, tokens_to_process=2, total_prompt_tokens=2
                    ),
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            lambda: client.decode(pb.DecodeRequest(cache_id="nope", input_token=1)),
            grpc.StatusCode.NOT_FOUND,
        ),
        (
            lambda: client.truncate_kv(pb.TruncateKvRequest(cache_id=ready["a"], new_length=99)),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            lambda: client.release_cache(pb.ReleaseCacheRequest(cache_id="never-existed")),
            grpc.StatusCode.NOT_FOUND,
        ),
        (
            lambda: client.decode(
                pb.DecodeRequest(
                    cache_id=ready["a"], input_token=1, position=5, executor_instance_id=12345
                )
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        (
            lambda: client.reserve_kv_slots(
                pb.ReserveKvSlotsRequest(cache_ids=[ready["a"], ready["a"]], target_lens=[8, 8])
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ]
    for call, code in cases:
        with pytest.raises(ExecutorError) as caught:
            call()
        assert caught.value.code == code, str(caught.value)
