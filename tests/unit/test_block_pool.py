"""Where BlockPool puts a sequence's blocks: after its last block, else at a free run with room
for what it may grow to; never at the cost of capacity (any free block serves when no run is
free), and never the same block twice."""

from __future__ import annotations

import itertools
import random
from typing import Any

from ferrum_server.kv.block_pool import BlockPool
from ferrum_server.kv.manager import KvManager


def _breaks(blocks: list[int]) -> int:
    return sum(1 for a, b in itertools.pairwise(blocks) if b != a + 1)


def test_a_fresh_pool_without_hints_hands_out_the_lowest_ids_first() -> None:
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.check()


def test_a_growing_sequence_takes_the_blocks_after_its_last_one() -> None:
    pool = BlockPool(32)
    first = pool.allocate(2, room=6)  # a new sequence that may grow to 6 blocks
    other = pool.allocate(2, room=6)  # the next one starts past the first one's room
    assert first == [0, 1] and other == [6, 7]
    assert pool.allocate(3, after=first[-1], room=4) == [2, 3, 4]
    assert pool.allocate(1, after=other[-1], room=4) == [8]
    # Past its room, it still runs on while the next blocks are free.
    assert pool.allocate(2, after=4, room=2) == [5, 12]  # 6 is taken: 12 starts a free run
    pool.check()


def test_without_a_free_run_any_free_blocks_serve_so_capacity_is_unchanged() -> None:
    pool = BlockPool(10)
    held = [pool.allocate(1, room=4) for _ in range(2)]  # at 0 and 4: the tails stay free
    assert held == [[0], [4]]
    # No run of 8 (or of 3) is free, so the blocks come from the free list, lowest first.
    taken = pool.allocate(3, room=8)
    assert taken == [1, 2, 3]
    rest = pool.allocate(pool.num_free, room=pool.num_free)
    assert sorted(rest) == [5, 6, 7, 8, 9]
    assert pool.num_free == 0
    pool.check()


def test_a_run_is_searched_past_the_last_new_sequence_then_from_the_start() -> None:
    pool = BlockPool(12)
    a = pool.allocate(2, room=4)
    b = pool.allocate(2, room=4)
    c = pool.allocate(2, room=4)
    assert (a, b, c) == ([0, 1], [4, 5], [8, 9])
    pool.free(a)
    # Past c's room there is nothing left, so the search wraps to the start: a's old run.
    assert pool.allocate(2, room=4) == [0, 1]
    pool.check()


def test_a_run_freed_after_a_failed_search_is_found_again() -> None:
    pool = BlockPool(16)
    held = pool.allocate(16)
    pool.free(held[1::2])  # every other block: no run of two
    assert pool.allocate(1, room=4) == [1]  # no room to grow in, but a free block
    assert pool.allocate(1, room=4) == [3]  # (that failed search is not repeated)
    pool.free([held[8], held[10]])  # 8 and 10 join 7, 9 and 11: a run of five
    assert pool.allocate(1, room=4) == [7]  # (5, the next free block, is not a run of four)
    pool.check()


def test_blocks_taken_in_runs_and_freed_again_are_never_handed_out_twice() -> None:
    rng = random.Random(0)
    pool = BlockPool(64)
    held: list[list[int]] = []
    for _ in range(3000):
        if held and (rng.random() < 0.45 or pool.num_available < 8):
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            count = rng.randint(1, 6)
            after = held[-1][-1] if held and rng.random() < 0.5 else None
            held.append(pool.allocate(count, after=after, room=rng.choice([0, count, 12])))
        flat = [b for blocks in held for b in blocks]
        assert len(flat) == len(set(flat))
        assert pool.num_free == pool.num_blocks - len(flat)
        # Stale entries of the free stack stay bounded: 1.5x the pool plus one.
        assert len(pool._free_ids) <= pool.num_blocks * 3 // 2 + 1
    pool.check()


def test_the_manager_grows_interleaved_caches_in_consecutive_blocks() -> None:
    """Prompts prefilled in chunks across shared steps, then decodes for all of them, as a
    scheduler runs them: each cache's blocks come out in one run (the attention reads it in
    order), where the free list alone interleaves them."""
    block = 4
    kv = KvManager(256, block, 8, coordinator_id=1, prefix_caching=False)
    caches = [kv.open(f"r{i}", max_tokens=10 + 24) for i in range(4)]  # 10 prompt, 24 new
    for cache in caches:  # first chunks in one step, then the rest of each prompt
        kv.grow(cache, 6)
    for cache in caches:
        kv.grow(cache, 10)
    for length in range(11, 10 + 24 + 1):  # decode steps: every cache grows a token at a time
        for cache in caches:
            kv.grow(cache, length)
    for cache in caches:
        assert len(cache.block_ids) == kv.blocks_for(34)
        assert _breaks(cache.block_ids) == 0, cache.block_ids
    kv.pool.check()


def test_under_churn_caches_stay_in_runs() -> None:
    """A long-running server's churn (caches of mixed lengths opening, growing by chunks and
    decodes, and ending at random) scatters a free list's blocks; placement keeps each cache
    nearly whole: here none of the ended caches' 3,447 blocks is out of order, where the free
    list alone leaves 2,471 out of order."""
    rng = random.Random(0)
    kv = KvManager(1000, 16, 64, coordinator_id=1, prefix_caching=False)
    live: dict[str, tuple[Any, int, int, int]] = {}  # cache, length, prompt, final length
    out_of_order = total = opened = 0
    for _ in range(800):
        while len(live) < 24:
            prompt, new = rng.randint(32, 400), rng.randint(16, 200)
            if kv.pool.num_available < kv.blocks_for(prompt + new) + 4:
                break
            cache = kv.open(f"r{opened}", prompt + new)
            opened += 1
            kv.grow(cache, min(prompt, 128))
            live[cache.cache_id] = (cache, min(prompt, 128), prompt, prompt + new)
        for cache_id, (cache, length, prompt, final) in list(live.items()):
            length = min(length + 128, prompt) if length < prompt else length + 1
            kv.grow(cache, length)
            live[cache_id] = (cache, length, prompt, final)
            if length >= final:
                out_of_order += _breaks(cache.block_ids)
                total += len(cache.block_ids)
                kv.release(cache_id)
                del live[cache_id]
    assert opened > 100 and total > 2000
    assert out_of_order / total < 0.05, (out_of_order, total)
    kv.pool.check()
