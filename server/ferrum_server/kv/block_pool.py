"""A pool of fixed-size KV blocks: free list, reference counts, and the prefix cache.

Every block is in exactly one of three states:
- free: on the free list, ref count 0, no content worth keeping;
- used: ref count >= 1 (held by that many sequences);
- cached: ref count 0 but holding a full block whose content hash is registered, kept in LRU
  order so a later request with the same prefix can reuse it; evicted only when a new block is
  needed and the free list is empty.

Pure Python; the tensors live in the engine. Callers check `num_available` before allocating
(check-then-mutate), so running out is a programming error.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        # Lowest ids first, so a fresh pool hands out 0, 1, 2, ... (handy in tests).
        self._free_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref_counts: list[int] = [0] * num_blocks
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.num_evictions = 0

    # -- counts ----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take now: free plus evictable cached blocks."""
        return len(self._free_ids) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # -- allocation ------------------------------------------------------------------------

    def allocate(self, count: int) -> list[int]:
        if count > self.num_available:
            raise RuntimeError(f"allocate({count}) with {self.num_available} blocks available")
        taken: list[int] = []
        while len(taken) < count and self._free_ids:
            taken.append(self._free_ids.pop())
        while len(taken) < count:
            block_id, _ = self._cached.popitem(last=False)
            self._forget(block_id)
            self.num_evictions += 1
            taken.append(block_id)
        for block_id in taken:
            self._ref_counts[block_id] = 1
        return taken

    def acquire(self, block_id: int) -> None:
        """Add a holder to a used or cached block (a prefix-cache hit)."""
        if self._ref_counts[block_id] == 0:
            if block_id not in self._cached:
                raise RuntimeError(f"block {block_id} is free; only cached blocks can be reused")
            del self._cached[block_id]
        self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> int:
        """Drop one reference from each block; return how many left the used state."""
        released = 0
        for block_id in reversed(block_ids):
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = count
            if count == 0:
                released += 1
                if block_id in self._hash_of:
                    self._cached[block_id] = None
                else:
                    self._free_ids.append(block_id)
        return released

    # -- prefix cache ----------------------------------------------------------------------

    def lookup(self, content_hash: bytes) -> int | None:
        return self._block_of.get(content_hash)

    def register(self, block_id: int, content_hash: bytes) -> None:
        """Mark a used, full block as holding `content_hash` (first holder of a hash wins)."""
        if content_hash in self._block_of or block_id in self._hash_of:
            return
        self._block_of[content_hash] = block_id
        self._hash_of[block_id] = content_hash

    def unregister(self, block_id: int) -> None:
        """The block's content is about to change: drop its hash."""
        if self._ref_counts[block_id] == 0:
            raise RuntimeError(f"unregister of unheld block {block_id}")
        self._forget(block_id)

    def is_registered(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def _forget(self, block_id: int) -> None:
        content_hash = self._hash_of.pop(block_id, None)
        if content_hash is not None:
            del self._block_of[content_hash]

    # -- checks ----------------------------------------------------------------------------

    def check(self) -> None:
        """Raise if the three states and the counts disagree (tests call this)."""
        free = set(self._free_ids)
        if len(free) != len(self._free_ids):
            raise AssertionError("a block is on the free list twice")
        if free & set(self._cached):
            raise AssertionError("a block is both free and cached")
        for block_id, count in enumerate(self._ref_counts):
            in_free, in_cache = block_id in free, block_id in self._cached
            if count < 0 or (count == 0) != (in_free or in_cache):
                raise AssertionError(
                    f"block {block_id}: ref count {count}, free={in_free}, cached={in_cache}"
                )
            if in_cache and block_id not in self._hash_of:
                raise AssertionError(f"cached block {block_id} has no hash")
            if in_free and block_id in self._hash_of:
                raise AssertionError(f"free block {block_id} still has a hash")
        if len(free) + len(self._cached) + self.num_used != self.num_blocks:
            raise AssertionError("free + cached + used != total")
        if {self._block_of[h] for h in self._block_of} != set(self._hash_of):
            raise AssertionError("hash maps disagree")
