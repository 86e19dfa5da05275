"""Prefill narrowing below the RPC layer (issue #14, item 4): a chunk that does not fit runs the
prefix that fits when it allows narrowing, and an admission short of KV blocks hints the
largest first chunk that would be admitted now, which a re-probe with first_chunk_tokens takes.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from ferrum_server.capacity import Admitted, CapacityManager, Deferred
from ferrum_server.domain import DeferralMode, ItemKind, Step, StepItem
from ferrum_server.errors import InvalidArgument
from ferrum_server.kv.manager import Cache, KvManager
from ferrum_server.kv.storage import KvStorage
from ferrum_server.recorder import Recorder
from ferrum_server.validate import Limits

BLOCK = 4
_HOGS = itertools.count()


def _capacity(num_blocks: int = 8, *, prefix_caching: bool = False) -> CapacityManager:
    kv = KvManager(num_blocks, BLOCK, 4, coordinator_id=1, prefix_caching=prefix_caching)
    limits = Limits(
        vocab_size=64,
        max_sequence_length=64,
        max_batch_tokens=64,
        max_batch_size=8,
        max_num_logprobs=0,
        instance_id=1,
    )
    kv_cache = torch.zeros(1, 2, num_blocks, BLOCK, 1, 1)
    return CapacityManager(kv, KvStorage(kv_cache), limits, 0, Recorder())


def _chunk(tokens: list[int], *, allow: bool, cache_id: str = "", position: int = 0) -> StepItem:
    return StepItem(
        ItemKind.PREFILL_CHUNK,
        "r",
        cache_id,
        tokens,
        position,
        total_prompt_tokens=position + len(tokens) + 4,
        allow_narrowing=allow,
    )


def _hog(capacity: CapacityManager, blocks: int) -> Cache:
    """Another sequence holding `blocks` blocks."""
    cache = capacity.kv.open(f"hog-{next(_HOGS)}", 64)
    capacity.kv.grow(cache, blocks * BLOCK)
    return cache


@pytest.mark.parametrize("mode", [DeferralMode.PER_ITEM, DeferralMode.ALL_OR_NOTHING])
def test_a_narrowable_chunk_takes_the_prefix_the_free_blocks_hold(mode: DeferralMode) -> None:
    capacity = _capacity()
    _hog(capacity, 5)  # 3 of 8 blocks left: 12 tokens
    item = _chunk(list(range(1, 21)), allow=True)  # 20 tokens need 5 blocks
    caches: list[Cache | None] = [None]
    reservation = capacity.reserve_step(Step([item], mode), caches)
    assert not reservation.deferrals
    narrowed = reservation.narrowed[0]
    assert narrowed.token_ids == list(range(1, 13)) and narrowed.position == 0
    assert not narrowed.is_final and narrowed.total_prompt_tokens == item.total_prompt_tokens
    opened = caches[0]
    assert opened is not None and len(opened.block_ids) == 3
    assert capacity.kv.pool.num_available == 0 and capacity.stats.narrowed_chunks == 1


def test_an_extension_narrows_to_the_held_plus_free_blocks() -> None:
    capacity = _capacity()
    cache = capacity.kv.open("r", 64)
    capacity.kv.grow(cache, 6)  # 2 blocks held, 6 tokens committed below
    capacity.kv.commit(cache, [1] * 6)
    _hog(capacity, 5)  # 1 block left
    item = _chunk([2] * 10, allow=True, cache_id=cache.cache_id, position=6)  # to 16: 4 blocks
    reservation = capacity.reserve_step(Step([item]), [cache])
    # Held 2 + free 1 = 3 blocks = 12 positions; 6 are committed, so 6 more tokens run.
    assert len(reservation.narrowed[0].token_ids) == 6
    assert len(cache.block_ids) == 3


def test_without_permission_or_room_the_chunk_is_deferred_and_nothing_is_taken() -> None:
    capacity = _capacity()
    _hog(capacity, 5)
    free = capacity.kv.pool.num_available
    reservation = capacity.reserve_step(Step([_chunk([1] * 20, allow=False)]), [None])
    assert not reservation.narrowed and 0 in reservation.deferrals
    assert reservation.deferrals[0].narrower_prefill_tokens == 12  # the hint is still given
    assert capacity.kv.pool.num_available == free and len(capacity.kv.caches) == 1
    _hog(capacity, 3)  # nothing left: not even one token fits
    full = capacity.reserve_step(Step([_chunk([1] * 20, allow=True)]), [None])
    assert not full.narrowed and 0 in full.deferrals
    # A one-token chunk cannot narrow, and decodes never do.
    one = capacity.reserve_step(Step([_chunk([1], allow=True)]), [None])
    assert 0 in one.deferrals


def test_a_narrowed_item_in_an_all_or_nothing_step_still_runs_with_the_others() -> None:
    capacity = _capacity()
    _hog(capacity, 4)  # 4 blocks left
    items = [_chunk([1] * 4, allow=False), _chunk([2] * 20, allow=True)]
    items[1] = dataclasses.replace(items[1], request_id="s")
    caches: list[Cache | None] = [None, None]
    reservation = capacity.reserve_step(Step(items, DeferralMode.ALL_OR_NOTHING), caches)
    assert not reservation.deferrals
    assert len(reservation.narrowed[1].token_ids) == 12  # 3 blocks after the first item's one
    assert capacity.kv.pool.num_available == 0


def test_admission_hints_the_largest_first_chunk_that_fits_and_the_reprobe_takes_it() -> None:
    capacity = _capacity(8)
    _hog(capacity, 5)  # 3 blocks available
    tokens = list(range(1, 21))  # 20 tokens: 5 blocks
    deferred = capacity.try_admit("r", tokens, 0, 20, 0)
    assert isinstance(deferred, Deferred)
    assert deferred.narrower_prefill_tokens == 12  # exactly 3 blocks of 4
    admitted = capacity.try_admit("r", tokens, 0, 20, 0, 0, deferred.narrower_prefill_tokens)
    assert isinstance(admitted, Admitted) and admitted.held_blocks == 3
    cache = capacity.kv.caches[admitted.cache_id]
    assert cache.context_tokens == 20 and cache.num_tokens == 0
    # A first chunk past the claim (no block is left) defers without permission, and with it
    # runs the 12 tokens the claim holds.
    chunk = _chunk(tokens[:16], allow=False, cache_id=cache.cache_id)
    assert 0 in capacity.reserve_step(Step([chunk]), [cache]).deferrals
    allowed = dataclasses.replace(chunk, allow_narrowing=True)
    assert capacity.reserve_step(Step([allowed]), [cache]).narrowed[0].token_ids == tokens[:12]


def test_admission_hint_counts_prefix_hits_and_names_only_block_shortfalls() -> None:
    capacity = _capacity(8, prefix_caching=True)
    kv = capacity.kv
    shared = list(range(1, 9))  # two full blocks
    first = capacity.try_admit("a", [*shared, 50], 0, 9, 0)
    assert isinstance(first, Admitted)
    kv.commit(kv.caches[first.cache_id], [*shared, 50])
    kv.release(first.cache_id)  # its two full blocks stay cached (and available)
    _hog(capacity, 4)  # free: 2 uncached + 2 cached blocks
    tokens = [*shared, *range(20, 36)]  # 24 tokens: 6 blocks, 2 of them cached hits
    deferred = capacity.try_admit("b", tokens, 0, 24, 0)
    assert isinstance(deferred, Deferred)
    # The 2 hits plus the 2 blocks left once they are taken: 16 tokens.
    assert deferred.narrower_prefill_tokens == 16
    admitted = capacity.try_admit("b", tokens, 0, 24, 0, 0, 16)
    assert isinstance(admitted, Admitted) and admitted.cached_prompt_tokens == 8
    assert admitted.held_blocks == 4 and kv.pool.num_available == 0
    # With no block available there is no hint.
    none_left = capacity.try_admit("c", [7] * 8, 0, 8, 0)
    assert isinstance(none_left, Deferred) and none_left.narrower_prefill_tokens == 0


def test_first_chunk_tokens_beyond_the_context_is_invalid_and_changes_nothing() -> None:
    capacity = _capacity()
    with pytest.raises(InvalidArgument, match="first_chunk_tokens 9 exceeds the 8 input tokens"):
        capacity.try_admit("r", [1] * 8, 0, 8, 0, 0, 9)
    assert not capacity.kv.caches and capacity.stats.probes == 0
