"""Whole-step validation against the current state. Reads only; raises a domain error.

Every check runs before any state changes, so a rejected step leaves the executor exactly as
it was. Messages name the item index and the offending value, never internals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ferrum_server.domain import ItemKind, OutputPolicy, Sampling, Step, StepItem
from ferrum_server.errors import InvalidArgument, PositionMismatch, StaleInstance
from ferrum_server.kv.manager import Cache, KvManager

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


def validate_step(step: Step, kv: KvManager, limits: Limits) -> list[Cache | None]:
    """Check the whole step; return each item's cache (None for items opening a cache)."""
    check_instance(step.executor_instance_id, limits)
    items = step.items
    if not items:
        raise InvalidArgument("a step needs at least one item")
    if len(items) > limits.max_batch_size:
        raise InvalidArgument(f"{len(items)} items exceed the batch limit {limits.max_batch_size}")
    total = sum(len(item.token_ids) for item in items)
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
    seen: set[str] = set()
    for index, item in enumerate(items):
        _check_item(index, item, limits)
        if item.cache_id:
            if item.cache_id in seen:
                raise InvalidArgument(f"item {index}: cache {item.cache_id!r} appears twice")
            seen.add(item.cache_id)
        sequences.append(_check_against_state(index, item, kv))
    return sequences


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
    where = f"item {index}"
    count = len(item.token_ids)
    if max(len(item.request_id.encode()), len(item.cache_id.encode())) > MAX_ID_BYTES:
        raise InvalidArgument(f"{where}: ids are limited to {MAX_ID_BYTES} bytes")
    if count == 0:
        raise InvalidArgument(f"{where}: empty token list")
    if item.kind == ItemKind.DECODE and count != 1:
        raise InvalidArgument(f"{where}: a decode item carries exactly one token, got {count}")
    bad = [t for t in item.token_ids if t >= limits.vocab_size]
    if bad:
        raise InvalidArgument(
            f"{where}: token id {bad[0]} outside the vocabulary [0, {limits.vocab_size})"
        )
    max_len = item.max_sequence_tokens or limits.max_sequence_length
    if max_len > limits.max_sequence_length:
        raise InvalidArgument(
            f"{where}: maximum_sequence_tokens {max_len} exceeds the model maximum "
            f"{limits.max_sequence_length}"
        )
    if item.kind == ItemKind.PREFILL_CHUNK:
        if item.total_prompt_tokens == 0:
            raise InvalidArgument(f"{where}: a prefill chunk needs total_prompt_tokens > 0")
        if item.end > item.total_prompt_tokens:
            raise InvalidArgument(
                f"{where}: chunk [{item.position}, {item.end}) lies outside the prompt of "
                f"{item.total_prompt_tokens} tokens"
            )
        if item.total_prompt_tokens > max_len:
            raise InvalidArgument(
                f"{where}: prompt of {item.total_prompt_tokens} tokens exceeds the maximum "
                f"sequence length {max_len}"
            )
    if item.end > max_len:
        raise InvalidArgument(
            f"{where}: position {item.end - 1} is beyond the maximum sequence length {max_len}"
        )
    if not item.cache_id and (item.kind != ItemKind.PREFILL_CHUNK or item.position != 0):
        raise InvalidArgument(f"{where}: only a prefill chunk at position 0 may open a cache")
    _check_sampling(where, item.sampling, limits)


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
    where = f"item {index}"
    if not item.cache_id:
        return None
    cache = kv.lookup(item.cache_id)
    if item.request_id and item.request_id != cache.request_id:
        raise InvalidArgument(f"{where}: cache {item.cache_id!r} belongs to another request")
    if item.position != cache.num_tokens:
        raise PositionMismatch(
            f"{where}: position {item.position} does not match the cache's committed length "
            f"{cache.num_tokens}"
        )
    if item.end > cache.max_tokens:
        raise InvalidArgument(
            f"{where}: position {item.end - 1} is beyond the sequence's maximum {cache.max_tokens}"
        )
    return cache
