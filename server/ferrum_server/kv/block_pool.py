"""A pool of fixed-size KV blocks: a free list and per-block reference counts.

Pure Python; the tensors live in the engine. The pool never allocates more than it has:
callers check `num_free` first (check-then-mutate), so running out is a programming error.
"""

from __future__ import annotations


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        # Lowest ids first, so a fresh pool hands out 0, 1, 2, ... (handy in tests).
        self._free_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref_counts: list[int] = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free_ids)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free_ids):
            raise RuntimeError(f"allocate({count}) with {len(self._free_ids)} free blocks")
        taken = self._free_ids[len(self._free_ids) - count :]
        del self._free_ids[len(self._free_ids) - count :]
        taken.reverse()
        for block_id in taken:
            self._ref_counts[block_id] = 1
        return taken

    def free(self, block_ids: list[int]) -> int:
        """Drop one reference from each block; return how many became free."""
        freed = 0
        for block_id in reversed(block_ids):
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = count
            if count == 0:
                self._free_ids.append(block_id)
                freed += 1
        return freed

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def check(self) -> None:
        """Raise if the free list and the reference counts disagree (tests call this)."""
        free = set(self._free_ids)
        if len(free) != len(self._free_ids):
            raise AssertionError("a block is on the free list twice")
        for block_id, count in enumerate(self._ref_counts):
            if count < 0 or (count == 0) != (block_id in free):
                state = "free" if block_id in free else "held"
                raise AssertionError(f"block {block_id}: ref count {count} but {state}")
