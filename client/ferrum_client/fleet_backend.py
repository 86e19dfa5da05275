"""The scheduler's ``Backend`` over an ``ExecutorFleet``: placement, per-executor steps, failover.

The reference scheduler runs one lane per executor (``Admission.lane``): each plans its own
steps from the requests placed there, with its own budget and pipeline, so executors never wait
for each other and the fleet's batch capacity is the sum of theirs. This backend routes every
call by the request's placement (one step stream per executor incarnation).

Placement (``admit``): among SERVING members, the one that holds the longest prefix of the
context's full blocks (the executor's own chained block hashes, ``ferrum_client.prefix``, over
the prompts this client placed there this incarnation), then the least loaded (requests placed,
then KV in use from its capacity stream); each is asked ``TryAdmitPrefill`` in that order and the
first that admits gets the request. A member that defers it because another request is computing
the same prefix there (PREFIX_PENDING) keeps it: the request waits on that member's condition
instead of computing the prefix again elsewhere. Deferred everywhere: the request waits on any
change in the fleet (a capacity event from any member's ``WatchCapacity`` stream, a member
joining or leaving), never a timer.

Drain: a member whose health says NOT_SERVING, or that answers an admission with reason
DRAINING (it may say so before its health does), gets no new request; its running requests
keep stepping there and finish (the executor runs the requests it holds until they end).

Failover: a call that fails the way a lost executor fails (UNAVAILABLE, a restarted instance,
an ended stream, an internal fault) marks the member lost (``ExecutorFleet.report_failure``).
Every request placed on that incarnation is reported lost: in a step's answer (``StepResult.lost``)
or, for requests not in a step, through ``take_lost``; the scheduler re-admits it elsewhere with
its outputs replayed (recompute), so no token is lost or repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

import grpc

from ferrum_client.errors import ExecutorDrainingError, ExecutorError
from ferrum_client.fleet import ExecutorFleet, ExecutorState, Member
from ferrum_client.handles import StepStream
from ferrum_client.pb import executor_pb2 as pb
from ferrum_client.prefix import chain_hashes
from ferrum_client.scheduler import (
    Admission,
    ContractViolation,
    GenerationParams,
    GenerationResult,
    ItemKind,
    ItemStatus,
    Maintenance,
    PlannedItem,
    Receipt,
    ReleaseSource,
    Scheduler,
    SchedulerConfig,
    SourceKey,
    StepLimits,
    StepResult,
    StepTiming,
    admission_request,
    decode_results,
    encode_items,
)

# Codes that mean the executor (this incarnation) is gone for us: unreachable or draining,
# restarted (stale instance id), our stream ended, or it faulted and refuses work.
LOSS_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
    }
)
# How long `open` waits for a first SERVING executor, then for the others' first connection.
OPEN_TIMEOUT_S = 60.0
JOIN_GRACE_S = 5.0
# Bound on giving an admission back to a member deemed lost (_give_back): one that is really gone
# but does not refuse (a dropped link) must not hold up the next admission for the call's full
# timeout.
GIVE_BACK_TIMEOUT_S = 5.0


@dataclass(slots=True)
class _Placed:
    member: Member
    incarnation: int
    request_id: str


@dataclass(frozen=True, slots=True)
class _FleetWait:
    """Deferred on every member: wait for any change after this fleet generation."""

    generation: int


@dataclass(frozen=True, slots=True)
class _MemberWait:
    """An item deferred on one member: its own wait condition there."""

    member: Member
    incarnation: int
    condition: pb.CapacityWaitCondition


class FleetBackend:
    """``Backend`` over every SERVING member of an ``ExecutorFleet``."""

    def __init__(self, fleet: ExecutorFleet, *, own_fleet: bool = False) -> None:
        # With own_fleet, open() starts the fleet and close() closes it (a one-shot run).
        self.fleet = fleet
        self._own_fleet = own_fleet
        self._by_request: dict[str, _Placed] = {}
        self._by_cache: dict[str, _Placed] = {}
        self._streams: dict[str, tuple[int, StepStream]] = {}
        self._serials: dict[str, int] = {}
        self._lost: set[str] = set()
        self.failovers = 0
        fleet.on_lost.append(self._on_lost)

    # -- lifecycle --------------------------------------------------------------------------

    async def open(self) -> StepLimits:
        if self._own_fleet:
            await self.fleet.start()
        await self.fleet.wait_serving(OPEN_TIMEOUT_S)
        # Let the members still connecting join first, so the first requests spread over them.
        await self.fleet.wait_settled(JOIN_GRACE_S)
        limits = [m.capabilities for m in self.fleet.serving() if m.capabilities is not None]
        tokens = [c.admission_limits.maximum_scheduled_tokens for c in limits]
        items = [c.max_batch_size for c in limits]
        leases = [c.cache_lease_ms for c in limits if c.cache_lease_ms]
        # A step may land whole on any one member: the smallest member's limits bound it.
        # Continuation decodes are routed like any item; whether a lane may send them is its
        # member's own answer (continues_decodes), so a member joining later counts too.
        return StepLimits(
            min(tokens) if all(tokens) else 0,
            min(items) if all(items) else 0,
            min(leases) / 1000 if leases else 0.0,
            decode_continuation=True,
        )

    async def close(self) -> None:
        streams, self._streams = self._streams, {}
        for _, stream in streams.values():
            with contextlib.suppress(ExecutorError):
                await stream.__aexit__(None, None, None)
        with contextlib.suppress(ValueError):
            self.fleet.on_lost.remove(self._on_lost)
        if self._own_fleet:
            await self.fleet.close()

    # -- loss -------------------------------------------------------------------------------

    def _on_lost(self, member: Member, incarnation: int) -> None:
        entry = self._streams.pop(member.address, None)
        if entry is not None:
            entry[1].cancel()
        for cache_id, placed in list(self._by_cache.items()):
            if placed.member is member and placed.incarnation == incarnation:
                self._lost.add(cache_id)

    def width(self) -> int:
        """SERVING members: the scheduler runs up to its running cap on each."""
        return len(self.fleet.serving())

    def continues_decodes(self, lane: str) -> bool:
        """Whether the member incarnation behind `lane` (as ``admit`` names it) said it takes
        continuation decodes. A lane whose incarnation is gone answers no: its items are lost
        anyway."""
        address, _, incarnation = lane.rpartition("#")
        try:
            member = self.fleet.get(address)
        except KeyError:  # removed from the fleet
            return False
        return (
            str(member.incarnation) == incarnation
            and member.capabilities is not None
            and member.capabilities.supports_decode_continuation
        )

    def take_lost(self) -> set[str]:
        """Cache ids whose executor was lost since the last call (their requests must be
        re-admitted elsewhere, outputs replayed)."""
        lost, self._lost = self._lost, set()
        for cache_id in lost:
            self._forget(cache_id, failed_over=True)
        return lost

    def _alive(self, placed: _Placed) -> bool:
        member = placed.member
        return (
            member.incarnation == placed.incarnation
            and member.state is not ExecutorState.LOST
            and not member.removed
        )

    def _failed(self, placed: _Placed | Member, incarnation: int, error: BaseException) -> bool:
        """Whether `error` means the member is lost (then it is reported to the fleet)."""
        if not isinstance(error, ExecutorError) or error.code not in LOSS_CODES:
            return False
        member = placed.member if isinstance(placed, _Placed) else placed
        self.fleet.report_failure(member, incarnation, error)
        return True

    def _forget(self, cache_id: str, failed_over: bool = False) -> None:
        placed = self._by_cache.pop(cache_id, None)
        if placed is None:
            return
        if self._by_request.get(placed.request_id) is placed:
            del self._by_request[placed.request_id]
        if placed.member.incarnation == placed.incarnation:
            placed.member.running = max(0, placed.member.running - 1)
        if failed_over:
            placed.member.counters.failed_over += 1
            self.failovers += 1

    def executor_of(self, cache_id: str) -> str:
        placed = self._by_cache.get(cache_id)
        return placed.member.address if placed is not None else ""

    # -- admission --------------------------------------------------------------------------

    def _ranked(self, tokens: Sequence[int]) -> list[Member]:
        hashes: dict[int, list[bytes]] = {}
        ranked: list[tuple[int, int, float, Member]] = []
        for member in self.fleet.serving():
            size = member.block_size
            if size and size not in hashes:
                hashes[size] = chain_hashes(tokens, size)
            cached = member.cached_prefix_blocks(hashes[size]) * size if size else 0
            ranked.append((-cached, member.running, member.used_fraction, member))
        ranked.sort(key=lambda entry: entry[:3])
        return [entry[3] for entry in ranked]

    async def admit(
        self,
        request_id: str,
        tokens: Sequence[int],
        maximum_tokens: int,
        prompt_tokens: int,
        first_chunk_tokens: int = 0,
    ) -> Admission:
        since = self.fleet.generation  # a change during the probes must wake the wait
        narrower = 0
        deferred_somewhere = False
        rejected: Admission | None = None
        for member in self._ranked(tokens):
            incarnation = member.incarnation
            kind: str | None = None
            try:
                decision = await member.client.try_admit_prefill(
                    admission_request(
                        request_id,
                        tokens,
                        maximum_tokens,
                        prompt_tokens,
                        first_chunk_tokens,
                        member.instance_id,
                    )
                )
                kind = decision.WhichOneof("decision")
                if kind == "admitted":
                    await self._stream(member)
            except ExecutorDrainingError:
                # It began draining before its health said so: no new request there, but its
                # running requests stay and finish where they are.
                self.fleet.report_draining(member, incarnation)
                continue
            except ExecutorError as error:
                if self._failed(member, incarnation, error):
                    if kind == "admitted":  # admitted, then its stream failed to open
                        await self._give_back(member, request_id)
                    continue
                raise
            if kind == "admitted":
                cache_id = decision.admitted.cache_id
                if member.incarnation != incarnation or member.state is ExecutorState.LOST:
                    # Lost (a step there failed) while the admission or its stream was on the
                    # way: the request goes elsewhere, and this admission is given back.
                    await self._give_back(member, request_id)
                    continue
                placed = _Placed(member, incarnation, request_id)
                self._by_request[request_id] = self._by_cache[cache_id] = placed
                member.running += 1
                member.counters.admitted += 1
                if member.block_size:
                    member.remember_prefix(chain_hashes(tokens, member.block_size))
                return Admission(
                    "admitted",
                    cache_id,
                    decision.admitted.cached_prompt_tokens,
                    lane=f"{member.address}#{incarnation}",
                )
            if kind == "rejected":
                rejected = Admission("rejected", reason=decision.rejected.reason)
            elif kind == "maintenance_deferred":
                # Maintenance is bound to this member: route the follow-up calls there.
                self._by_request[request_id] = _Placed(member, incarnation, request_id)
                return Admission(
                    "maintenance",
                    wait=_MemberWait(
                        member, incarnation, decision.maintenance_deferred.wait_condition
                    ),
                )
            elif kind == "deferred":
                deferred = decision.deferred
                if any(b.kind == pb.SHORTFALL_KIND_PREFIX_PENDING for b in deferred.blockers):
                    # Another request is computing this prompt's prefix here: wait for it
                    # rather than compute the prefix again elsewhere (the executor bounds
                    # that wait by its prefix_pending_s).
                    return Admission(
                        "deferred", wait=_MemberWait(member, incarnation, deferred.wait_condition)
                    )
                narrower = max(narrower, deferred.narrower_prefill_tokens)
                deferred_somewhere = True
            else:
                raise ContractViolation(f"TryAdmitPrefill answered no decision for {request_id!r}")
        if rejected is not None and not deferred_somewhere:
            return rejected  # no serving member could ever take it
        return Admission("deferred", wait=_FleetWait(since), narrower_prefill_tokens=narrower)

    async def _stream(self, member: Member) -> StepStream:
        entry = self._streams.get(member.address)
        if entry is not None and entry[0] == member.incarnation:
            return entry[1]
        incarnation = member.incarnation
        stream = member.client.step_stream()
        await stream.__aenter__()
        if member.incarnation != incarnation or member.state is ExecutorState.LOST:
            stream.cancel()
        else:
            self._streams[member.address] = (incarnation, stream)
        return stream

    async def maintain(self, request_id: str) -> Maintenance:
        placed = self._by_request[request_id]
        response = await placed.member.client.maintain_prefill_backing(
            pb.MaintainPrefillBackingRequest(request_id=request_id)
        )
        if response.WhichOneof("outcome") == "wait_for_release":
            condition = response.wait_for_release.wait_condition
            return Maintenance("wait", _MemberWait(placed.member, placed.incarnation, condition))
        return Maintenance("retry")

    async def _give_back(self, member: Member, request_id: str) -> None:
        """Cancel an admission this client will not use, on a member it has just deemed lost.
        That member may well be alive (one call answered UNAVAILABLE, or its stream broke),
        and its admitted cache would hold its blocks until the cache lease expires (300 s by
        default). A member that is really gone cannot answer: nothing is held there then."""
        with contextlib.suppress(ExecutorError, TimeoutError):
            async with asyncio.timeout(GIVE_BACK_TIMEOUT_S):
                await member.client.cancel_prefill_admission(
                    pb.CancelPrefillAdmissionRequest(request_id=request_id)
                )

    async def cancel_admission(self, request_id: str) -> None:
        placed = self._by_request.pop(request_id, None)
        if placed is not None and self._alive(placed):
            await placed.member.client.cancel_prefill_admission(
                pb.CancelPrefillAdmissionRequest(request_id=request_id)
            )

    async def wait_for_capacity(self, wait: object, timeout_ms: int) -> bool:
        if isinstance(wait, _FleetWait):
            return await self.fleet.wait_for_change(wait.generation, timeout_ms / 1000)
        assert isinstance(wait, _MemberWait)
        member = wait.member
        if member.incarnation != wait.incarnation or member.state is ExecutorState.LOST:
            return True  # its executor is gone: the loss is handled elsewhere
        try:
            response = await member.client.wait_for_capacity_change(
                pb.WaitForCapacityChangeRequest(condition=wait.condition, timeout_ms=timeout_ms)
            )
        except ExecutorError as error:
            if self._failed(member, wait.incarnation, error):
                return True
            raise
        return bool(response.changed)

    # -- steps ------------------------------------------------------------------------------

    def submit(self, items: Sequence[PlannedItem]) -> Awaitable[StepResult]:
        groups: dict[str, tuple[_Placed, list[int]]] = {}
        lost: list[int] = []
        for k, item in enumerate(items):
            placed = self._by_cache.get(item.cache_id)
            if placed is None or not self._alive(placed):
                lost.append(k)
                continue
            groups.setdefault(placed.member.address, (placed, []))[1].append(k)
        parts: list[tuple[_Placed, list[int], asyncio.Future[pb.UnifiedBatchResponse]]] = []
        for placed, indices in groups.values():
            entry = self._streams.get(placed.member.address)
            try:
                if entry is None or entry[0] != placed.incarnation:
                    raise ExecutorError("no step stream here", grpc.StatusCode.CANCELLED)
                future = entry[1].submit(
                    pb.UnifiedBatchRequest(
                        items=encode_items([items[k] for k in indices]),
                        executor_instance_id=placed.member.instance_id,
                    )
                )
            except ExecutorError as error:
                if not self._failed(placed, placed.incarnation, error):
                    raise
                lost.extend(indices)
                continue
            placed.member.counters.steps += 1
            placed.member.counters.prefill_tokens += sum(
                len(items[k].tokens) for k in indices if items[k].kind == ItemKind.PREFILL_CHUNK
            )
            parts.append((placed, indices, future))
        return self._merge([item.cache_id for item in items], parts, lost)

    async def _merge(
        self,
        cache_ids: list[str],
        parts: list[tuple[_Placed, list[int], asyncio.Future[pb.UnifiedBatchResponse]]],
        lost: list[int],
    ) -> StepResult:
        answers = await asyncio.gather(*(p[2] for p in parts), return_exceptions=True)
        size = len(cache_ids)
        statuses = [int(ItemStatus.DEFERRED)] * size
        committed = [0] * size
        token_ids = [0] * size
        executors = [""] * size
        errors: dict[int, str] = {}
        blocked: dict[int, frozenset[SourceKey]] = {}
        waits: dict[int, object] = {}
        timing = StepTiming()
        lost_set = set(lost)
        for (placed, indices, _), answer in zip(parts, answers, strict=True):
            if isinstance(answer, BaseException):
                if not self._failed(placed, placed.incarnation, answer):
                    raise answer
                lost_set.update(indices)
                continue
            part = decode_results(answer)
            member = placed.member
            serial = self._serial(member)
            for j, k in enumerate(indices):
                statuses[k] = part.statuses[j]
                committed[k] = part.committed_tokens[j]
                token_ids[k] = part.token_ids[j]
                executors[k] = member.address
                if j in part.errors:
                    errors[k] = part.errors[j]
                if j in part.blocked_sources:
                    sources = part.blocked_sources[j]
                    blocked[k] = frozenset((s, _scoped(serial, d)) for s, d in sources)
                if j in part.waits:
                    condition = part.waits[j]
                    assert isinstance(condition, pb.CapacityWaitCondition)
                    waits[k] = _MemberWait(member, placed.incarnation, condition)
            member.counters.tokens += sum(1 for s in part.statuses if s == ItemStatus.TOKEN)
            t = part.timing
            # The parts ran concurrently: the step took as long as its longest part.
            timing = StepTiming(
                max(timing.queue_ns, t.queue_ns),
                max(timing.forward_ns, t.forward_ns),
                max(timing.sample_ns, t.sample_ns),
                max(timing.total_ns, t.total_ns),
                max(timing.collective_ns, t.collective_ns),
            )
        for k in lost_set:
            self._forget(cache_ids[k], failed_over=True)
        return StepResult(
            statuses,
            committed,
            token_ids,
            timing,
            errors,
            blocked,
            waits,
            lost=frozenset(lost_set),
            executors=executors,
        )

    def _serial(self, member: Member) -> int:
        return self._serials.setdefault(member.address, len(self._serials) + 1)

    # -- per cache --------------------------------------------------------------------------

    async def _on_cache(self, cache_id: str, call: str, request: object) -> object | None:
        """One call about a cache on its member; None when its executor is gone (the cache
        went with it)."""
        placed = self._by_cache.get(cache_id)
        if placed is None or not self._alive(placed):
            return None
        try:
            return await getattr(placed.member.client, call)(request)  # type: ignore[no-any-return]
        except ExecutorError as error:
            if self._failed(placed, placed.incarnation, error):
                return None
            raise

    async def complete(
        self, request_id: str, cache_id: str, input_tokens: int, output_tokens: int
    ) -> None:
        await self._on_cache(
            cache_id,
            "complete_cache",
            pb.CompleteCacheRequest(
                request_id=request_id,
                cache_id=cache_id,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
            ),
        )
        self._forget(cache_id)

    async def release(self, cache_id: str) -> None:
        await self._on_cache(cache_id, "release_cache", pb.ReleaseCacheRequest(cache_id=cache_id))
        self._forget(cache_id)

    async def release_sources(self) -> list[ReleaseSource]:
        entries: list[ReleaseSource] = []
        members = {p.member.address: p for p in self._by_cache.values() if self._alive(p)}
        for placed in members.values():
            member, serial = placed.member, self._serial(placed.member)
            token, seen = "", set()
            while True:
                try:
                    page = await member.client.list_release_sources(
                        pb.ListReleaseSourcesRequest(page_token=token)
                    )
                except ExecutorError as error:
                    if self._failed(placed, placed.incarnation, error):
                        break
                    raise
                entries.extend(
                    ReleaseSource(
                        e.request_id,
                        e.cache_id,
                        frozenset((int(s.source), _scoped(serial, s.domain)) for s in e.sources),
                        e.releasable_blocks,
                    )
                    for e in page.entries
                )
                token = page.next_page_token
                if not token:
                    break
                if token in seen:
                    raise ContractViolation(f"ListReleaseSources repeated page token {token!r}")
                seen.add(token)
        return entries

    async def preempt(self, request_id: str, cache_id: str, mode: int) -> Receipt:
        response = await self._on_cache(
            cache_id,
            "preempt_execution_capacity",
            pb.PreemptExecutionCapacityRequest(
                request_id=request_id,
                cache_id=cache_id,
                mode=mode,  # type: ignore[arg-type]
            ),
        )
        self._forget(cache_id)
        if response is None:  # its executor is gone: the cache is gone with it
            return Receipt(request_id, cache_id)
        assert isinstance(response, pb.PreemptExecutionCapacityResponse)
        return Receipt(response.receipt.request_id, response.receipt.cache_id)

    async def renew_leases(self, cache_ids: Sequence[str]) -> list[str]:
        gone: list[str] = []
        by_member: dict[str, tuple[_Placed, list[str]]] = {}
        for cache_id in cache_ids:
            placed = self._by_cache.get(cache_id)
            if placed is None or not self._alive(placed):
                gone.append(cache_id)
                continue
            by_member.setdefault(placed.member.address, (placed, []))[1].append(cache_id)
        for placed, ids in by_member.values():
            try:
                response = await placed.member.client.renew_cache_lease(
                    pb.RenewCacheLeaseRequest(cache_ids=ids)
                )
            except ExecutorError as error:
                if not self._failed(placed, placed.incarnation, error):
                    raise
                gone.extend(ids)
                continue
            gone.extend(response.not_live_cache_ids)
        for cache_id in gone:
            self._forget(cache_id, failed_over=True)
        return gone


async def generate_on_fleet(
    fleet: ExecutorFleet,
    prompts: Sequence[Sequence[int]],
    params: GenerationParams | None = None,
    config: SchedulerConfig | None = None,
) -> list[GenerationResult]:
    """Generate over a started fleet (placement and failover as this module says)."""
    backend = FleetBackend(fleet)
    return await Scheduler(backend, config).generate(prompts, params or GenerationParams())


def _scoped(serial: int, domain: int) -> int:
    """A capacity domain made distinct per member (sources of two executors never match)."""
    return (serial << 32) | domain


__all__ = ["LOSS_CODES", "FleetBackend", "generate_on_fleet"]
