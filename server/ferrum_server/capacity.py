"""The executor's answers to "does this fit?": the blocks a step reserves before its forward
(or the deferral evidence when they are not there), slot reservations, admission probes,
preemption and swap.

Runs on the engine thread (called through Engine). None of this launches device work except a
swap's copy; every answer is a fact about the pool: reserved or admitted (with what is held),
deferred (with the exact sources to wait on), or rejected (can never fit).
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from ferrum_server import logs
from ferrum_server.domain import (
    CapacityDeferral,
    DeferralMode,
    DeferralStage,
    ItemKind,
    RequestOrigin,
    Shortfall,
    ShortfallKind,
    Step,
    StepItem,
)
from ferrum_server.errors import AlreadyExists, InvalidArgument, NotFound
from ferrum_server.kv.epochs import KV_BLOCKS, SEQUENCE_SLOTS, Epochs, SourceKey
from ferrum_server.kv.manager import Cache, KvManager, Retirement
from ferrum_server.kv.storage import HostKv, KvStorage
from ferrum_server.recorder import Recorder
from ferrum_server.validate import Limits, check_instance, check_opener

_LOG = logs.get(__name__)


class PreemptionMode(enum.IntEnum):
    RECOMPUTE = 1
    SWAP = 2


@dataclass(frozen=True, slots=True)
class Demand:
    kv_blocks: int
    tokens: int
    sequences: int


@dataclass(frozen=True, slots=True)
class Admitted:
    request_id: str
    cache_id: str
    cached_prompt_tokens: int
    held_blocks: int
    epochs: Epochs


@dataclass(frozen=True, slots=True)
class Deferred:
    immediate: Demand
    fit: Demand
    shortfalls: list[Shortfall]
    epochs: Epochs
    observed: list[tuple[SourceKey, int]]
    # The largest first_chunk_tokens that would be admitted now (0 = none): a hint to re-probe.
    narrower_prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Rejected:
    immediate: Demand
    fit: Demand
    shortfalls: list[Shortfall]
    reason: str


Decision = Admitted | Deferred | Rejected

# The fewest input tokens an admission batch may carry in all, whatever the step and sequence
# limits: a burst of typical prompts fits one call (see admission_batch_tokens).
MIN_ADMISSION_BATCH_TOKENS = 65536


def admission_batch_tokens(max_batch_tokens: int, max_sequence_length: int) -> int:
    """Most input tokens one admission batch (TryAdmitPrefillBatch) may carry over all its
    probes. One prompt of the longest sequence always fits; so does the whole batch in the
    receive limit on messages (app.message_limits: its term for one prompt, or its 1 MiB
    base for 65,536 varint ids)."""
    return max(MIN_ADMISSION_BATCH_TOKENS, max_batch_tokens, max_sequence_length)


@dataclass(frozen=True, slots=True)
class AdmissionProbe:
    """One admission probe's input: a TryAdmitPrefill call, or a probe of a batch."""

    request_id: str
    tokens: list[int]  # the execution context: prompt, then any replayed outputs
    max_tokens: int  # bound on context plus outputs; 0 = the model maximum
    prompt_tokens: int
    replayed_tokens: int
    instance_id: int = 0
    first_chunk_tokens: int = 0  # 0 = claim the whole context's blocks now
    origin: RequestOrigin | None = None  # None: unspecified


@dataclass(frozen=True, slots=True)
class StepReservation:
    """What reserve_step decided: the items deferred, and the chunks narrowed to the prefix
    that fits (each replaces its planned item for the forward; the rest run as planned)."""

    deferrals: dict[int, CapacityDeferral]
    narrowed: dict[int, StepItem]


@dataclass(frozen=True, slots=True)
class ReleaseSource:
    request_id: str
    cache_id: str
    pending_admission: bool
    sources: list[tuple[SourceKey, int]]
    releasable_blocks: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class PreemptionReceipt:
    request_id: str
    cache_id: str
    pending_admission: bool
    blocks_freed: int
    mode: PreemptionMode
    epochs: Epochs


@dataclass(slots=True)
class SwappedKv:
    """A preempted sequence's committed KV, parked in host memory."""

    token_ids: list[int]
    host_kv: HostKv  # this rank's shard on the CPU; the other ranks keep theirs by its key
    # When it was swapped out (monotonic): swapped KV expires with the cache lease.
    swapped_s: float = field(default_factory=time.monotonic)

    @property
    def num_bytes(self) -> int:
        return self.host_kv.num_bytes


@dataclass(frozen=True, slots=True)
class SlotRequest:
    """Make a cache writable up to target_len (ReserveKvSlots); an empty cache_id opens one."""

    cache_id: str
    request_id: str
    target_len: int
    # A fit check only: must fit in the pool's free blocks, but is never allocated.
    admission_len: int = 0


@dataclass(frozen=True, slots=True)
class SlotReservation:
    block_size: int
    total_blocks: int
    free_blocks_before: int
    free_blocks_after: int
    allocations: list[tuple[str, int, int]]  # (cache id, blocks before, blocks after)


@dataclass(slots=True)
class CapacityStats:
    probes: int = 0
    admitted: int = 0
    deferred: int = 0
    rejected: int = 0
    preemptions: int = 0
    narrowed_chunks: int = 0
    swaps_out: int = 0
    swaps_in: int = 0
    prefix_lookups: int = 0  # admissions (each looked its prompt up)
    prefix_hit_lookups: int = 0  # admissions that found at least one block
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


class CapacityManager:
    def __init__(
        self,
        kv: KvManager,
        storage: KvStorage,
        limits: Limits,
        swap_space_bytes: int,
        recorder: Recorder,
        prefix_pending_s: float = 2.0,
    ) -> None:
        self.kv = kv
        self.storage = storage  # the pool tensor: block copies and swaps go through it
        self.limits = limits
        self.swap_space_bytes = swap_space_bytes
        # How long an admitted request's first chunk may keep others waiting on its prefix.
        self.prefix_pending_s = prefix_pending_s
        self.swapped: OrderedDict[str, SwappedKv] = OrderedDict()  # by request id
        self.stats = CapacityStats()
        self.metrics = recorder.metrics

    # -- steps ----------------------------------------------------------------------------

    def reserve_step(
        self, step: Step, caches: list[Cache | None], skip: Collection[int] = ()
    ) -> StepReservation:
        """Take the blocks every runnable item needs, opening caches for opening items (filled
        into `caches`); defer the others. Items in `skip` (refused) take nothing. A prefill
        chunk that allows narrowing and does not fit runs the longest prefix the blocks still
        hold (one failed probe, then that prefix), if that is at least one token. With
        ALL_OR_NOTHING, one item that is deferred defers every item and nothing is taken."""
        kv = self.kv
        free_blocks = kv.pool.num_available
        free_slots = kv.num_free_sequence_slots
        runnable: list[int] = []
        deferrals: dict[int, CapacityDeferral] = {}
        narrowed: dict[int, StepItem] = {}
        for index, (item, cache) in enumerate(zip(step.items, caches, strict=True)):
            if index in skip:
                continue
            needed = kv.blocks_needed(cache, item.end)
            opens = cache is None
            if opens and free_slots < 1:
                deferrals[index] = self._slots_deferral(index, item.request_id)
                continue
            if needed > free_blocks:
                fits = self._fitting_prefix(item, cache, free_blocks)
                if not fits:
                    stage = (
                        DeferralStage.STEP_ADMISSION if opens else DeferralStage.SEQUENCE_EXTENSION
                    )
                    deferrals[index] = self._blocks_deferral(
                        index, item.request_id, stage, needed, free_blocks, item, cache
                    )
                    continue
                item = narrowed[index] = item.with_tokens(item.token_ids[:fits])
                needed = kv.blocks_needed(cache, item.end)
            runnable.append(index)
            free_blocks -= needed
            free_slots -= int(opens)
        if deferrals and step.mode == DeferralMode.ALL_OR_NOTHING:
            first = deferrals[min(deferrals)]
            return StepReservation(dict.fromkeys(range(len(step.items)), first), {})
        for index in runnable:
            item = narrowed.get(index, step.items[index])
            cache = caches[index]
            if cache is None:
                max_tokens = item.max_sequence_tokens or self.limits.max_sequence_length
                cache = caches[index] = kv.open(item.request_id, max_tokens)
            kv.grow(cache, item.end)
        for index, item in narrowed.items():
            self.stats.narrowed_chunks += 1
            _LOG.debug(
                "chunk_narrowed",
                request_id=item.request_id,
                planned=len(step.items[index].token_ids),
                completed=len(item.token_ids),
            )
        return StepReservation(deferrals, narrowed)

    def _fitting_prefix(self, item: StepItem, cache: Cache | None, free_blocks: int) -> int:
        """Tokens of a narrowable prefill chunk that the cache's blocks plus free_blocks hold
        (always fewer than the chunk's); 0 when the item may not narrow or none fits."""
        if not item.allow_narrowing or item.kind != ItemKind.PREFILL_CHUNK:
            return 0
        held = len(cache.block_ids) if cache is not None else 0
        fits = (held + free_blocks) * self.kv.block_size - item.position
        return max(0, min(fits, len(item.token_ids) - 1))

    def reserve_slots(
        self, requests: list[SlotRequest], instance_id: int = 0
    ) -> SlotReservation | CapacityDeferral:
        """Make every request's cache writable up to its target, all or nothing."""
        check_instance(instance_id, self.limits)
        kv = self.kv
        caches = self._slot_caches(requests)
        free_before = kv.pool.num_available
        free, slots = free_before, kv.num_free_sequence_slots
        for index, (request, cache) in enumerate(zip(requests, caches, strict=True)):
            if cache is None and slots < 1:
                return self._slots_deferral(index, request.request_id)
            needed = kv.blocks_needed(cache, request.target_len)
            fit = max(
                needed, kv.blocks_needed(cache, max(request.admission_len, request.target_len))
            )
            if fit > free:
                return self._blocks_deferral(
                    index,
                    request.request_id,
                    DeferralStage.SEQUENCE_EXTENSION,
                    fit,
                    free,
                    None,
                    cache,
                )
            free -= needed
            slots -= int(cache is None)
        allocations: list[tuple[str, int, int]] = []
        for request, cache in zip(requests, caches, strict=True):
            if cache is None:
                cache = kv.open(request.request_id, self.limits.max_sequence_length)
            before = len(cache.block_ids)
            kv.grow(cache, request.target_len)
            allocations.append((cache.cache_id, before, len(cache.block_ids)))
        return SlotReservation(
            block_size=kv.block_size,
            total_blocks=kv.pool.num_blocks,
            free_blocks_before=free_before,
            free_blocks_after=kv.pool.num_available,
            allocations=allocations,
        )

    def _slot_caches(self, requests: list[SlotRequest]) -> list[Cache | None]:
        """Check every slot request against its cache; None for the ones that open a cache."""
        longest = self.limits.max_sequence_length
        seen: set[str] = set()
        openers: set[str] = set()
        caches: list[Cache | None] = []
        for index, request in enumerate(requests):
            if request.target_len == 0 or request.target_len > longest:
                raise InvalidArgument(
                    f"item {index}: target_len {request.target_len} outside [1, {longest}]"
                )
            if request.admission_len > longest:
                raise InvalidArgument(
                    f"item {index}: admission_target_len {request.admission_len} too long"
                )
            cache = None
            if request.cache_id:
                if request.cache_id in seen:
                    raise InvalidArgument(f"item {index}: cache {request.cache_id!r} appears twice")
                seen.add(request.cache_id)
                cache = self.kv.lookup(request.cache_id)
                if request.request_id and cache.request_id != request.request_id:
                    raise InvalidArgument(f"item {index}: cache belongs to another request")
                if request.target_len < cache.num_tokens:
                    raise InvalidArgument(f"item {index}: target_len below committed length")
            else:
                check_opener(index, request.request_id, openers)
                holder = self.kv.live_cache_of(request.request_id)
                if holder is not None:
                    raise AlreadyExists(
                        f"item {index}: request {request.request_id!r} already holds cache "
                        f"{holder.cache_id!r}; reserve slots on that cache instead"
                    )
            caches.append(cache)
        return caches

    def _slots_deferral(self, index: int, request_id: str) -> CapacityDeferral:
        """No sequence slot is free for a new cache."""
        return self._deferral(
            index,
            request_id,
            DeferralStage.STEP_ADMISSION,
            Shortfall.sequence_slots(self.kv.max_sequences),
            {SEQUENCE_SLOTS},
        )

    def blocks_deferral(
        self, request_id: str, stage: DeferralStage, requested: int, free_blocks: int
    ) -> CapacityDeferral:
        """Not enough KV blocks for a single-item request outside a step (warmup)."""
        return self._blocks_deferral(0, request_id, stage, requested, free_blocks, None, None)

    def _blocks_deferral(
        self,
        index: int,
        request_id: str,
        stage: DeferralStage,
        requested: int,
        free_blocks: int,
        chunk: StepItem | None,
        cache: Cache | None,
    ) -> CapacityDeferral:
        """Not enough KV blocks; for a prefill chunk, hint a narrower width that fits now."""
        shortfall = Shortfall.blocks(
            ShortfallKind.IMMEDIATE_AVAILABILITY,
            requested=requested,
            available=free_blocks,
            total=self.kv.pool.num_blocks,
        )
        narrower = 0
        if chunk is not None and chunk.kind == ItemKind.PREFILL_CHUNK:
            count = len(chunk.token_ids)
            held = len(cache.block_ids) if cache else 0
            fits = (held + free_blocks) * self.kv.block_size - chunk.position
            if count > 1 and fits >= 1:
                # Shrink by at least a quarter each time, like the contract's narrowing rule.
                narrower = min(fits, count - -(-count // 4))
        return self._deferral(index, request_id, stage, shortfall, {KV_BLOCKS}, narrower)

    def _deferral(
        self,
        index: int,
        request_id: str,
        stage: DeferralStage,
        shortfall: Shortfall,
        sources: set[SourceKey],
        narrower: int = 0,
    ) -> CapacityDeferral:
        return CapacityDeferral(
            item_index=index,
            request_id=request_id,
            stage=stage,
            shortfall=shortfall,
            epochs=self.kv.clock.snapshot(),
            observed=self.kv.clock.observed(sources),
            narrower_prefill_tokens=narrower,
        )

    # -- admission ------------------------------------------------------------------------

    def try_admit(
        self,
        request_id: str,
        tokens: list[int],
        max_tokens: int,
        prompt_tokens: int,
        replayed_tokens: int,
        instance_id: int = 0,
        first_chunk_tokens: int = 0,
    ) -> Decision:
        """Admit, defer or reject one request. The admission claims the KV blocks of the first
        `first_chunk_tokens` context tokens (0 = all of them) and the prefix-cache hit; a
        deferral for lack of blocks hints the largest first chunk that would fit now."""
        probe = AdmissionProbe(
            request_id,
            tokens,
            max_tokens,
            prompt_tokens,
            replayed_tokens,
            instance_id,
            first_chunk_tokens,
        )
        self._check_probe(probe)
        return self._decide(probe)

    def try_admit_batch(
        self, probes: Sequence[AdmissionProbe], instance_id: int = 0
    ) -> list[Decision]:
        """`try_admit` of each probe in order, until one is deferred: its decision is the last,
        and the probes after it are not decided. At most max_batch_size probes and
        `admission_batch_tokens` input tokens in all, each request id once. Every probe is
        checked before any is decided, so a batch refused for its input changes nothing."""
        check_instance(instance_id, self.limits)
        limits = self.limits
        if len(probes) > limits.max_batch_size:
            raise InvalidArgument(
                f"{len(probes)} admission probes exceed max_batch_size {limits.max_batch_size}"
            )
        total = sum(len(probe.tokens) for probe in probes)
        most = admission_batch_tokens(limits.max_batch_tokens, limits.max_sequence_length)
        if total > most:
            raise InvalidArgument(
                f"the admission probes carry {total} input tokens; a batch takes at most {most}"
            )
        seen: set[str] = set()
        for probe in probes:
            if probe.request_id in seen:
                raise InvalidArgument(f"request {probe.request_id!r} is probed twice in the batch")
            seen.add(probe.request_id)
            self._check_probe(probe)
        decisions: list[Decision] = []
        for probe in probes:
            decision = self._decide(probe)
            decisions.append(decision)
            if isinstance(decision, Deferred):
                break
        return decisions

    def _check_probe(self, probe: AdmissionProbe) -> None:
        """Everything that makes a probe bad input (INVALID_ARGUMENT, ALREADY_EXISTS) or stale
        (FAILED_PRECONDITION), checked before anything is decided."""
        check_instance(probe.instance_id, self.limits)
        tokens = probe.tokens
        self._validate(
            probe.request_id, tokens, probe.max_tokens, probe.prompt_tokens, probe.replayed_tokens
        )
        if probe.first_chunk_tokens > len(tokens):
            raise InvalidArgument(
                f"first_chunk_tokens {probe.first_chunk_tokens} exceeds the {len(tokens)} input "
                "tokens"
            )

    def _decide(self, probe: AdmissionProbe) -> Decision:
        """Admit, defer or reject a probe that passed `_check_probe`."""
        request_id, tokens = probe.request_id, probe.tokens
        max_tokens, first_chunk_tokens = probe.max_tokens, probe.first_chunk_tokens
        self.stats.probes += 1
        kv = self.kv
        model_max = self.limits.max_sequence_length
        bound = max_tokens or len(tokens)
        claim = first_chunk_tokens or len(tokens)
        immediate = Demand(kv_blocks=kv.blocks_for(claim), tokens=claim, sequences=1)
        fit = Demand(kv_blocks=kv.blocks_for(bound), tokens=bound, sequences=1)
        if len(tokens) > model_max or max_tokens > model_max:
            longest = max(len(tokens), max_tokens)
            return self._reject(
                immediate,
                fit,
                Shortfall.sequence_length(requested=longest, maximum=model_max),
                f"{longest} tokens exceed the maximum sequence length {model_max}",
            )
        if fit.kv_blocks > kv.pool.num_blocks:
            total = kv.pool.num_blocks
            return self._reject(
                immediate,
                fit,
                Shortfall.blocks(
                    ShortfallKind.PERMANENT_DOMAIN_MAXIMUM,
                    requested=fit.kv_blocks,
                    available=total,
                    total=total,
                ),
                f"{bound} tokens need {fit.kv_blocks} KV blocks; the pool has {total}",
            )
        if kv.num_free_sequence_slots < 1:
            return self._defer(
                immediate,
                fit,
                Shortfall.sequence_slots(kv.max_sequences),
                SEQUENCE_SLOTS,
                "sequence_slots",
            )
        swapped = self.swapped.get(request_id)
        if swapped is not None and tokens[: len(swapped.token_ids)] == swapped.token_ids:
            return self._swap_in(
                request_id, tokens, max_tokens or model_max, swapped, immediate, fit
            )
        self.expire_prefix_marks(time.monotonic())
        match = kv.match_prefix(tokens)
        if match.num_pending:
            return self._defer(
                immediate,
                fit,
                Shortfall.blocks(
                    ShortfallKind.PREFIX_PENDING,
                    requested=match.num_pending,
                    available=0,
                    total=kv.pool.num_blocks,
                ),
                KV_BLOCKS,
                "prefix_pending",
            )
        needed = max(immediate.kv_blocks, match.num_blocks) - match.num_blocks + match.num_cached
        available = kv.pool.num_available
        if needed > available:
            # Blocks left once the cached hits are taken, each holding block_size more tokens.
            spare = available - match.num_cached
            narrower = min((match.num_blocks + spare) * kv.block_size, claim - 1) if spare else 0
            return self._defer(
                immediate,
                fit,
                Shortfall.blocks(
                    ShortfallKind.FIT_AVAILABILITY,
                    requested=needed,
                    available=available,
                    total=kv.pool.num_blocks,
                ),
                KV_BLOCKS,
                "kv_blocks",
                narrower,
            )
        cache = kv.admit(request_id, tokens, max_tokens or model_max, match, claim)
        cached = match.num_blocks * kv.block_size
        self.stats.admitted += 1
        self.stats.prefix_lookups += 1
        self.stats.prefix_hit_lookups += int(cached > 0)
        self.stats.prefix_query_tokens += len(tokens)
        self.stats.prefix_hit_tokens += cached
        self.metrics.record_admission("admitted")
        self.metrics.record_prefix(len(tokens), cached)
        _LOG.info(
            "request_admitted",
            request_id=request_id,
            cache_id=cache.cache_id,
            cached_tokens=cached,
            blocks=len(cache.block_ids),
        )
        return self._admitted(cache, cached)

    def _validate(
        self,
        request_id: str,
        tokens: list[int],
        max_tokens: int,
        prompt_tokens: int,
        replayed_tokens: int,
    ) -> None:
        if not request_id:
            raise InvalidArgument("request_id is required")
        if not tokens:
            raise InvalidArgument("input_tokens is empty")
        bad = [t for t in tokens if t >= self.limits.vocab_size]
        if bad:
            raise InvalidArgument(
                f"token id {bad[0]} outside the vocabulary [0, {self.limits.vocab_size})"
            )
        if prompt_tokens == 0:
            raise InvalidArgument("product_prompt_tokens must be > 0")
        if prompt_tokens + replayed_tokens != len(tokens):
            raise InvalidArgument(
                f"product_prompt_tokens + replayed_output_tokens = "
                f"{prompt_tokens + replayed_tokens} but input_tokens has {len(tokens)} entries"
            )
        if max_tokens and max_tokens < len(tokens):
            raise InvalidArgument(
                f"maximum_sequence_tokens {max_tokens} is below the {len(tokens)} input tokens"
            )
        cache = self.kv.live_cache_of(request_id)
        if cache is not None:
            raise AlreadyExists(
                f"request {request_id!r} already holds cache {cache.cache_id!r}; release or "
                f"preempt it before admitting it again"
            )

    def _reject(
        self, immediate: Demand, fit: Demand, shortfall: Shortfall, reason: str
    ) -> Rejected:
        self.stats.rejected += 1
        self.metrics.record_admission("rejected")
        return Rejected(immediate=immediate, fit=fit, shortfalls=[shortfall], reason=reason)

    def _defer(
        self,
        immediate: Demand,
        fit: Demand,
        shortfall: Shortfall,
        source: SourceKey,
        reason: str,
        narrower: int = 0,
    ) -> Deferred:
        self.stats.deferred += 1
        self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + 1
        self.metrics.record_admission("deferred")
        clock = self.kv.clock
        return Deferred(
            immediate=immediate,
            fit=fit,
            shortfalls=[shortfall],
            epochs=clock.snapshot(),
            observed=clock.observed({source}),
            narrower_prefill_tokens=narrower,
        )

    def expire_prefix_marks(self, now: float) -> int:
        """Stop making requests wait (PREFIX_PENDING) on admitted requests whose first chunk
        has not run within prefix_pending_s; return how many owners lost their marks."""
        stale = self.kv.expire_pending(self.prefix_pending_s, now)
        for cache in stale:
            _LOG.info(
                "prefix_pending_expired",
                request_id=cache.request_id,
                cache_id=cache.cache_id,
                waited_s=round(now - cache.opened_s, 3),
            )
        return len(stale)

    def expire_swapped(self, lease_s: float, now: float) -> int:
        """Drop swapped-out KV not re-admitted within lease_s (its scheduler is likely gone)."""
        stale = [r for r, s in self.swapped.items() if now - s.swapped_s >= lease_s]
        self.storage.drop([self.swapped[r].host_kv for r in stale])
        for request_id in stale:
            del self.swapped[request_id]
            _LOG.info("swapped_kv_expired", request_id=request_id)
        return len(stale)

    def cancel_admission(self, request_id: str, instance_id: int = 0) -> bool:
        """Release an admitted request whose first chunk never ran."""
        check_instance(instance_id, self.limits)
        cache = self.kv.live_cache_of(request_id)
        if cache is None or not cache.pending_admission:
            return False
        self.kv.release(cache.cache_id, reason=Retirement.CANCELLED)
        return True

    # -- preemption -----------------------------------------------------------------------

    def release_sources(self, after: str = "", limit: int = 0) -> list[ReleaseSource]:
        """What releasing each live cache would free, ordered by cache id: the caches after
        the cache id `after`, at most `limit` of them (0 = all)."""
        kv = self.kv
        cache_ids = sorted(c for c in kv.caches if c > after)
        entries = []
        for cache_id in cache_ids[:limit] if limit else cache_ids:
            cache = kv.caches[cache_id]
            blocks = kv.releasable_blocks(cache)
            sources = {SEQUENCE_SLOTS} | ({KV_BLOCKS} if blocks else set())
            entries.append(
                ReleaseSource(
                    request_id=cache.request_id,
                    cache_id=cache.cache_id,
                    pending_admission=cache.pending_admission,
                    sources=kv.clock.observed(sources),
                    releasable_blocks=blocks,
                    num_tokens=cache.num_tokens,
                )
            )
        return entries

    def preempt(
        self, request_id: str, cache_id: str, mode: PreemptionMode, instance_id: int = 0
    ) -> PreemptionReceipt:
        check_instance(instance_id, self.limits)
        # The request id and the cache id together name one incarnation of one request: a
        # preemption without the request id, or naming another request's cache, retires
        # nothing (a stale or confused decision must not release someone else's KV).
        if not request_id:
            raise InvalidArgument("request_id is required")
        if not cache_id:
            raise InvalidArgument("cache_id is required")
        cache = self.kv.caches.get(cache_id)
        if cache is None:
            raise NotFound(f"cache {cache_id!r} is not live (released or unknown)")
        if cache.request_id != request_id:
            raise InvalidArgument(f"cache {cache_id!r} belongs to another request")
        used = mode
        if mode == PreemptionMode.SWAP and not self._swap_out(cache):
            used = PreemptionMode.RECOMPUTE
        pending = cache.pending_admission
        result = self.kv.release(cache_id, reason=Retirement.PREEMPTED)
        self.stats.preemptions += 1
        self.metrics.record_preemption(used.name.lower())
        _LOG.info(
            "cache_preempted",
            request_id=cache.request_id,
            cache_id=cache_id,
            mode=used.name.lower(),
            blocks_freed=result.blocks_freed,
        )
        return PreemptionReceipt(
            request_id=cache.request_id,
            cache_id=cache_id,
            pending_admission=pending,
            blocks_freed=result.blocks_freed,
            mode=used,
            epochs=self.kv.clock.snapshot(),
        )

    def _swap_out(self, cache: Cache) -> bool:
        """Copy the committed KV to host memory if the swap space allows; True on success."""
        if cache.num_tokens == 0 or not cache.request_id:
            return False
        blocks = cache.block_ids[: self.kv.blocks_for(cache.num_tokens)]
        needed = self.storage.block_bytes * len(blocks)
        evicted: list[HostKv] = []
        while self.swapped and self._swap_bytes() + needed > self.swap_space_bytes:
            evicted.append(self.swapped.popitem(last=False)[1].host_kv)
        self.storage.drop(evicted)
        if needed > self.swap_space_bytes:
            return False
        host = self.storage.swap_out(blocks)
        self.swapped[cache.request_id] = SwappedKv(token_ids=list(cache.token_ids), host_kv=host)
        self.stats.swaps_out += 1
        return True

    def _swap_bytes(self) -> int:
        return sum(s.num_bytes for s in self.swapped.values())

    def _swap_in(
        self,
        request_id: str,
        tokens: list[int],
        max_tokens: int,
        swapped: SwappedKv,
        immediate: Demand,
        fit: Demand,
    ) -> Decision:
        kv = self.kv
        if immediate.kv_blocks > kv.pool.num_available:
            return self._defer(
                immediate,
                fit,
                Shortfall.blocks(
                    ShortfallKind.FIT_AVAILABILITY,
                    requested=immediate.kv_blocks,
                    available=kv.pool.num_available,
                    total=kv.pool.num_blocks,
                ),
                KV_BLOCKS,
                "kv_blocks",
            )
        del self.swapped[request_id]
        cache = kv.open(request_id, max_tokens)
        cache.pending_admission = True
        kv.declare_context(cache, tokens)
        kv.grow(cache, len(tokens))
        # Keep at least one token to run, so the scheduler gets logits for the next position.
        restored = min(len(swapped.token_ids), len(tokens) - 1)
        self.storage.swap_in(swapped.host_kv, cache.block_ids)
        kv.commit(cache, tokens[:restored])
        cache.pending_admission = True
        self.stats.admitted += 1
        self.stats.swaps_in += 1
        self.metrics.record_admission("admitted")
        return self._admitted(cache, restored)

    def _admitted(self, cache: Cache, cached_prompt_tokens: int) -> Admitted:
        """The receipt of an admission that opened `cache` with that many tokens in place."""
        return Admitted(
            request_id=cache.request_id,
            cache_id=cache.cache_id,
            cached_prompt_tokens=cached_prompt_tokens,
            held_blocks=len(cache.block_ids),
            epochs=self.kv.clock.snapshot(),
        )
