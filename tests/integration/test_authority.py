"""The request-authority rules through gRPC: token identity of prefill chunks, one live cache per
request, and request identity on preemption and completion. Every refusal changes nothing."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from ferrum_client import (
    AlreadyExistsError,
    BatchBuilder,
    ExecutorClient,
    ExecutorError,
    InvalidArgumentError,
    item_views,
    pb,
)
from helpers_server import LiveServer

VOCAB = 512


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def _state(server: LiveServer) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was: every live cache (tokens, blocks,
    hashes, prompt identity), the pool, the request index and the epochs."""
    engine: Any = server.engine

    def read() -> tuple[Any, ...]:
        kv = engine.kv
        caches = tuple(
            (
                c.cache_id,
                c.request_id,
                tuple(c.token_ids),
                tuple(c.block_ids),
                tuple(c.block_hashes),
                c.prompt_total,
                c.prompt_digest,
                c.pending_admission,
            )
            for c in sorted(kv.caches.values(), key=lambda c: c.cache_id)
        )
        pool = (kv.pool.num_free, kv.pool.num_cached, kv.pool.num_used)
        epochs = (kv.clock.release_epoch, kv.clock.capacity_epoch)
        return caches, pool, tuple(sorted(kv.by_request.items())), epochs

    return engine.call_sync(read)  # type: ignore[no-any-return]


def _refused(
    server: LiveServer, call: Callable[[], object], error: type[ExecutorError], text: str
) -> None:
    before = _state(server)
    with pytest.raises(error) as caught:
        call()
    assert text in str(caught.value), caught.value
    assert _state(server) == before


def _admit(client: ExecutorClient, request_id: str, tokens: list[int]) -> str:
    decision = client.try_admit_prefill(
        pb.TryAdmitPrefillRequest(
            request_id=request_id, input_tokens=tokens, product_prompt_tokens=len(tokens)
        )
    )
    assert decision.WhichOneof("decision") == "admitted", decision
    return decision.admitted.cache_id


def _chunk(request_id: str, cache_id: str, tokens: list[int], position: int, total: int) -> Any:
    builder = BatchBuilder()
    builder.add_prefill_chunk(request_id, cache_id, tokens, position, total)
    return pb.UnifiedBatchRequest(items=builder.build())


def _prefill(
    client: ExecutorClient, request_id: str, prompt: list[int], cache_id: str, start: int, end: int
) -> Any:
    return client.prefill(
        pb.PrefillRequest(
            request_id=request_id,
            input_tokens=prompt,
            cache_id=cache_id,
            chunk=pb.PrefillChunk(
                tokens_processed=start,
                tokens_to_process=end - start,
                total_prompt_tokens=len(prompt),
            ),
        )
    )


# -- token identity ----------------------------------------------------------------------------


def test_a_chunk_of_another_prompt_on_an_admitted_cache_is_refused(
    live_server: LiveServer, client: ExecutorClient
) -> None:
    prompt = _prompt(1, 14)
    cache_id = _admit(client, "tok-a", prompt)
    first = client.unified_batch(_chunk("tok-a", cache_id, prompt[:6], 0, 14))
    assert item_views(first.results)[0].committed_tokens == 6
    other = _prompt(2, 14)
    cases: list[tuple[str, Callable[[], object], str]] = [
        # A different prompt on the wire (Prefill carries it whole).
        (
            "prompt",
            lambda: _prefill(client, "tok-a", other[:6] + other[6:], cache_id, 6, 10),
            "differ",
        ),
        # Same chunk tokens, but a different total_prompt_tokens.
        (
            "total",
            lambda: client.unified_batch(_chunk("tok-a", cache_id, prompt[6:10], 6, 15)),
            "total_prompt_tokens 15",
        ),
        # The right length, other tokens than admitted.
        (
            "tokens",
            lambda: client.unified_batch(_chunk("tok-a", cache_id, other[6:10], 6, 14)),
            "execution context admitted",
        ),
        # The prompt's tokens before the chunk differ from the committed ones.
        (
            "prefix",
            lambda: _prefill(client, "tok-a", other[:6] + prompt[6:], cache_id, 6, 10),
            "differ",
        ),
    ]
    for name, call, text in cases:
        before = _state(live_server)
        try:
            result = call()
        except InvalidArgumentError as exc:
            assert text in str(exc), (name, exc)
        else:
            # A UnifiedBatch fails just that item (PER_ITEM), with the code a call would get.
            (view,) = item_views(result.results)  # type: ignore[attr-defined]
            assert view.status == pb.ITEM_STATUS_FAILED, name
            assert view.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], name
            assert text in view.error.message, (name, view.error.message)
            assert view.committed_tokens == 6
        assert _state(live_server) == before, name
    # The right chunk still runs, by either path.
    done = _prefill(client, "tok-a", prompt, cache_id, 6, 14)
    assert done.completed.kv_cache.num_tokens == 14
    client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))


def test_an_unadmitted_cache_keeps_the_prompt_it_was_opened_with(
    live_server: LiveServer, client: ExecutorClient
) -> None:
    prompt = _prompt(3, 13)
    # Opened by a batch item, which carries only its own tokens: the prompt's tokens before a
    # later chunk are compared with the committed ones by block hash.
    opened = client.unified_batch(_chunk("tok-b", "", prompt[:5], 0, 13))
    cache_id = item_views(opened.results)[0].cache_id
    block = list(prompt)
    block[1] = (block[1] + 1) % VOCAB  # inside the first full block (block size 4)
    tail = list(prompt)
    tail[4] = (tail[4] + 1) % VOCAB  # the partial block after it
    for other in (block, tail):
        _refused(
            live_server,
            lambda o=other: _prefill(client, "tok-b", o, cache_id, 5, 9),  # type: ignore[misc]
            InvalidArgumentError,
            "first 5 tokens differ",
        )
    _refused(
        live_server,
        lambda: _prefill(client, "tok-b", [*prompt, 1], cache_id, 5, 9),
        InvalidArgumentError,
        "total_prompt_tokens 14",
    )
    # A decode before the prompt is complete is not a chunk of it.
    _refused(
        live_server,
        lambda: client.decode(pb.DecodeRequest(cache_id=cache_id, input_token=1, position=5)),
        InvalidArgumentError,
        "prefilled to 5 of 13",
    )
    result = client.unified_batch(_chunk("tok-b", cache_id, prompt[5:9], 5, 12))
    assert item_views(result.results)[0].status == pb.ITEM_STATUS_FAILED
    assert _prefill(client, "tok-b", prompt, cache_id, 5, 13).completed.kv_cache.num_tokens == 13
    # A prompt whose chunk call carried it whole is held to all of it, after the chunk too.
    second = _prefill(client, "tok-b2", prompt, "", 0, 5).completed.kv_cache.cache_id
    later = list(prompt)
    later[11] = (later[11] + 1) % VOCAB
    _refused(
        live_server,
        lambda: _prefill(client, "tok-b2", later, second, 5, 9),
        InvalidArgumentError,
        "prompt differs",
    )
    client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))
    client.release_cache(pb.ReleaseCacheRequest(cache_id=second))


def test_a_refused_item_leaves_the_other_items_of_a_unified_batch_running(
    live_server: LiveServer, client: ExecutorClient
) -> None:
    prompt = _prompt(4, 10)
    cache_id = _admit(client, "tok-c", prompt)
    builder = BatchBuilder()
    builder.add_prefill_chunk("tok-c", cache_id, _prompt(5, 10), 0, 10)  # not the admitted one
    builder.add_prefill_chunk("tok-d", "", _prompt(6, 7), 0, 7)
    views = item_views(client.unified_batch(pb.UnifiedBatchRequest(items=builder.build())).results)
    assert views[0].status == pb.ITEM_STATUS_FAILED and views[0].committed_tokens == 0
    assert views[1].status == pb.ITEM_STATUS_TOKEN and views[1].committed_tokens == 7
    # A transactional batch refuses the whole call instead, and runs nothing.
    batch = BatchBuilder()
    batch.add_prefill_chunk("tok-c", cache_id, _prompt(5, 10), 0, 10)
    batch.add_prefill_chunk("tok-e", "", _prompt(7, 7), 0, 7)
    _refused(
        live_server,
        lambda: client.batch_prefill(pb.BatchPrefillRequest(items=batch.build())),
        InvalidArgumentError,
        "execution context admitted",
    )
    client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))
    client.release_cache(pb.ReleaseCacheRequest(cache_id=views[1].cache_id))


# -- one KV authority per request --------------------------------------------------------------


def test_a_request_holding_a_cache_cannot_open_another(
    live_server: LiveServer, client: ExecutorClient
) -> None:
    prompt = _prompt(8, 9)
    admitted = _admit(client, "one", prompt)
    _refused(
        live_server,
        lambda: _prefill(client, "one", prompt, "", 0, 9),
        AlreadyExistsError,
        "already holds cache",
    )
    _refused(
        live_server,
        lambda: client.reserve_kv_slots(
            pb.ReserveKvSlotsRequest(cache_ids=[""], request_ids=["one"], target_lens=[4])
        ),
        AlreadyExistsError,
        "already holds cache",
    )
    # In a UnifiedBatch only the opening item fails; the continuing one runs.
    builder = BatchBuilder()
    builder.add_prefill_chunk("one", admitted, prompt, 0, 9)
    builder.add_prefill_chunk("one", "", prompt, 0, 9)
    views = item_views(client.unified_batch(pb.UnifiedBatchRequest(items=builder.build())).results)
    assert views[0].status == pb.ITEM_STATUS_TOKEN
    assert views[1].status == pb.ITEM_STATUS_FAILED
    assert views[1].error.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
    # Two opening items of one request in one batch: malformed, the whole call is refused.
    twice = BatchBuilder()
    twice.add_prefill_chunk("two", "", prompt, 0, 9)
    twice.add_prefill_chunk("two", "", prompt, 0, 9)
    _refused(
        live_server,
        lambda: client.unified_batch(pb.UnifiedBatchRequest(items=twice.build())),
        InvalidArgumentError,
        "opens a second cache",
    )
    _refused(
        live_server,
        lambda: client.reserve_kv_slots(
            pb.ReserveKvSlotsRequest(request_ids=["two", "two"], target_lens=[4, 4])
        ),
        InvalidArgumentError,
        "opens a second cache",
    )
    # Once released, the request may open a cache again.
    client.release_cache(pb.ReleaseCacheRequest(cache_id=admitted))
    again = _prefill(client, "one", prompt, "", 0, 9).completed.kv_cache.cache_id
    client.release_cache(pb.ReleaseCacheRequest(cache_id=again))


# -- preemption and completion identity --------------------------------------------------------


def test_preemption_names_the_request_that_holds_the_cache(
    live_server: LiveServer, client: ExecutorClient
) -> None:
    cache_id = _admit(client, "victim", _prompt(9, 6))
    for request_id, text in (("", "request_id is required"), ("other", "another request")):
        _refused(
            live_server,
            lambda rid=request_id: client.preempt_execution_capacity(  # type: ignore[misc]
                pb.PreemptExecutionCapacityRequest(request_id=rid, cache_id=cache_id)
            ),
            InvalidArgumentError,
            text,
        )
    receipt = client.preempt_execution_capacity(
        pb.PreemptExecutionCapacityRequest(request_id="victim", cache_id=cache_id)
    ).receipt
    assert (receipt.request_id, receipt.cache_id) == ("victim", cache_id)


def _completions(server: LiveServer, outcome: str) -> float:
    metrics: Any = server.engine.recorder.metrics  # type: ignore[attr-defined]
    value = metrics.registry.get_sample_value(
        "ferrum_executor_completions_total", {"outcome": outcome}
    )
    return float(value or 0.0)


def _tokens(server: LiveServer, kind: str) -> float:
    metrics: Any = server.engine.recorder.metrics  # type: ignore[attr-defined]
    value = metrics.registry.get_sample_value(
        "ferrum_executor_completed_tokens_total", {"kind": kind}
    )
    return float(value or 0.0)


def test_completion_checks_its_counts_and_names_how_an_ended_cache_ended(
    live_server: LiveServer, client: ExecutorClient
) -> None:
    prompt = _prompt(10, 7)
    first = _prefill(client, "done", prompt, "", 0, 7).completed
    cache_id = first.kv_cache.cache_id
    client.decode(
        pb.DecodeRequest(cache_id=cache_id, input_token=first.output.token.token_id, position=7)
    )  # 8 committed: the prompt and the first output; the second output is not fed back

    def complete(request_id: str, input_tokens: int, output_tokens: int) -> Any:
        return client.complete_cache(
            pb.CompleteCacheRequest(
                request_id=request_id,
                cache_id=cache_id,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
            )
        )

    for request_id, counts, text in (
        ("", (7, 2), "request_id is required"),
        ("other", (7, 2), "another request"),
        ("done", (0, 0), "do not match"),
        ("done", (7, 0), "do not match"),  # outputs missing
        ("done", (7, 5), "do not match"),  # more outputs than ran
        ("done", (9, 0), "do not match"),  # a longer prompt than committed
    ):
        _refused(
            live_server, lambda r=request_id, c=counts: complete(r, *c), InvalidArgumentError, text
        )
    completed, outputs = _completions(live_server, "completed"), _tokens(live_server, "output")
    done = complete("done", 7, 2)
    assert done.released and done.outcome == pb.COMPLETION_OUTCOME_COMPLETED
    assert _completions(live_server, "completed") == completed + 1
    assert _tokens(live_server, "output") == outputs + 2
    repeat = complete("done", 7, 2)
    assert not repeat.released and repeat.outcome == pb.COMPLETION_OUTCOME_ALREADY_COMPLETED
    assert _tokens(live_server, "output") == outputs + 2  # a repeat counts no tokens
    with pytest.raises(InvalidArgumentError):
        complete("other", 7, 2)  # a retired cache still belongs to its request


@pytest.mark.parametrize(
    ("end", "outcome"),
    [
        ("release", pb.COMPLETION_OUTCOME_ALREADY_RELEASED),
        ("cancel", pb.COMPLETION_OUTCOME_CANCELLED),
        ("preempt", pb.COMPLETION_OUTCOME_PREEMPTED),
    ],
)
def test_a_completion_after_another_end_answers_that_end(
    live_server: LiveServer, client: ExecutorClient, end: str, outcome: int
) -> None:
    request_id = f"ended-{end}"
    cache_id = _admit(client, request_id, _prompt(11, 5))
    if end == "release":
        client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))
    elif end == "cancel":
        client.cancel_prefill_admission(pb.CancelPrefillAdmissionRequest(request_id=request_id))
    else:
        client.preempt_execution_capacity(
            pb.PreemptExecutionCapacityRequest(request_id=request_id, cache_id=cache_id)
        )
    label = pb.CompletionOutcome.Name(outcome).removeprefix("COMPLETION_OUTCOME_").lower()
    before = _completions(live_server, label)
    answer = client.complete_cache(
        pb.CompleteCacheRequest(
            request_id=request_id, cache_id=cache_id, input_tokens=5, output_tokens=1
        )
    )
    assert not answer.released and answer.outcome == outcome
    assert _completions(live_server, label) == before + 1
