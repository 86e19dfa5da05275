"""A pool of fixed-size KV blocks: free list, reference counts, and the prefix cache.

Every block is in exactly one of three states:
- free: on the free list, ref count 0, no content worth keeping;
- used: ref count >= 1 (held by that many sequences);
- cached: ref count 0 but holding a full block whose content hash is registered, kept in LRU
  order so a later request with the same prefix can reuse it; evicted only when a new block is
  needed and the free list is empty.

Where a free block goes matters to the decode attention, which reads each sequence's blocks
in order: it reads a sequence whose blocks sit one after another in the pool faster than one
whose blocks are scattered (in bfloat16 on a Zen 5 machine, 8% less time a step for W1's
decodes and 14% for `w1-long`'s: benchmarks/kv_layout_bench.py, docs/benchmarks.md).
So `allocate` takes the blocks right after a sequence's last one when they are free, and starts
a new sequence at a run of free blocks long enough for what it may grow to (`room`), leaving
that run's tail free for it. That is a preference, never a reservation: when no such run is
free, any free block serves, so the pool's capacity is the same.

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
        # 1 where a block is free: the truth. _free_ids is a stack over it for taking any free
        # block; a block taken out of turn (a run) stays on it until popped, and pops skip
        # such stale entries. Lowest ids first, so a fresh pool hands out 0, 1, 2, ...
        self._is_free = bytearray(b"\x01") * num_blocks
        self._num_free = num_blocks
        self._free_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cursor = 0  # where the search for a new sequence's run starts (next fit)
        # No run of this many free blocks exists: only a release can make one, so until then a
        # search for one that long fails at once (in a fragmented pool each search scans it).
        self._no_run_of = num_blocks + 1
        self._ref_counts: list[int] = [0] * num_blocks
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.num_evictions = 0

    # -- counts ----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take now: free plus evictable cached blocks."""
        return self._num_free + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # -- allocation ------------------------------------------------------------------------

    def allocate(self, count: int, after: int | None = None, room: int = 0) -> list[int]:
        """`count` blocks: first those right after block `after` while they are free (a
        sequence growing past its last block), then, given `room`, the start of a free run of
        `room` blocks (a sequence that may grow to that many; its run's tail stays free for it
        unless another allocation needs it), then any free blocks, then evicted cached ones."""
        if count > self.num_available:
            raise RuntimeError(f"allocate({count}) with {self.num_available} blocks available")
        taken: list[int] = []
        is_free = self._is_free
        if after is not None:
            block_id = after + 1
            while len(taken) < count and block_id < self.num_blocks and is_free[block_id]:
                is_free[block_id] = 0
                taken.append(block_id)
                block_id += 1
        want = count - len(taken)
        if want and room >= want:
            start = self._free_run(room)
            if start < 0 and room > want:
                room = want  # no room to grow in: still one run for these blocks
                start = self._free_run(want)
            if start >= 0:
                is_free[start : start + want] = bytes(want)
                taken.extend(range(start, start + want))
                self._cursor = start + room
        self._num_free -= len(taken)
        while len(taken) < count and self._num_free:
            block_id = self._free_ids.pop()
            if is_free[block_id]:
                is_free[block_id] = 0
                self._num_free -= 1
                taken.append(block_id)
        while len(taken) < count:
            block_id, _ = self._cached.popitem(last=False)
            self._forget(block_id)
            self.num_evictions += 1
            taken.append(block_id)
        for block_id in taken:
            self._ref_counts[block_id] = 1
        return taken

    def _free_run(self, length: int) -> int:
        """The first block of `length` free blocks in a row, searched from the cursor on and
        then from the start; -1 when there is none. (A C-speed substring search.)"""
        if length >= self._no_run_of:
            return -1
        run = b"\x01" * length
        start = self._is_free.find(run, self._cursor)
        if start < 0 and self._cursor:
            start = self._is_free.find(run, 0, self._cursor + length - 1)
        if start < 0:
            self._no_run_of = length
        return start

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
                    self._release(block_id)
        return released

    def _release(self, block_id: int) -> None:
        self._is_free[block_id] = 1
        self._num_free += 1
        self._no_run_of = self.num_blocks + 1
        self._free_ids.append(block_id)
        # Entries past the free blocks (blocks since taken in runs) are skipped when popped. The
        # stack is rebuilt, a pass over the pool, once they pass half the pool: so at most once
        # every num_blocks / 2 blocks taken or released, and it never holds more than 1.5x the
        # pool plus one entry (an allocation only shortens it).
        if len(self._free_ids) - self._num_free > self.num_blocks // 2:
            self._free_ids = [b for b in range(self.num_blocks - 1, -1, -1) if self._is_free[b]]

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
        free = {block_id for block_id in range(self.num_blocks) if self._is_free[block_id]}
        if len(free) != self._num_free:
            raise AssertionError("the free count disagrees with the free blocks")
        if not free <= set(self._free_ids):
            raise AssertionError("a free block is missing from the free stack")
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
