"""Request authority in the KV manager, the validator and the capacity manager (no model, no
gRPC): token identity of chunks, one live cache per request, preemption and completion identity,
and the bounded memory of retired cache ids."""

from __future__ import annotations

import hashlib
import tracemalloc

import pytest
import torch
from ferrum_server.capacity import Admitted, CapacityManager, PreemptionMode, SlotRequest
from ferrum_server.domain import DeferralMode, ItemKind, PromptIdentity, Step, StepItem
from ferrum_server.errors import AlreadyExists, InvalidArgument, NotFound
from ferrum_server.kv import manager as kv_manager
from ferrum_server.kv.manager import (
    KvManager,
    Retirement,
    block_hash,
    chain_hashes,
    completion_counts_agree,
    context_digest,
    prefix_hash,
)
from ferrum_server.kv.storage import KvStorage
from ferrum_server.recorder import Recorder
from ferrum_server.validate import Limits, validate_step

BLOCK = 4
LIMITS = Limits(
    vocab_size=64,
    max_sequence_length=64,
    max_batch_tokens=64,
    max_batch_size=8,
    max_num_logprobs=0,
    instance_id=1,
)


def _capacity(prefix_caching: bool = True) -> CapacityManager:
    kv = KvManager(32, BLOCK, 6, coordinator_id=1, prefix_caching=prefix_caching)
    return CapacityManager(kv, KvStorage(torch.zeros(1, 2, 32, BLOCK, 1, 1)), LIMITS, 0, Recorder())


def _chunk(
    request_id: str, cache_id: str, tokens: list[int], position: int, total: int
) -> StepItem:
    return StepItem(ItemKind.PREFILL_CHUNK, request_id, cache_id, tokens, position, total)


def _admitted(capacity: CapacityManager, request_id: str, tokens: list[int]) -> str:
    decision = capacity.try_admit(request_id, tokens, 0, len(tokens), 0)
    assert isinstance(decision, Admitted)
    return decision.cache_id


def test_block_hash_is_the_blake2b_chain_of_little_endian_tokens() -> None:
    # The packed form must not change what prefix caching keys blocks by.
    tokens = [1, 70000, 2**32 - 1, 0]
    expected = hashlib.blake2b(
        b"parent" + b"".join(t.to_bytes(4, "little") for t in tokens), digest_size=16
    ).digest()
    assert block_hash(b"parent", tokens) == expected
    hashes = chain_hashes(list(range(10)), BLOCK)
    assert len(hashes) == 2 and hashes[1] == block_hash(hashes[0], [4, 5, 6, 7])
    assert prefix_hash(hashes, 0) != prefix_hash(hashes, 1)
    # The whole-context digest tells apart contexts that share every full block.
    assert context_digest([1, 2, 3, 4, 5], BLOCK) != context_digest([1, 2, 3, 4, 6], BLOCK)
    assert context_digest([1, 2, 3, 4], BLOCK) != context_digest([1, 2, 3, 4, 0], BLOCK)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_chunks_must_carry_the_admitted_context(prefix_caching: bool) -> None:
    capacity = _capacity(prefix_caching)
    kv = capacity.kv
    tokens = list(range(1, 11))
    cache_id = _admitted(capacity, "a", tokens)
    cache = kv.caches[cache_id]
    kv.commit(cache, tokens[:6])
    wrong = [
        _chunk("a", cache_id, [9, 9, 9], 6, 10),  # other tokens
        _chunk("a", cache_id, tokens[6:9], 6, 11),  # another total
    ]
    for item in wrong:
        refused = validate_step(Step([item]), kv, LIMITS).refused
        assert isinstance(refused.get(0), InvalidArgument), item
        with pytest.raises(InvalidArgument):
            validate_step(Step([item], DeferralMode.ALL_OR_NOTHING), kv, LIMITS)
    assert not validate_step(Step([_chunk("a", cache_id, tokens[6:9], 6, 10)]), kv, LIMITS).refused
    # A chunk call carrying the whole prompt: compared by its digests.
    digest = context_digest(tokens, BLOCK)
    good = PromptIdentity(digest, prefix_hash(chain_hashes(tokens, BLOCK), 1), tokens[4:6])
    for identity, ok in (
        (good, True),
        (PromptIdentity(b"x" * 16, good.prefix_digest, good.prefix_tail), False),
        (PromptIdentity(digest, b"y" * 16, good.prefix_tail), False),
        (PromptIdentity(digest, good.prefix_digest, [5, 7]), False),
    ):
        item = StepItem(ItemKind.PREFILL_CHUNK, "a", cache_id, tokens[6:9], 6, 10, prompt=identity)
        assert (not validate_step(Step([item]), kv, LIMITS).refused) == ok, identity
    # Decodes wait for the prompt to be complete.
    decode = StepItem(ItemKind.DECODE, "a", cache_id, [1], 6)
    assert isinstance(validate_step(Step([decode]), kv, LIMITS).refused.get(0), InvalidArgument)
    kv.commit(cache, tokens[6:])
    assert cache.context is None  # the admitted tokens are dropped once committed
    decode = StepItem(ItemKind.DECODE, "a", cache_id, [1], 10)
    assert not validate_step(Step([decode]), kv, LIMITS).refused
    # Once complete, a chunk may extend the sequence with a new, longer prompt.
    extend = _chunk("a", cache_id, [3, 3], 10, 14)
    assert not validate_step(Step([extend]), kv, LIMITS).refused


def test_one_live_cache_per_request() -> None:
    capacity = _capacity()
    kv = capacity.kv
    cache_id = _admitted(capacity, "a", [1, 2, 3])
    opener = _chunk("a", "", [1, 2, 3], 0, 3)
    assert isinstance(validate_step(Step([opener]), kv, LIMITS).refused.get(0), AlreadyExists)
    with pytest.raises(AlreadyExists):
        capacity.reserve_slots([SlotRequest("", "a", 4)])
    with pytest.raises(AlreadyExists):
        capacity.try_admit("a", [1, 2, 3], 0, 3, 0)
    with pytest.raises(InvalidArgument, match="opens a second cache"):
        validate_step(Step([_chunk("b", "", [1], 0, 1), _chunk("b", "", [2], 0, 1)]), kv, LIMITS)
    with pytest.raises(InvalidArgument, match="opens a second cache"):
        capacity.reserve_slots([SlotRequest("", "b", 4), SlotRequest("", "b", 4)])
    # A refused opener reserves nothing in reserve_step either.
    step = Step([opener, _chunk("c", "", [4, 5], 0, 2)])
    validated = validate_step(step, kv, LIMITS)
    free = kv.pool.num_available
    capacity.reserve_step(step, validated.caches, skip=validated.refused)
    assert validated.caches[0] is None and validated.caches[1] is not None
    assert kv.pool.num_available == free - 1 and len(kv.caches) == 2
    kv.check()
    assert kv.live_cache_of("a") is kv.caches[cache_id]


def test_preemption_and_completion_name_the_owning_request() -> None:
    capacity = _capacity()
    kv = capacity.kv
    cache_id = _admitted(capacity, "a", [1, 2, 3, 4, 5])
    for request_id in ("", "b"):
        with pytest.raises(InvalidArgument):
            capacity.preempt(request_id, cache_id, PreemptionMode.RECOMPUTE)
    assert cache_id in kv.caches
    kv.commit(kv.caches[cache_id], [1, 2, 3, 4, 5])
    # 5 committed: a prompt of 5 with no output or one (not fed back), or a prompt of 4 with one
    # output fed back and maybe a last one that was not, ...
    for counts in [(5, 0), (5, 1), (4, 1), (4, 2), (1, 4), (1, 5)]:
        assert completion_counts_agree(5, *counts), counts
    for counts in [(0, 5), (0, 6), (6, 0), (5, 2), (3, 1), (2, 1), (4, 3)]:
        assert not completion_counts_agree(5, *counts), counts
        with pytest.raises(InvalidArgument):
            kv.complete("a", cache_id, *counts)
    assert cache_id in kv.caches
    with pytest.raises(InvalidArgument):
        kv.complete("b", cache_id, 5, 1)
    assert kv.complete("a", cache_id, 5, 1).released
    again = kv.complete("a", cache_id, 5, 1)
    assert not again.released and again.previously == Retirement.COMPLETED
    with pytest.raises(InvalidArgument):
        kv.complete("b", cache_id, 5, 1)  # a retired cache stays its request's
    with pytest.raises(NotFound):
        kv.complete("a", "never", 5, 1)


def test_retired_ids_are_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = KvManager(8, BLOCK, 4, coordinator_id=1)
    long_id = "r" * 250
    # RETIRED_ENTRY_OVERHEAD covers what an entry really costs beyond its ids' bytes.
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    count = 2000
    for k in range(count):
        kv.release(kv.open(f"{long_id}{k:05d}", 8).cache_id)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    ids, accounted = kv.retired_memory
    assert ids == count
    assert used <= accounted, (used / count, accounted / count)
    # The byte bound forgets the oldest ids first, whatever the count bound allows.
    monkeypatch.setattr(kv_manager, "RETIRED_MAX_BYTES", 64 * 1024)
    first = kv.open("first" + long_id, 8).cache_id
    kv.release(first)
    for k in range(400):
        kv.release(kv.open(f"{long_id}x{k:05d}", 8).cache_id)
    ids, accounted = kv.retired_memory
    assert 64 * 1024 - 1024 < accounted <= 64 * 1024 and ids < kv_manager.RETIRED_MAX_IDS
    with pytest.raises(NotFound):
        kv.release(first)  # forgotten: no longer recognised as a repeat
    last = next(reversed(kv._retired))
    assert not kv.release(last).released
