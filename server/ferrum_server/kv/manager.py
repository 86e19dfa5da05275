"""Caches (one per request incarnation, named by `cache_id` on the wire) and their block tables
over one BlockPool, with prefix reuse.

Owned by the engine thread: no locks. Every method either only reads (`blocks_needed`,
`match_prefix`, `lookup`, ...) or mutates after the caller has checked capacity, so a refused
request changes nothing.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from ferrum_server import logs
from ferrum_server.errors import CapacityExhausted, NotFound
from ferrum_server.kv.block_pool import BlockPool
from ferrum_server.kv.epochs import KV_BLOCKS, SEQUENCE_SLOTS, EpochClock, SourceKey

_LOG = logs.get(__name__)
# Retired cache ids remembered so that a repeated release is recognised as a repeat.
_RETIRED_MEMORY = 65536
_ROOT_HASH = b"ferrum-prefix-root"


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """Content key of a full block: its tokens and (through `parent`) every token before it."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return digest.digest()


@dataclass(slots=True)
class Cache:
    """One cache incarnation: its blocks and the tokens committed to them."""

    cache_id: str
    request_id: str
    max_tokens: int
    block_ids: list[int] = field(default_factory=list)
    # Context tokens whose K/V are committed, in order; len(token_ids) == num_tokens.
    token_ids: list[int] = field(default_factory=list)
    # Content hash of each full committed block, in order (prefix caching).
    block_hashes: list[bytes] = field(default_factory=list)
    # Admitted through TryAdmitPrefill and no chunk has run yet.
    pending_admission: bool = False
    # Tokens of the admitted execution context (0 when opened without admission).
    context_tokens: int = 0
    # Where the product prompt ends: TryAdmitPrefill's product_prompt_tokens, else the first
    # chunk's total_prompt_tokens (0 until known). Tokens past it are outputs (penalty scope).
    prompt_tokens: int = 0
    # Hashes of full context blocks this cache will compute that others may wait for.
    pending_hashes: list[bytes] = field(default_factory=list)
    # Monotonic times for time-to-first-token and inter-token metrics.
    opened_s: float = field(default_factory=time.monotonic)
    last_token_s: float = 0.0
    # When a call last named this cache (monotonic): the cache lease counts from here.
    touched_s: float = field(default_factory=time.monotonic)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    released: bool
    blocks_freed: int


@dataclass(frozen=True, slots=True)
class KvUsage:
    """The pool's block counts at one moment: a copy, so it can leave the engine thread."""

    block_size: int
    total_blocks: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    # Held past each sequence's committed tokens (admitted, not yet written).
    reserved_blocks: int


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    block_ids: list[int]
    hashes: list[bytes]
    # Matched blocks that are cached (unreferenced): acquiring them takes them out of the pool.
    num_cached: int
    # Further full blocks that another admitted cache is about to compute.
    num_pending: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class KvManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_sequences: int,
        coordinator_id: int,
        *,
        prefix_caching: bool = True,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.max_sequences = max_sequences
        self.prefix_caching = prefix_caching
        self.clock = EpochClock(coordinator_id)
        self.caches: dict[str, Cache] = {}
        # Retired cache id -> how it ended ("released" or "expired"), for NOT_FOUND messages.
        self._retired: OrderedDict[str, str] = OrderedDict()
        # Content hash -> cache id of the admitted cache that will compute that block.
        self._pending: dict[bytes, str] = {}
        # Called after every release with (cache, reason, blocks freed) (execution events).
        self.release_listeners: list[Callable[[Cache, str, int], None]] = []

    # -- reads -----------------------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, cache: Cache | None, target_len: int) -> int:
        held = len(cache.block_ids) if cache is not None else 0
        return max(0, self.blocks_for(target_len) - held)

    def lookup(self, cache_id: str) -> Cache:
        """The live cache named by a call; naming it renews its lease."""
        cache = self.caches.get(cache_id)
        if cache is None:
            state = self._retired.get(cache_id, "unknown")
            if state == "expired":
                raise NotFound(
                    f"cache {cache_id!r} expired: no call named it for longer than the cache "
                    "lease (see RenewCacheLease)"
                )
            raise NotFound(f"cache {cache_id!r} is {state}")
        cache.touched_s = time.monotonic()
        return cache

    def idle_caches(self, lease_s: float, now: float) -> list[Cache]:
        """Caches no call has named for at least lease_s seconds, oldest first."""
        idle = [c for c in self.caches.values() if now - c.touched_s >= lease_s]
        return sorted(idle, key=lambda c: c.touched_s)

    def renew(self, cache_ids: list[str]) -> list[str]:
        """Renew the lease of each live cache among cache_ids; return the ids not live."""
        now = time.monotonic()
        missing = []
        for cache_id in cache_ids:
            cache = self.caches.get(cache_id)
            if cache is None:
                missing.append(cache_id)
            else:
                cache.touched_s = now
        return missing

    def renew_request(self, request_id: str) -> int:
        """Renew the lease of every live cache of request_id; return how many there were."""
        now = time.monotonic()
        count = 0
        for cache in self.caches.values():
            if cache.request_id == request_id:
                cache.touched_s = now
                count += 1
        return count

    @property
    def num_free_sequence_slots(self) -> int:
        return self.max_sequences - len(self.caches)

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks held past each cache's committed tokens (admitted, not yet written)."""
        return sum(len(s.block_ids) - self.blocks_for(s.num_tokens) for s in self.caches.values())

    def usage(self) -> KvUsage:
        pool = self.pool
        return KvUsage(
            block_size=self.block_size,
            total_blocks=pool.num_blocks,
            free_blocks=pool.num_free,
            cached_blocks=pool.num_cached,
            used_blocks=pool.num_used,
            reserved_blocks=self.num_reserved_blocks,
        )

    def match_prefix(self, tokens: list[int]) -> PrefixMatch:
        """Full cached blocks matching the start of `tokens`, leaving >= 1 token to run."""
        if not self.prefix_caching:
            return PrefixMatch([], [], 0)
        bs = self.block_size
        block_ids: list[int] = []
        hashes: list[bytes] = []
        parent = _ROOT_HASH
        num_cached = 0
        num_pending = 0
        for index in range((len(tokens) - 1) // bs):
            content = block_hash(parent, tokens[index * bs : (index + 1) * bs])
            block_id = self.pool.lookup(content)
            if block_id is not None and not num_pending:
                block_ids.append(block_id)
                hashes.append(content)
                num_cached += self.pool.ref_count(block_id) == 0
            elif content in self._pending:
                num_pending += 1
            else:
                break
            parent = content
        return PrefixMatch(block_ids, hashes, num_cached, num_pending)

    def releasable_blocks(self, cache: Cache) -> int:
        """Blocks that would leave the used state if `cache` were released now."""
        return sum(1 for b in cache.block_ids if self.pool.ref_count(b) == 1)

    # -- mutations (capacity already checked by the caller) -------------------------------

    def open(self, request_id: str, max_tokens: int) -> Cache:
        if len(self.caches) >= self.max_sequences:
            raise RuntimeError("open() past the sequence ceiling")
        cache_id = secrets.token_hex(12)
        cache = Cache(cache_id=cache_id, request_id=request_id, max_tokens=max_tokens)
        self.caches[cache_id] = cache
        _LOG.debug("cache_opened", request_id=request_id, cache_id=cache_id)
        return cache

    def admit(
        self,
        request_id: str,
        tokens: list[int],
        max_tokens: int,
        match: PrefixMatch,
        claim_tokens: int = 0,
    ) -> Cache:
        """Open a cache holding the matched prefix and blocks for the first claim_tokens of
        `tokens` (0 = all); later chunks grow it when they run."""
        cache = self.open(request_id, max_tokens)
        for block_id in match.block_ids:
            self.pool.acquire(block_id)
        cache.block_ids.extend(match.block_ids)
        cache.block_hashes.extend(match.hashes)
        cache.token_ids.extend(tokens[: match.num_blocks * self.block_size])
        cache.pending_admission = True
        cache.context_tokens = len(tokens)
        self.grow(cache, claim_tokens or len(tokens))
        if self.prefix_caching:
            bs = self.block_size
            parent = match.hashes[-1] if match.hashes else _ROOT_HASH
            for index in range(match.num_blocks, len(tokens) // bs):
                parent = block_hash(parent, tokens[index * bs : (index + 1) * bs])
                if self.pool.lookup(parent) is None and parent not in self._pending:
                    self._pending[parent] = cache.cache_id
                    cache.pending_hashes.append(parent)
        return cache

    def grow(self, cache: Cache, target_len: int) -> int:
        """Make positions [0, target_len) writable; return the number of new blocks."""
        needed = self.blocks_needed(cache, target_len)
        if needed:
            cache.block_ids.extend(self.pool.allocate(needed))
        return needed

    def unreserve(self, cache: Cache, num_blocks: int) -> int:
        """Give back blocks reserved past the first num_blocks (a step that did not commit).

        Only blocks beyond the committed tokens go: they are fresh, unshared and unhashed.
        """
        keep = max(num_blocks, self.blocks_for(cache.num_tokens))
        dropped = cache.block_ids[keep:]
        if not dropped:
            return 0
        del cache.block_ids[keep:]
        freed = self.pool.free(dropped)
        self.clock.bump({KV_BLOCKS} if freed else set())
        return freed

    def commit(self, cache: Cache, token_ids: list[int]) -> None:
        if self.blocks_for(cache.num_tokens + len(token_ids)) > len(cache.block_ids):
            raise RuntimeError("commit() past the reserved blocks")
        cache.token_ids.extend(token_ids)
        cache.touched_s = time.monotonic()
        first_chunk = cache.pending_admission
        cache.pending_admission = False
        if not self.prefix_caching:
            return
        bs = self.block_size
        parent = cache.block_hashes[-1] if cache.block_hashes else _ROOT_HASH
        published = False
        for index in range(len(cache.block_hashes), cache.num_tokens // bs):
            content = block_hash(parent, cache.token_ids[index * bs : (index + 1) * bs])
            cache.block_hashes.append(content)
            self.pool.register(cache.block_ids[index], content)
            if self._pending.get(content) == cache.cache_id:
                del self._pending[content]
                published = True
            parent = content
        # Others waited one step for this prefix: what the first chunk did not publish (a
        # shorter chunk, or other tokens than admitted) is not promised any longer.
        if first_chunk and self._drop_pending(cache):
            published = True
        if published:
            # Requests deferred behind this prefix wait on the KV source: wake them.
            self.clock.bump({KV_BLOCKS})

    def expire_pending(self, bound_s: float, now: float) -> list[Cache]:
        """Drop the prefix marks of admitted caches whose first chunk has not run within
        bound_s of admission, waking the requests deferred behind them; return those caches."""
        stale = [
            c
            for c in self.caches.values()
            if c.pending_hashes and c.pending_admission and now - c.opened_s >= bound_s
        ]
        for cache in stale:
            self._drop_pending(cache)
        if stale:
            self.clock.bump({KV_BLOCKS})
        return stale

    def truncate(self, cache: Cache, new_len: int) -> tuple[int, list[tuple[int, int]]]:
        """Drop tokens past new_len; return (blocks released, block copies to perform).

        Blocks past the admitted context are returned to the pool; the admission reservation
        stays. Every kept block from position new_len on will be overwritten, so it must be
        exclusively this cache's: a shared block is replaced by a fresh one (copied first
        when it still holds kept tokens: copy-on-write), an unshared one loses its hash.
        """
        bs = self.block_size
        keep = self.blocks_for(max(new_len, cache.context_tokens))
        rewritten = range(new_len // bs, min(keep, len(cache.block_ids)))
        shared = [i for i in rewritten if self.pool.ref_count(cache.block_ids[i]) > 1]
        if len(shared) > self.pool.num_available:
            raise CapacityExhausted("no free KV block to copy a shared block into")
        copies: list[tuple[int, int]] = []
        for index in rewritten:
            block = cache.block_ids[index]
            if index in shared:
                (fresh,) = self.pool.allocate(1)
                if index * bs < new_len:
                    copies.append((block, fresh))
                self.pool.free([block])
                cache.block_ids[index] = fresh
            elif self.pool.is_registered(block):
                self.pool.unregister(block)
        unmarked = self._drop_pending(cache)
        dropped = cache.block_ids[keep:]
        del cache.block_ids[keep:]
        del cache.token_ids[new_len:]
        del cache.block_hashes[new_len // bs :]
        released = self.pool.free(dropped)
        self.clock.bump({KV_BLOCKS} if released or unmarked else set())
        return released, copies

    def release(self, cache_id: str, *, reason: str = "released") -> ReleaseResult:
        """Release a cache; a repeat for a retired id is not an error (released = False).
        `reason` (released, expired, completed, preempted, cancelled, abandoned, failed,
        drained) is what a later lookup of the id reports."""
        cache = self.caches.pop(cache_id, None)
        if cache is None:
            if cache_id in self._retired:
                return ReleaseResult(released=False, blocks_freed=0)
            raise NotFound(f"cache {cache_id!r} is unknown")
        # Only whole, committed blocks keep their hash; the rest return to the free list.
        unmarked = self._drop_pending(cache)
        freed = self.pool.free(cache.block_ids)
        cache.block_ids.clear()
        self._retired[cache_id] = reason
        if len(self._retired) > _RETIRED_MEMORY:
            self._retired.popitem(last=False)
        sources: set[SourceKey] = {SEQUENCE_SLOTS}
        if freed or unmarked:
            # Requests deferred behind its prefix marks wait on the KV source too.
            sources.add(KV_BLOCKS)
        self.clock.bump(sources)
        _LOG.debug(
            "cache_released",
            request_id=cache.request_id,
            cache_id=cache_id,
            tokens=cache.num_tokens,
            blocks_freed=freed,
            reason=reason,
        )
        for listener in self.release_listeners:
            listener(cache, reason, freed)
        return ReleaseResult(released=True, blocks_freed=freed)

    def _drop_pending(self, cache: Cache) -> bool:
        """Forget the cache's prefix marks; True if any was still marked."""
        dropped = False
        for content in cache.pending_hashes:
            if self._pending.get(content) == cache.cache_id:
                del self._pending[content]
                dropped = True
        cache.pending_hashes.clear()
        return dropped

    # -- checks ----------------------------------------------------------------------------

    def check(self) -> None:
        """Raise if any invariant is broken (tests call this after every step)."""
        self.pool.check()
        holders: dict[int, int] = {}
        for cache in self.caches.values():
            if len(set(cache.block_ids)) != len(cache.block_ids):
                raise AssertionError(f"cache {cache.cache_id} holds a block twice")
            for block in cache.block_ids:
                holders[block] = holders.get(block, 0) + 1
            if self.blocks_for(cache.num_tokens) > len(cache.block_ids):
                raise AssertionError(f"cache {cache.cache_id} has tokens past its blocks")
            if len(cache.block_hashes) != (
                cache.num_tokens // self.block_size if self.prefix_caching else 0
            ):
                raise AssertionError(f"cache {cache.cache_id} has stale block hashes")
        for content, owner in self._pending.items():
            if owner not in self.caches or content not in self.caches[owner].pending_hashes:
                raise AssertionError("a pending prefix block has no live owner")
        for block in range(self.pool.num_blocks):
            if self.pool.ref_count(block) != holders.get(block, 0):
                raise AssertionError(
                    f"block {block}: ref count {self.pool.ref_count(block)}, "
                    f"{holders.get(block, 0)} holders"
                )
