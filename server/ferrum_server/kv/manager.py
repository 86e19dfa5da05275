"""Caches (one per request incarnation, named by `cache_id` on the wire) and their block tables
over one BlockPool, with prefix reuse.

Owned by the engine thread: no locks. Every method either only reads (`blocks_needed`,
`match_prefix`, `lookup`, ...) or mutates after the caller has checked capacity, so a refused
request changes nothing.
"""

from __future__ import annotations

import enum
import hashlib
import secrets
import struct
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ferrum_server import logs
from ferrum_server.errors import CapacityExhausted, InvalidArgument, NotFound
from ferrum_server.kv.block_pool import BlockPool
from ferrum_server.kv.epochs import KV_BLOCKS, SEQUENCE_SLOTS, EpochClock, SourceKey

_LOG = logs.get(__name__)
# Retired cache ids are remembered (with their request id and how they ended) so that a repeated
# release or completion is answered as a repeat, with a typed outcome, rather than NOT_FOUND.
# The memory holds at most RETIRED_MAX_IDS ids and RETIRED_MAX_BYTES accounted bytes (each entry
# counts its two ids plus RETIRED_ENTRY_OVERHEAD, the Python objects around them, measured by
# tests/unit/test_kv_authority.py); the oldest are forgotten first (documented in docs/capacity.md).
RETIRED_MAX_IDS = 65536
RETIRED_MAX_BYTES = 16 * 1024**2
RETIRED_ENTRY_OVERHEAD = 256
_ROOT_HASH = b"ferrum-prefix-root"
# The most blocks a new cache's run of free blocks is sought for (BlockPool.allocate's room):
# 2,048 tokens at the default 16-token block. Past it a cache grows into whatever blocks are
# free; a larger room would leave fewer runs to find in a fragmented pool for little more
# in-order reading.
_MAX_ROOM_BLOCKS = 128


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Content key of a full block: its tokens and (through `parent`) every token before it."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return digest.digest()


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained content hash of every full block of `tokens`, in order (block i's hash
    covers tokens [0, (i + 1) * block_size)); the keys prefix caching uses."""
    hashes: list[bytes] = []
    parent = _ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


def prefix_hash(hashes: Sequence[bytes], num_blocks: int) -> bytes:
    """The chained hash covering the first num_blocks full blocks (the root for none)."""
    return hashes[num_blocks - 1] if num_blocks else _ROOT_HASH


def context_digest(
    tokens: Sequence[int], block_size: int, hashes: Sequence[bytes] | None = None
) -> bytes:
    """One digest of a whole execution context: the block chain (`hashes` when already
    computed), closed by the partial tail block and the length, so two contexts share it only
    if they are the same tokens."""
    if hashes is None:
        hashes = chain_hashes(tokens, block_size)
    tail = tokens[len(hashes) * block_size :]
    return block_hash(prefix_hash(hashes, len(hashes)) + len(tokens).to_bytes(8, "little"), tail)


def completion_counts_agree(committed: int, input_tokens: int, output_tokens: int) -> bool:
    """Whether a completion's usage counts describe a sequence of `committed` KV tokens: every
    committed token is a prompt or output token, the whole prompt (>= 1 token) is committed,
    and at most the last output was never fed back."""
    total = input_tokens + output_tokens
    return 1 <= input_tokens <= committed <= total <= committed + 1


class Retirement(enum.StrEnum):
    """How a cache incarnation ended: what a later release, completion or lookup reports."""

    RELEASED = "released"  # ReleaseCache, a broken stream's release, a drain
    COMPLETED = "completed"  # CompleteCache
    CANCELLED = "cancelled"  # CancelPrefillAdmission
    PREEMPTED = "preempted"  # PreemptExecutionCapacity
    EXPIRED = "expired"  # the cache lease
    ABANDONED = "abandoned"  # its caller left before learning of it (an orphaned open)
    FAILED = "failed"  # the step that opened it failed
    DRAINED = "drained"  # the executor shut down


@dataclass(frozen=True, slots=True)
class Retired:
    request_id: str
    how: Retirement

    def accounted_bytes(self, cache_id: str) -> int:
        return len(cache_id.encode()) + len(self.request_id.encode()) + RETIRED_ENTRY_OVERHEAD


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
    # Token identity of the prompt being prefilled (declared by the admission, else by the
    # chunk that opened the cache or extended a complete prompt): its length; its digest
    # (context_digest) when a call carried the whole prompt; and, while an admitted prompt is
    # incomplete, its tokens (4 bytes each), so every chunk can be checked against them.
    prompt_total: int = 0
    prompt_digest: bytes = b""
    context: array[int] | None = None
    # Hashes of full context blocks this cache will compute that others may wait for.
    pending_hashes: list[bytes] = field(default_factory=list)
    # Monotonic times for time-to-first-token and inter-token metrics.
    opened_s: float = field(default_factory=time.monotonic)
    last_token_s: float = 0.0
    # When a call last named this cache (monotonic): the cache lease counts from here.
    touched_s: float = field(default_factory=time.monotonic)
    # The token the last item that ran on this cache selected, not yet in its KV: what a
    # continuation decode feeds (-1: none; any commit or truncation clears it, and the engine
    # sets it after a commit that selected a token).
    selected_token: int = -1
    # While the step that selected it is launched but not finished (Engine.launch): the token
    # on the device (a device_tokens.DeviceToken; selected_token is -1 meanwhile), which a
    # continuation decode launched then reads there. Cleared with selected_token.
    selected_on_device: object | None = None
    # A committed token not yet known on the host (a continuation decode launched before the
    # step that selected its input finished): its position, else -1. Its block is hashed when
    # `resolve` fills it in.
    unresolved_position: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_in_progress(self) -> bool:
        """Whether the declared prompt is not fully committed yet (its chunks must match it)."""
        return self.num_tokens < self.prompt_total


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    released: bool
    blocks_freed: int
    # How the incarnation had ended already (a repeat); None when this call released it.
    previously: Retirement | None = None


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
        # Request id -> its live cache id: a request holds at most one live cache (the one KV
        # authority per request), enforced where caches open. Empty request ids are not indexed.
        self.by_request: dict[str, str] = {}
        # Retired cache id -> whose it was and how it ended (bounded: see RETIRED_MAX_*).
        self._retired: OrderedDict[str, Retired] = OrderedDict()
        self._retired_bytes = 0
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
            retired = self._retired.get(cache_id)
            if retired is None:
                raise NotFound(f"cache {cache_id!r} is unknown")
            if retired.how == Retirement.EXPIRED:
                raise NotFound(
                    f"cache {cache_id!r} expired: no call named it for longer than the cache "
                    "lease (see RenewCacheLease)"
                )
            raise NotFound(f"cache {cache_id!r} is {retired.how} (released)")
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

    def live_cache_of(self, request_id: str) -> Cache | None:
        """The live cache of a request id, if it holds one."""
        cache_id = self.by_request.get(request_id) if request_id else None
        return self.caches[cache_id] if cache_id is not None else None

    def retired(self, cache_id: str) -> Retired | None:
        """How a retired cache ended, while it is remembered."""
        return self._retired.get(cache_id)

    @property
    def retired_memory(self) -> tuple[int, int]:
        """(ids remembered, accounted bytes) of the retired-id memory."""
        return len(self._retired), self._retired_bytes

    def releasable_blocks(self, cache: Cache) -> int:
        """Blocks that would leave the used state if `cache` were released now."""
        return sum(1 for b in cache.block_ids if self.pool.ref_count(b) == 1)

    # -- mutations (capacity already checked by the caller) -------------------------------

    def open(self, request_id: str, max_tokens: int) -> Cache:
        if len(self.caches) >= self.max_sequences:
            raise RuntimeError("open() past the sequence ceiling")
        if request_id in self.by_request:
            raise RuntimeError("open() for a request that holds a live cache")
        cache_id = secrets.token_hex(12)
        cache = Cache(cache_id=cache_id, request_id=request_id, max_tokens=max_tokens)
        self.caches[cache_id] = cache
        if request_id:
            self.by_request[request_id] = cache_id
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
        self.declare_context(cache, tokens)
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

    def declare_context(self, cache: Cache, tokens: Sequence[int]) -> None:
        """Record an admitted execution context: its chunks must carry exactly these tokens."""
        cache.context_tokens = cache.prompt_total = len(tokens)
        cache.prompt_digest = context_digest(tokens, self.block_size)
        cache.context = array("I", tokens)

    def declare_prompt(self, cache: Cache, total: int, digest: bytes) -> None:
        """A chunk that opens a cache, or extends one whose prompt is complete, declares the
        prompt its later chunks must carry (its length, and its digest when it had it)."""
        if not cache.prompt_in_progress:
            cache.prompt_total, cache.prompt_digest, cache.context = total, digest, None

    def grow(self, cache: Cache, target_len: int) -> int:
        """Make positions [0, target_len) writable; return the number of new blocks."""
        needed = self.blocks_needed(cache, target_len)
        if needed:
            # Where the blocks go (see block_pool): after the cache's last block, else at a run
            # with room for what the cache may still grow to (its declared maximum, capped).
            held = len(cache.block_ids)
            room = min(self.blocks_for(cache.max_tokens) - held, _MAX_ROOM_BLOCKS)
            after = cache.block_ids[-1] if held else None
            cache.block_ids.extend(self.pool.allocate(needed, after, max(room, needed)))
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

    def commit(
        self,
        cache: Cache,
        token_ids: list[int],
        now: float | None = None,
        *,
        unresolved: bool = False,
    ) -> None:
        """Append committed tokens (their KV is written); `now` (monotonic) is when, passed by
        a caller committing many caches at once. With `unresolved`, the one token is a
        placeholder for a token still on the device: `resolve` fills it in later, and its
        block is not hashed until then."""
        if self.blocks_for(cache.num_tokens + len(token_ids)) > len(cache.block_ids):
            raise RuntimeError("commit() past the reserved blocks")
        if cache.unresolved_position >= 0:
            raise RuntimeError("commit() after an unresolved token (resolve it first)")
        cache.token_ids.extend(token_ids)
        cache.selected_token = -1  # the engine sets it again when this item selected one
        cache.selected_on_device = None
        if unresolved:
            if len(token_ids) != 1:
                raise RuntimeError("only a single-token commit may be unresolved")
            cache.unresolved_position = cache.num_tokens - 1
        cache.touched_s = time.monotonic() if now is None else now
        first_chunk = cache.pending_admission
        cache.pending_admission = False
        if not cache.prompt_in_progress:
            cache.context = None  # the admitted tokens were all committed: nothing to check
        self._hash_full_blocks(cache, first_chunk)

    def resolve(self, cache: Cache, position: int, token: int) -> None:
        """Fill in the unresolved token at `position` (see `commit`) and hash its block if full."""
        if cache.unresolved_position != position:
            raise RuntimeError(f"no unresolved token at position {position}")
        cache.token_ids[position] = token
        cache.unresolved_position = -1
        self._hash_full_blocks(cache, first_chunk=False)

    def _hash_full_blocks(self, cache: Cache, first_chunk: bool) -> None:
        """Hash the full committed blocks not hashed yet (up to an unresolved token), and
        publish them under prefix caching."""
        # Committed blocks are hashed even without prefix caching: the hashes are the cache's
        # token identity (a later prefill chunk's prompt is compared with them).
        bs = self.block_size
        full_blocks = self._hashable_blocks(cache)
        if len(cache.block_hashes) == full_blocks and not first_chunk:
            return  # no block filled up, and nothing promised to publish (most decodes)
        parent = cache.block_hashes[-1] if cache.block_hashes else _ROOT_HASH
        published = False
        for index in range(len(cache.block_hashes), full_blocks):
            content = block_hash(parent, cache.token_ids[index * bs : (index + 1) * bs])
            cache.block_hashes.append(content)
            parent = content
            if not self.prefix_caching:
                continue
            self.pool.register(cache.block_ids[index], content)
            if self._pending.get(content) == cache.cache_id:
                del self._pending[content]
                published = True
        if not self.prefix_caching:
            return
        # Others waited one step for this prefix: what the first chunk did not publish (a
        # shorter chunk, or other tokens than admitted) is not promised any longer.
        if first_chunk and self._drop_pending(cache):
            published = True
        if published:
            # Requests deferred behind this prefix wait on the KV source: wake them.
            self.clock.bump({KV_BLOCKS})

    def _hashable_blocks(self, cache: Cache) -> int:
        """Full committed blocks before any unresolved token: the ones hashed."""
        full_blocks = cache.num_tokens // self.block_size
        if cache.unresolved_position >= 0:
            return min(full_blocks, cache.unresolved_position // self.block_size)
        return full_blocks

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
        if new_len < cache.prompt_total:
            # An explicit rollback into the prompt by the cache's owner: the next chunk
            # declares the prompt anew.
            cache.prompt_total, cache.prompt_digest, cache.context = 0, b"", None
        dropped = cache.block_ids[keep:]
        del cache.block_ids[keep:]
        del cache.token_ids[new_len:]
        del cache.block_hashes[new_len // bs :]
        cache.selected_token = -1  # whatever was selected followed tokens that may be gone
        cache.selected_on_device = None
        if cache.unresolved_position >= new_len:
            cache.unresolved_position = -1  # truncated away
        released = self.pool.free(dropped)
        self.clock.bump({KV_BLOCKS} if released or unmarked else set())
        return released, copies

    def complete(
        self, request_id: str, cache_id: str, input_tokens: int, output_tokens: int
    ) -> ReleaseResult:
        """Record a successful completion: release the live cache if the request and the token
        counts agree with it (else INVALID_ARGUMENT, nothing changes); for a retired cache of
        the same request, answer how it ended (a repeat is not an error)."""
        if not request_id:
            raise InvalidArgument("request_id is required")
        if not cache_id:
            raise InvalidArgument("cache_id is required")
        cache = self.caches.get(cache_id)
        owner = cache.request_id if cache is not None else None
        if cache is None:
            retired = self._retired.get(cache_id)
            if retired is None:
                raise NotFound(f"cache {cache_id!r} is unknown")
            owner = retired.request_id
        if owner != request_id:
            raise InvalidArgument(f"cache {cache_id!r} belongs to another request")
        if cache is not None:
            committed = cache.num_tokens
            if not completion_counts_agree(committed, input_tokens, output_tokens):
                raise InvalidArgument(
                    f"input_tokens {input_tokens} + output_tokens {output_tokens} do not match "
                    f"the cache's {committed} committed tokens (need 1 <= input <= committed <= "
                    "input + output <= committed + 1)"
                )
        return self.release(cache_id, reason=Retirement.COMPLETED)

    def release(self, cache_id: str, *, reason: str = Retirement.RELEASED) -> ReleaseResult:
        """Release a cache; a repeat for a retired id is not an error (released = False, and
        `previously` says how it ended). `reason` (a Retirement) is what later calls report."""
        cache = self.caches.pop(cache_id, None)
        if cache is None:
            retired = self._retired.get(cache_id)
            if retired is not None:
                return ReleaseResult(released=False, blocks_freed=0, previously=retired.how)
            raise NotFound(f"cache {cache_id!r} is unknown")
        if self.by_request.get(cache.request_id) == cache_id:
            del self.by_request[cache.request_id]
        # Only whole, committed blocks keep their hash; the rest return to the free list.
        unmarked = self._drop_pending(cache)
        freed = self.pool.free(cache.block_ids)
        cache.block_ids.clear()
        self._remember(cache_id, Retired(cache.request_id, Retirement(reason)))
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

    def _remember(self, cache_id: str, retired: Retired) -> None:
        """Remember a retired id, forgetting the oldest past RETIRED_MAX_IDS ids or
        RETIRED_MAX_BYTES accounted bytes."""
        self._retired[cache_id] = retired
        self._retired_bytes += retired.accounted_bytes(cache_id)
        while len(self._retired) > RETIRED_MAX_IDS or self._retired_bytes > RETIRED_MAX_BYTES:
            oldest, entry = self._retired.popitem(last=False)
            self._retired_bytes -= entry.accounted_bytes(oldest)

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
            if len(cache.block_hashes) != self._hashable_blocks(cache):
                raise AssertionError(f"cache {cache.cache_id} has stale block hashes")
            if not -1 <= cache.unresolved_position < cache.num_tokens:
                raise AssertionError(f"cache {cache.cache_id} has an unresolved token past its end")
            if cache.request_id and self.by_request.get(cache.request_id) != cache.cache_id:
                raise AssertionError(f"request {cache.request_id} holds an unindexed cache")
        if len(self.by_request) != sum(1 for c in self.caches.values() if c.request_id):
            raise AssertionError("the request index names caches that are not live")
        for content, owner in self._pending.items():
            if owner not in self.caches or content not in self.caches[owner].pending_hashes:
                raise AssertionError("a pending prefix block has no live owner")
        for block in range(self.pool.num_blocks):
            if self.pool.ref_count(block) != holders.get(block, 0):
                raise AssertionError(
                    f"block {block}: ref count {self.pool.ref_count(block)}, "
                    f"{holders.get(block, 0)} holders"
                )
