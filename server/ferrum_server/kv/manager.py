"""Sequences and their block tables over one BlockPool.

Owned by the engine thread: no locks. Every method either only reads (`blocks_needed`,
`lookup`, ...) or mutates after the caller has checked capacity, so a refused request changes
nothing.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

from ferrum_server.errors import NotFound
from ferrum_server.kv.block_pool import BlockPool
from ferrum_server.kv.epochs import KV_BLOCKS, SEQUENCE_SLOTS, EpochClock, SourceKey

# Retired cache ids remembered so that a repeated release is recognised as a repeat.
_RETIRED_MEMORY = 65536


@dataclass(slots=True)
class Sequence:
    """One cache incarnation: its blocks and the tokens committed to them."""

    cache_id: str
    request_id: str
    max_tokens: int
    block_ids: list[int] = field(default_factory=list)
    # Context tokens whose K/V are committed, in order; len(token_ids) == num_tokens.
    token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    released: bool
    blocks_freed: int


class KvManager:
    def __init__(
        self, num_blocks: int, block_size: int, max_sequences: int, coordinator_id: int
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.max_sequences = max_sequences
        self.clock = EpochClock(coordinator_id)
        self.sequences: dict[str, Sequence] = {}
        self._retired: OrderedDict[str, None] = OrderedDict()

    # -- reads -----------------------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence | None, target_len: int) -> int:
        held = len(seq.block_ids) if seq is not None else 0
        return max(0, self.blocks_for(target_len) - held)

    def lookup(self, cache_id: str) -> Sequence:
        seq = self.sequences.get(cache_id)
        if seq is None:
            state = "released" if cache_id in self._retired else "unknown"
            raise NotFound(f"cache {cache_id!r} is {state}")
        return seq

    def is_retired(self, cache_id: str) -> bool:
        return cache_id in self._retired

    @property
    def num_free_sequence_slots(self) -> int:
        return self.max_sequences - len(self.sequences)

    # -- mutations (capacity already checked by the caller) -------------------------------

    def open(self, request_id: str, max_tokens: int) -> Sequence:
        if len(self.sequences) >= self.max_sequences:
            raise RuntimeError("open() past the sequence ceiling")
        cache_id = secrets.token_hex(12)
        seq = Sequence(cache_id=cache_id, request_id=request_id, max_tokens=max_tokens)
        self.sequences[cache_id] = seq
        return seq

    def grow(self, seq: Sequence, target_len: int) -> int:
        """Make positions [0, target_len) writable; return the number of new blocks."""
        needed = self.blocks_needed(seq, target_len)
        if needed:
            seq.block_ids.extend(self.pool.allocate(needed))
        return needed

    def commit(self, seq: Sequence, token_ids: list[int]) -> None:
        if self.blocks_for(seq.num_tokens + len(token_ids)) > len(seq.block_ids):
            raise RuntimeError("commit() past the reserved blocks")
        seq.token_ids.extend(token_ids)

    def truncate(self, seq: Sequence, new_len: int) -> int:
        """Drop tokens past new_len and the blocks they no longer need; return blocks freed."""
        keep = self.blocks_for(new_len)
        dropped = seq.block_ids[keep:]
        del seq.block_ids[keep:]
        del seq.token_ids[new_len:]
        freed = self.pool.free(dropped)
        self.clock.bump({KV_BLOCKS} if freed else set())
        return freed

    def release(self, cache_id: str) -> ReleaseResult:
        seq = self.sequences.pop(cache_id, None)
        if seq is None:
            if cache_id in self._retired:
                return ReleaseResult(released=False, blocks_freed=0)
            raise NotFound(f"cache {cache_id!r} is unknown")
        freed = self.pool.free(seq.block_ids)
        seq.block_ids.clear()
        self._retire(cache_id)
        sources: set[SourceKey] = {SEQUENCE_SLOTS}
        if freed:
            sources.add(KV_BLOCKS)
        self.clock.bump(sources)
        return ReleaseResult(released=True, blocks_freed=freed)

    def _retire(self, cache_id: str) -> None:
        self._retired[cache_id] = None
        if len(self._retired) > _RETIRED_MEMORY:
            self._retired.popitem(last=False)

    # -- checks ----------------------------------------------------------------------------

    def check(self) -> None:
        """Raise if any invariant is broken (tests call this after every scenario)."""
        self.pool.check()
        held = [block for seq in self.sequences.values() for block in seq.block_ids]
        if len(held) != len(set(held)):
            raise AssertionError("a block is held by two sequences")
        if len(held) != self.pool.num_used:
            raise AssertionError(f"{len(held)} blocks held, {self.pool.num_used} used")
        for seq in self.sequences.values():
            if self.blocks_for(seq.num_tokens) > len(seq.block_ids):
                raise AssertionError(f"cache {seq.cache_id} has tokens past its blocks")
