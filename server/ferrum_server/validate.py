"""Whole-step validation against the current state. Reads only; raises a domain error.

Every check runs before any state changes, so a rejected step leaves the executor exactly as
it was. Messages name the item index and the offending value, never internals.

The authority checks (who may open or extend which cache, with which tokens) refuse one item:
in a PER_ITEM step that item alone fails and the others run; any other step is refused whole.
So do the state checks of a continuation decode (its cache is live, at the item's position, and
holds a selected token), because a pipelining scheduler sends it before it has seen the answer
that would tell it the token exists (docs/protocol.md#decode-continuation).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

from ferrum_server.domain import (
    GREEDY,
    DeferralMode,
    ItemKind,
    OutputPolicy,
    Sampling,
    Step,
    StepItem,
)
from ferrum_server.errors import (
    AlreadyExists,
    ExecutorError,
    InvalidArgument,
    NotFound,
    PositionMismatch,
    StaleInstance,
)
from ferrum_server.kv.manager import Cache, KvManager, prefix_hash

# Longest id accepted, in bytes of UTF-8: every string field of a request (convert.check_ids)
# and every step item's ids. Ids are logged, stored and echoed in answers.
MAX_ID_BYTES = 256


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int
    max_sequence_length: int
    max_batch_tokens: int
    max_batch_size: int
    max_num_logprobs: int
    instance_id: int
    # Refuse mutating calls that skip the fence (executor_instance_id 0).
    require_fencing: bool = False
    # Largest response the server may send (0 = unchecked); a step whose outputs could not be
    # sent is refused before it runs, rather than run and then lost in transport.
    max_response_bytes: int = 0


def check_instance(claimed: int, limits: Limits) -> None:
    if not claimed and limits.require_fencing:
        raise StaleInstance(
            "this executor requires executor_instance_id on mutating calls (see GetInfo)"
        )
    if claimed and claimed != limits.instance_id:
        raise StaleInstance(
            f"executor instance {claimed} is gone; this is instance {limits.instance_id}"
        )


@dataclass(frozen=True, slots=True)
class Validated:
    """A step that may run: its items (continuation decodes carrying the token their cache
    selected), each item's cache (None for items opening a cache, or a refused continuation's
    cache that is gone), and the items refused for authority or a continuation's state
    (PER_ITEM steps only: they fail alone, nothing runs for them)."""

    items: list[StepItem]
    caches: list[Cache | None]
    refused: dict[int, ExecutorError] = field(default_factory=dict)


def validate_step(step: Step, kv: KvManager, limits: Limits) -> Validated:
    """Check the whole step; answer each item's cache and the items refused for authority."""
    check_instance(step.executor_instance_id, limits)
    items = step.items
    if not items:
        raise InvalidArgument("a step needs at least one item")
    if len(items) > limits.max_batch_size:
        raise InvalidArgument(f"{len(items)} items exceed the batch limit {limits.max_batch_size}")
    # A continuation decode runs one token it does not carry.
    total = sum(len(item.token_ids) or int(item.continuation) for item in items)
    if total > limits.max_batch_tokens:
        raise InvalidArgument(f"{total} tokens exceed the per-step limit {limits.max_batch_tokens}")
    if limits.max_response_bytes:
        needed = response_bytes(items, limits)
        if needed > limits.max_response_bytes:
            raise InvalidArgument(
                f"the outputs need about {needed} bytes, over the {limits.max_response_bytes}-byte "
                "message limit; split the batch or request selected tokens"
            )
    sequences: list[Cache | None] = []
    refused: dict[int, ExecutorError] = {}
    seen: set[str] = set()
    openers: set[str] = set()
    resolved = list(items)
    # Sampling settings already checked in this step (by identity: items converted from one
    # call share equal settings as one object, and GREEDY is valid by construction).
    checked: set[int] = {id(GREEDY)}
    for index, item in enumerate(items):
        if item.continuation:
            _check_continuation(index, item)
            continued = _continue(index, item, kv)
            if isinstance(continued, ExecutorError):
                if step.mode != DeferralMode.PER_ITEM:
                    raise continued
                if item.cache_id in seen:
                    raise InvalidArgument(f"item {index}: cache {item.cache_id!r} appears twice")
                seen.add(item.cache_id)
                refused[index] = continued
                sequences.append(kv.caches.get(item.cache_id))
                continue
            item = resolved[index] = continued
        _check_item(index, item, limits)
        if id(item.sampling) not in checked:
            _check_sampling(f"item {index}", item.sampling, limits)
            checked.add(id(item.sampling))
        if item.cache_id:
            if item.cache_id in seen:
                raise InvalidArgument(f"item {index}: cache {item.cache_id!r} appears twice")
            seen.add(item.cache_id)
        else:
            check_opener(index, item.request_id, openers)
        cache = _check_against_state(index, item, kv)
        sequences.append(cache)
        error = check_authority(index, item, cache, kv)
        if error is not None:
            if step.mode != DeferralMode.PER_ITEM:
                raise error
            refused[index] = error
    return Validated(resolved, sequences, refused)


def _check_continuation(index: int, item: StepItem) -> None:
    """The stateless shape of a continuation decode (INVALID_ARGUMENT for the whole step)."""
    # Runs for every continuation decode of every step: the messages are built only when an
    # item fails.
    if _ids_too_long(item.request_id, item.cache_id):
        raise InvalidArgument(f"item {index}: ids are limited to {MAX_ID_BYTES} bytes")
    if item.kind != ItemKind.DECODE:
        raise InvalidArgument(
            f"item {index}: only a decode item may continue from a selected token"
        )
    if item.token_ids:
        raise InvalidArgument(
            f"item {index}: a continuation decode carries no token (num_tokens 0), got "
            f"{len(item.token_ids)}"
        )
    if not item.cache_id:
        raise InvalidArgument(f"item {index}: a continuation decode needs the cache it continues")


def _continue(index: int, item: StepItem, kv: KvManager) -> StepItem | ExecutorError:
    """The continuation decode with the token its cache selected, or why it cannot run now:
    its cache is gone (NOT_FOUND), is not at the item's position, or holds no selected token
    (ABORTED: the caller's view of the sequence is out of step). Reads only."""
    try:
        cache = kv.lookup(item.cache_id)
    except NotFound as error:  # it says how the cache ended
        return NotFound(f"item {index}: {error.message}")
    if item.position != cache.num_tokens:
        return PositionMismatch(
            f"item {index}: position {item.position} does not match the cache's committed "
            f"length {cache.num_tokens}"
        )
    if cache.selected_token < 0:
        if cache.selected_on_device is not None:
            # Selected by a step launched but not finished: the forward reads the token on the
            # device (Engine.launch); 0 holds its place on the host.
            return item.with_tokens([0])
        return PositionMismatch(
            f"item {index}: cache {item.cache_id!r} holds no selected token to continue from "
            "(the last item that ran on it was a non-final prefill chunk, a full-logits item or "
            "a verify, or the cache was truncated since); send the token in a plain decode"
        )
    return item.with_tokens([cache.selected_token])


def check_opener(index: int, request_id: str, openers: set[str]) -> None:
    """A request opens at most one cache per call (an empty request id opens an anonymous
    cache, which belongs to no request)."""
    if not request_id:
        return
    if request_id in openers:
        raise InvalidArgument(
            f"item {index}: request {request_id!r} opens a second cache in one call; a request "
            "holds one cache"
        )
    openers.add(request_id)


def check_authority(
    index: int, item: StepItem, cache: Cache | None, kv: KvManager
) -> ExecutorError | None:
    """Whether the item may open or extend its cache: one live cache per request, and while a
    cache's prompt is incomplete only chunks of that prompt (same length, same tokens where
    known) run on it. Reads only; the refusal, or None."""
    if cache is None:
        holder = kv.live_cache_of(item.request_id)
        if holder is None:
            return None
        return AlreadyExists(
            f"item {index}: request {item.request_id!r} already holds cache {holder.cache_id!r}; "
            "continue that cache, or release or preempt it before opening another"
        )
    if item.kind != ItemKind.PREFILL_CHUNK:
        if cache.prompt_in_progress:
            return InvalidArgument(
                f"item {index}: the cache's prompt is prefilled to {cache.num_tokens} of "
                f"{cache.prompt_total} tokens; only its chunks run until it is complete"
            )
        return None
    if cache.prompt_in_progress:
        if item.total_prompt_tokens != cache.prompt_total:
            return InvalidArgument(
                f"item {index}: total_prompt_tokens {item.total_prompt_tokens} differs from the "
                f"{cache.prompt_total}-token prompt of cache {cache.cache_id!r}"
            )
        context = cache.context
        if context is not None and context[item.position : item.end] != array("I", item.token_ids):
            return InvalidArgument(
                f"item {index}: the chunk's tokens differ from the execution context admitted for "
                f"cache {cache.cache_id!r} at [{item.position}, {item.end})"
            )
        prompt = item.prompt
        if prompt is not None and cache.prompt_digest and prompt.digest != cache.prompt_digest:
            return InvalidArgument(
                f"item {index}: the prompt differs from the one cache {cache.cache_id!r} was "
                "admitted or opened with"
            )
    if item.prompt is not None:
        # A block-hash comparison: the chained hash of the prompt's full blocks before the
        # chunk against the cache's committed block hashes, plus the few tokens after them.
        start = item.position - item.position % kv.block_size
        num_blocks = item.position // kv.block_size
        if (
            item.prompt.prefix_digest != prefix_hash(cache.block_hashes, num_blocks)
            or item.prompt.prefix_tail != cache.token_ids[start : item.position]
        ):
            return InvalidArgument(
                f"item {index}: the prompt's first {item.position} tokens differ from those cache "
                f"{cache.cache_id!r} committed"
            )
    return None


def response_bytes(items: list[StepItem], limits: Limits) -> int:
    """An upper bound on the encoded results of a step (logits rows dominate)."""
    total = 1024
    for item in items:
        per_output = 32 + 10 * item.sampling.num_logprobs
        if item.sampling.policy == OutputPolicy.LOGITS:
            per_output += 4 * limits.vocab_size + 8
        total += 96 + item.num_outputs * per_output
    return total


def _check_item(index: int, item: StepItem, limits: Limits) -> None:
    """The item's shape against the model's limits (its sampling is checked apart). Runs for
    every item of every step, so the common case costs a few comparisons."""
    tokens = item.token_ids
    count = len(tokens)
    cache_id = item.cache_id
    if _ids_too_long(item.request_id, cache_id):
        raise InvalidArgument(f"item {index}: ids are limited to {MAX_ID_BYTES} bytes")
    if count == 0:
        raise InvalidArgument(f"item {index}: empty token list")
    kind = item.kind
    if kind == ItemKind.DECODE and count != 1:
        raise InvalidArgument(f"item {index}: a decode item carries exactly one token, got {count}")
    if max(tokens) >= limits.vocab_size:
        bad = next(t for t in tokens if t >= limits.vocab_size)
        raise InvalidArgument(
            f"item {index}: token id {bad} outside the vocabulary [0, {limits.vocab_size})"
        )
    max_len = item.max_sequence_tokens or limits.max_sequence_length
    if max_len > limits.max_sequence_length:
        raise InvalidArgument(
            f"item {index}: maximum_sequence_tokens {max_len} exceeds the model maximum "
            f"{limits.max_sequence_length}"
        )
    end = item.end
    if kind == ItemKind.PREFILL_CHUNK:
        where = f"item {index}"
        if item.total_prompt_tokens == 0:
            raise InvalidArgument(f"{where}: a prefill chunk needs total_prompt_tokens > 0")
        if end > item.total_prompt_tokens:
            raise InvalidArgument(
                f"{where}: chunk [{item.position}, {end}) lies outside the prompt of "
                f"{item.total_prompt_tokens} tokens"
            )
        if item.total_prompt_tokens > max_len:
            raise InvalidArgument(
                f"{where}: prompt of {item.total_prompt_tokens} tokens exceeds the maximum "
                f"sequence length {max_len}"
            )
    if end > max_len:
        raise InvalidArgument(
            f"item {index}: position {end - 1} is beyond the maximum sequence length {max_len}"
        )
    if not cache_id and (kind != ItemKind.PREFILL_CHUNK or item.position != 0):
        raise InvalidArgument(f"item {index}: only a prefill chunk at position 0 may open a cache")


def _ids_too_long(request_id: str, cache_id: str) -> bool:
    """Whether either id is over MAX_ID_BYTES of UTF-8. A str of at most MAX_ID_BYTES / 4
    characters fits whatever its characters, so only a longer one is encoded (this runs for
    every item of every step)."""
    return max(len(request_id), len(cache_id)) * 4 > MAX_ID_BYTES and (
        max(len(request_id.encode()), len(cache_id.encode())) > MAX_ID_BYTES
    )


def _check_sampling(where: str, sampling: Sampling, limits: Limits) -> None:
    for name in ("temperature", "top_p", "repetition_penalty"):
        value = getattr(sampling, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"{where}: {name} must be finite and >= 0, got {value}")
    if sampling.top_p > 1.0:
        raise InvalidArgument(f"{where}: top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.policy not in (OutputPolicy.TOKEN, OutputPolicy.LOGITS):
        raise InvalidArgument(f"{where}: unknown logits return policy {int(sampling.policy)}")
    if sampling.num_logprobs > limits.max_num_logprobs:
        raise InvalidArgument(
            f"{where}: num_logprobs {sampling.num_logprobs} exceeds {limits.max_num_logprobs}"
        )
    if sampling.token_mask:
        expected = (limits.vocab_size + 7) // 8
        if len(sampling.token_mask) != expected:
            raise InvalidArgument(
                f"{where}: token mask has {len(sampling.token_mask)} bytes, expected {expected} "
                f"(one bit per vocabulary entry)"
            )
        if not _mask_allows_any(sampling.token_mask, limits.vocab_size):
            raise InvalidArgument(f"{where}: token mask allows no token")


def _mask_allows_any(mask: bytes, vocab_size: int) -> bool:
    full_bytes, tail_bits = divmod(vocab_size, 8)
    if any(mask[:full_bytes]):
        return True
    return bool(tail_bits and mask[full_bytes] & ((1 << tail_bits) - 1))


def _check_against_state(index: int, item: StepItem, kv: KvManager) -> Cache | None:
    if not item.cache_id:
        return None
    cache = kv.lookup(item.cache_id)
    if item.request_id and item.request_id != cache.request_id:
        raise InvalidArgument(f"item {index}: cache {item.cache_id!r} belongs to another request")
    if item.position != cache.num_tokens:
        raise PositionMismatch(
            f"item {index}: position {item.position} does not match the cache's committed "
            f"length {cache.num_tokens}"
        )
    if item.end > cache.max_tokens:
        raise InvalidArgument(
            f"item {index}: position {item.end - 1} is beyond the sequence's maximum "
            f"{cache.max_tokens}"
        )
    return cache
