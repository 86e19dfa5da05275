"""A reference scheduler: continuous batching over one executor. Imports no torch.

Policy, per step:

* a token budget shared by decodes (one token each, packed first so inter-token latency stays
  low) and prefill chunks (first come, first served, a prompt split across steps when the budget
  runs out), all in one unified batch; the budget is ``max_step_tokens``, lowered when needed so
  the step is predicted to take about ``target_step_ms`` (``step_cost``), which bounds
  inter-token latency during a prefill burst on any device, while prefill keeps at least
  ``min_prefill_share`` of that target however long the decodes alone take;
* first tokens aligned: while nothing decodes, prompts are prefilled up to their last token in
  prefill-only steps and then start together (``_plan_held_prefill``), so the batch decodes in
  full-size steps rather than draining through a tail of small ones. No inter-token latency is
  at stake in those steps, so they may hold up to ``max_prefill_step_tokens`` (more than
  ``max_step_tokens``), where the GEMMs run closer to their peak;
* admission through the executor's capacity answers: ``TryAdmitPrefill`` admits, defers (the
  scheduler then parks on ``WaitForCapacityChange`` for exactly the sources named, never
  polling), asks for maintenance first (one ``MaintainPrefillBacking``, then a re-probe or a
  wait on the release it names) or rejects; a deferral hinting a narrower first chunk is
  re-probed at once with that claim when nothing else is in prefill or blocked, and chunks
  allow narrowing (the scheduler continues from what completed); an item the executor defers
  preempts a request whose release, per ``ListReleaseSources``, advances a source the item
  waits on (the most recently admitted such request; for a prefill chunk only one admitted
  after it), which is re-admitted later with its outputs replayed; a preemption receipt for
  another request or cache is a ``ContractViolation``;
* stop conditions (``max_new_tokens``, stop token ids), tokens streamed as they arrive, and
  cancellation that frees the request's KV at once.

Pipelining (where decode continuation, below, is off): up to ``pipeline_depth`` steps are in
flight on the step stream, so the executor starts step N+1 the moment step N ends, while the
scheduler is still receiving and processing step N's results; the RPC round trip and the
scheduling work leave the critical path. A request sits in at most one in-flight step: a
decode needs its previous token, and keeping prefill chunks of one prompt in order keeps
deferrals simple. With depth 2 the running requests settle
into two cohorts that alternate steps (decodes per step are capped at ceil(decoding / depth) so
the cohorts stay balanced), each step carrying the prefill chunks that fit its budget.

The price: each request then decodes in every other step, so a decode-only step carries half
the batch while still streaming every weight. When a step lasts tens of milliseconds (CPU) and
the round trip it hides is about one, that costs more than it saves, so the default depth is 1;
the measured trade-off is in docs/benchmarks.md.

Decode continuation (``decode_continuation``, on by default) hides the round trip without
splitting: a decode may ask the executor to feed the token its cache's last item selected
(BatchItems continue_decode), so step N+1 carries every running request as a continuation of
its step-N item before step N's answer is back, and no cohorts form. A request that stops by a
stop token at step N has then already been sent in step N+1: that one extra item's answer is
discarded and the request is completed when it is back (its cache, with the extra token's KV,
is released). Requests that end by length are never continued past their last token. An item
that did not run as planned (deferred, failed, narrowed, lost) voids the continuation sent
after it: the executor fails that item alone (its position no longer matches) and its answer
is discarded too. A deferred item's preemption waits until no step of its lane is in flight (a
victim must have no item in flight, and with continuation every running request has one);
other lanes keep stepping meanwhile. While prompts are still to arrive, step N+1 is planned
``continuation_lead_ms`` before step N's predicted end rather than as soon as step N starts,
so a prompt arriving during step N starts in step N+1 (``_plan_due_s``).

The policy talks to the executor through a small ``Backend`` protocol: ``GrpcBackend`` (the
step stream plus unary calls of ``AsyncExecutorClient``) here, and an in-process backend that
drives ``Engine`` directly on the server side (``ferrum_server.tools.bench``), so both run the very
same scheduling code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import itertools
import math
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ferrum_client.batch import GREEDY, SamplingOptions, fill_sampling_columns
from ferrum_client.errors import ExecutorError
from ferrum_client.handles import AsyncExecutorClient, StepStream
from ferrum_client.pb import executor_pb2 as pb
from ferrum_client.step_cost import StepCostModel


class ItemKind(enum.IntEnum):
    """A step item's kind, valued from the proto so the batch columns take it as it is."""

    PREFILL_CHUNK = pb.ITEM_KIND_PREFILL_CHUNK
    DECODE = pb.ITEM_KIND_DECODE


class ItemStatus(enum.IntEnum):
    """A step result's status, valued from the proto (BatchResults.statuses)."""

    INTERMEDIATE = pb.ITEM_STATUS_INTERMEDIATE
    TOKEN = pb.ITEM_STATUS_TOKEN
    LOGITS = pb.ITEM_STATUS_LOGITS
    DEFERRED = pb.ITEM_STATUS_DEFERRED
    FAILED = pb.ITEM_STATUS_FAILED


# Prefill tokens a step may always carry beside its decodes, however tight the step-time target.
# Also the smallest narrower first chunk (AdmissionDeferred.narrower_prefill_tokens) worth
# admitting a request with.
MIN_PREFILL_TOKENS = 32
# Consecutive maintenance rounds (MaintainPrefillBacking, then a re-probe answered
# maintenance_deferred again) before the request parks on the deferral's wait condition.
MAX_MAINTENANCE_ROUNDS = 3
# Step-time target of SchedulerConfig (milliseconds).
DEFAULT_TARGET_STEP_MS = 200.0
# Share of the step-time target that prefill may always take, however long the decodes alone.
DEFAULT_MIN_PREFILL_SHARE = 0.25
# Most tokens of a held, prefill-only step (SchedulerConfig.max_prefill_step_tokens).
DEFAULT_MAX_PREFILL_STEP_TOKENS = 1024
# How long before the predicted end of the step in flight a continuing lane plans its next step
# while prompts are still to arrive (SchedulerConfig.continuation_lead_ms).
DEFAULT_CONTINUATION_LEAD_MS = 5.0


@dataclass(frozen=True, slots=True)
class GenerationParams:
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    sampling: SamplingOptions = GREEDY


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Most tokens per step (prefill chunks plus decodes); small budgets keep inter-token
    # latency low while a burst of prompts is prefilled, large ones raise GEMM efficiency.
    # A burst's held, prefill-only steps follow max_prefill_step_tokens instead (below).
    max_step_tokens: int = 512
    max_running: int = 256
    # PREEMPTION_MODE_RECOMPUTE or PREEMPTION_MODE_SWAP.
    preemption_mode: pb.PreemptionMode.ValueType = pb.PREEMPTION_MODE_RECOMPUTE
    # Longest single wait for a capacity change before re-checking (never a polling interval:
    # the wait returns as soon as a named source advances).
    wait_timeout_ms: int = 30_000
    # Steps in flight at once where decode continuation is off or its executor lacks it (with
    # it, two); 1 = strictly one step, then its results, then the next. 2 hides the RPC round
    # trip but splits decodes into alternating cohorts (see the module docstring): worth it
    # when steps are short next to the round trip (GPU); on CPU depth 1 measured faster, so it
    # is the default.
    pipeline_depth: int = 1
    # Size each step so the executor is predicted to run it in about this long (a fit of its
    # reported step times, see step_cost), within max_step_tokens: it bounds inter-token latency
    # while prompts are prefilled, on any device and dtype. 0 = always max_step_tokens. Steps
    # far shorter than the target (a GPU) simply run at max_step_tokens.
    target_step_ms: float = DEFAULT_TARGET_STEP_MS
    # Prefill a step may always add, as a share of target_step_ms, when the decodes alone leave
    # less than that of the target (or run past it): prompts keep starting, at the price of
    # steps up to this share longer than the decodes'. 0 = only MIN_PREFILL_TOKENS then.
    min_prefill_share: float = DEFAULT_MIN_PREFILL_SHARE
    # While nothing decodes, prefill prompts up to their last token in max_step_tokens steps and
    # start them decoding together (see _plan_held_prefill); a prompt is held at most this long.
    align_first_tokens: bool = True
    max_first_token_hold_ms: float = 30_000.0
    # Most tokens of such a held, prefill-only step (never fewer than max_step_tokens; within
    # what the executor accepts). Larger steps run the GEMMs nearer their peak: on W1 bfloat16
    # (an AVX-512 CPU) 1024-token steps ran the linears at 439 against 411 GFLOP/s at 512, and
    # W1 about 4% faster (docs/benchmarks.md). Nothing decodes meanwhile, so no token waits on
    # a longer step; the burst's first tokens come together at its end either way.
    max_prefill_step_tokens: int = DEFAULT_MAX_PREFILL_STEP_TOKENS
    # Admit a request that does not fit whole with the narrower first chunk the executor hints
    # (at least MIN_PREFILL_TOKENS), when no running request is in prefill or blocked.
    narrow_admissions: bool = True
    # Keep two steps in flight (pipeline_depth is then not used) with every running request in
    # each: a decode whose previous item is still in flight continues from the token the
    # executor selected for it (see the module docstring). Needs an executor that supports it
    # (supports_decode_continuation); otherwise the scheduler pipelines as without it. On by
    # default: with the round trip off the critical path, offline runs on the 2-core CPU went
    # up to 5% faster on decode-heavy and shared-prefix workloads (level in some invocations)
    # and no slower on W1; online, a new prompt may wait one step longer for its first token,
    # which continuation_lead_ms mostly takes back (docs/scheduler.md).
    decode_continuation: bool = True
    # With decode continuation, while prompts are still to arrive: a lane with one step in
    # flight plans its next step this long before that step's predicted end (its step-time fit,
    # step_cost) instead of as soon as it starts, so a prompt that arrives meanwhile joins the
    # very next step instead of the one after it. The lead covers the planning, the trip to the
    # executor and the fit's error: a step that ends sooner than that leaves the executor idle
    # until the next one arrives. None = plan at once (every prompt arriving during a step then
    # waits out one more step for its first token); offline runs, with every prompt there from
    # the start, never hold (docs/scheduler.md).
    continuation_lead_ms: float | None = DEFAULT_CONTINUATION_LEAD_MS
    # Probe a burst of waiting requests in one call where the backend decides several at once
    # (BatchAdmission: TryAdmitPrefillBatch), in queue order as one probe each would be; a
    # burst of 64 prompts then pays one round trip instead of 64.
    batch_admissions: bool = True

    def __post_init__(self) -> None:
        if self.max_step_tokens < 1 or self.max_running < 1 or self.pipeline_depth < 1:
            raise ValueError("max_step_tokens, max_running and pipeline_depth must be >= 1")
        if self.max_prefill_step_tokens < 1:
            raise ValueError("max_prefill_step_tokens must be >= 1")
        if self.target_step_ms < 0:
            raise ValueError("target_step_ms must be >= 0 (0 = off)")
        if not 0 <= self.min_prefill_share <= 1:
            raise ValueError("min_prefill_share must be within [0, 1]")
        if self.max_first_token_hold_ms < 0:
            raise ValueError("max_first_token_hold_ms must be >= 0")
        if self.continuation_lead_ms is not None and not 0 <= self.continuation_lead_ms < 1e6:
            raise ValueError("continuation_lead_ms must be within [0, 1e6) ms, or None (off)")


@dataclass(slots=True)
class GenerationResult:
    index: int
    request_id: str
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "length", "stop", "rejected", "cancelled", "error"
    error: str = ""
    num_preemptions: int = 0
    arrival_s: float = 0.0  # perf_counter() when the request became eligible
    first_token_s: float = 0.0  # time to first token, seconds after arrival
    token_times_s: list[float] = field(default_factory=list)  # perf_counter() per token
    finished_s: float = 0.0
    # The executor that produced the last token (fleet backends; "" for one executor), and how
    # many times the request moved to another executor after its own was lost.
    executor: str = ""
    failovers: int = 0


# -- backend protocol ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlannedItem:
    """One item of a unified step, transport-neutral."""

    kind: ItemKind
    request_id: str
    cache_id: str
    tokens: Sequence[int]
    position: int
    total_prompt_tokens: int = 0
    maximum_sequence_tokens: int = 0
    sampling: SamplingOptions = GREEDY
    # A prefill chunk that does not fit may run only its fitting prefix.
    allow_narrowing: bool = False
    # A decode fed the token its cache's last item selected (carries no tokens).
    continuation: bool = False


# A capacity source as the executor names it: (CapacitySource value, domain).
SourceKey = tuple[int, int]


@dataclass(frozen=True, slots=True)
class StepTiming:
    """What the executor reports about one step (nanoseconds), plus the client's view."""

    queue_ns: int = 0
    forward_ns: int = 0
    sample_ns: int = 0
    total_ns: int = 0
    collective_ns: int = 0  # within forward_ns: a split model's collectives on rank 0


@dataclass(frozen=True, slots=True)
class StepResult:
    """Per item (input order): status, committed KV length and selected token."""

    statuses: Sequence[int]
    committed_tokens: Sequence[int]
    token_ids: Sequence[int]
    timing: StepTiming
    errors: dict[int, str] = field(default_factory=dict)  # item index -> message (FAILED)
    # Item index -> the sources its deferral waits on, and its opaque wait condition
    # (DEFERRED items).
    blocked_sources: dict[int, frozenset[SourceKey]] = field(default_factory=dict)
    waits: dict[int, object] = field(default_factory=dict)
    # Items whose executor was lost (a fleet backend): their requests are re-admitted elsewhere
    # with their outputs replayed; the item produced nothing.
    lost: frozenset[int] = frozenset()
    # Per item, the executor that ran it (a fleet backend; empty otherwise).
    executors: Sequence[str] = ()


@dataclass(frozen=True, slots=True)
class Admission:
    kind: str  # "admitted", "deferred", "maintenance" or "rejected"
    cache_id: str = ""
    cached_prompt_tokens: int = 0
    wait: object | None = None  # opaque wait condition (deferred, maintenance)
    reason: str = ""
    # Deferred: the largest first chunk the executor would admit now (0 = none).
    narrower_prefill_tokens: int = 0
    # Admitted: the executor it runs on, when the backend has several ("" for one). Requests of
    # one lane share its steps; each lane plans and pipelines its own steps.
    lane: str = ""


@dataclass(frozen=True, slots=True)
class Maintenance:
    """What one MaintainPrefillBacking attempt leaves the request to do."""

    kind: str  # "retry": probe admission again now; "wait": wait on `wait`
    wait: object | None = None


@dataclass(frozen=True, slots=True)
class ReleaseSource:
    """One live cache in the executor's ListReleaseSources answer."""

    request_id: str
    cache_id: str
    # Sources its release would advance.
    sources: frozenset[SourceKey]
    releasable_blocks: int


@dataclass(frozen=True, slots=True)
class Receipt:
    """The identity a preemption receipt names."""

    request_id: str
    cache_id: str


class ContractViolation(RuntimeError):
    """The executor answered something its contract rules out (a preemption receipt for
    another request or cache, a release-source listing that does not end)."""


@dataclass(frozen=True, slots=True)
class StepLimits:
    """What one step may carry on the executor (its capabilities); 0 = no limit known."""

    max_tokens: int = 0
    max_items: int = 0
    # The executor's cache lease: a cache no call names for this long expires; 0 = none.
    cache_lease_s: float = 0.0
    # The executor takes continuation decodes (supports_decode_continuation). A fleet says yes
    # and answers per lane (FailoverBackend.continues_decodes).
    decode_continuation: bool = False


@runtime_checkable
class Backend(Protocol):
    """The executor operations the scheduling policy needs."""

    async def open(self) -> StepLimits: ...

    async def close(self) -> None: ...

    async def admit(
        self,
        request_id: str,
        tokens: Sequence[int],
        maximum_tokens: int,
        prompt_tokens: int,
        first_chunk_tokens: int = 0,
    ) -> Admission: ...

    async def maintain(self, request_id: str) -> Maintenance:
        """One bounded maintenance attempt for a request answered "maintenance"."""
        ...

    async def cancel_admission(self, request_id: str) -> None: ...

    async def wait_for_capacity(self, wait: object, timeout_ms: int) -> bool: ...

    def submit(self, items: Sequence[PlannedItem]) -> Awaitable[StepResult]: ...

    async def complete(
        self, request_id: str, cache_id: str, input_tokens: int, output_tokens: int
    ) -> None: ...

    async def release(self, cache_id: str) -> None: ...

    async def release_sources(self) -> list[ReleaseSource]:
        """Every live cache the executor lists, with the sources its release advances."""
        ...

    async def preempt(self, request_id: str, cache_id: str, mode: int) -> Receipt: ...

    async def renew_leases(self, cache_ids: Sequence[str]) -> list[str]:
        """Renew the caches' leases; return the ids that were no longer live."""
        ...


@dataclass(frozen=True, slots=True)
class Probe:
    """One request's admission probe: ``Backend.admit``'s arguments."""

    request_id: str
    tokens: Sequence[int]  # the prompt, then any outputs being replayed
    maximum_tokens: int
    prompt_tokens: int
    first_chunk_tokens: int = 0


@runtime_checkable
class BatchAdmission(Protocol):
    """A backend that decides several admission probes in one call (an executor's
    TryAdmitPrefillBatch)."""

    def admission_batch_limits(self) -> tuple[int, int]:
        """(most probes, most input tokens in all) one ``admit_many`` takes; (0, 0) when the
        executor has no batch call (known once the backend is open)."""
        ...

    async def admit_many(self, probes: Sequence[Probe]) -> list[Admission]:
        """The probes decided in order until one is deferred ("deferred" or "maintenance"):
        one Admission per probe decided, that one last; the probes after it were not decided
        and hold nothing."""
        ...


@runtime_checkable
class FailoverBackend(Protocol):
    """A backend over several executors (``ferrum_client.fleet_backend.FleetBackend``) that
    reports the caches lost with an executor, for the scheduler to re-admit elsewhere."""

    def take_lost(self) -> set[str]: ...

    def width(self) -> int:
        """Executors a new request may be placed on now (the running cap scales with it)."""
        ...

    def continues_decodes(self, lane: str) -> bool:
        """Whether the executor behind a lane (``Admission.lane``) takes continuation decodes:
        members of one fleet may run different versions."""
        ...


def _admission_from_pb(decision: pb.TryAdmitPrefillResponse, request_id: str) -> Admission:
    kind = decision.WhichOneof("decision")
    if kind == "admitted":
        return Admission(
            "admitted", decision.admitted.cache_id, decision.admitted.cached_prompt_tokens
        )
    if kind == "rejected":
        return Admission("rejected", reason=decision.rejected.reason)
    if kind == "maintenance_deferred":
        # Its wait condition is for after a bounded number of maintenance rounds only.
        return Admission("maintenance", wait=decision.maintenance_deferred.wait_condition)
    if kind != "deferred":
        raise ContractViolation(f"TryAdmitPrefill answered no decision for {request_id!r}")
    deferred = decision.deferred
    return Admission(
        "deferred",
        wait=deferred.wait_condition,
        narrower_prefill_tokens=deferred.narrower_prefill_tokens,
    )


def admission_request(
    request_id: str,
    tokens: Sequence[int],
    maximum_tokens: int,
    prompt_tokens: int,
    first_chunk_tokens: int = 0,
    instance_id: int = 0,
) -> pb.TryAdmitPrefillRequest:
    """The scheduler's admission probe: `tokens` is the prompt then any outputs being replayed
    (after a preemption or a failover), `prompt_tokens` of them the prompt."""
    return pb.TryAdmitPrefillRequest(
        request_id=request_id,
        input_tokens=tokens,
        maximum_sequence_tokens=maximum_tokens,
        product_prompt_tokens=prompt_tokens,
        replayed_output_tokens=len(tokens) - prompt_tokens,
        request_origin=pb.REQUEST_ORIGIN_PRODUCT,
        first_chunk_tokens=first_chunk_tokens,
        executor_instance_id=instance_id,
    )


class GrpcBackend:
    """``Backend`` over one executor's gRPC API: steps on the bidirectional step stream."""

    def __init__(self, client: AsyncExecutorClient) -> None:
        self.client = client
        self._stream: StepStream | None = None
        self._batch_limits = (0, 0)

    async def open(self) -> StepLimits:
        capabilities = (await self.client.get_capabilities()).capabilities
        if capabilities.supports_admission_batch:
            self._batch_limits = (
                capabilities.max_batch_size,
                capabilities.max_admission_batch_tokens,
            )
        self._stream = self.client.step_stream()
        await self._stream.__aenter__()
        return StepLimits(
            capabilities.admission_limits.maximum_scheduled_tokens,
            capabilities.max_batch_size,
            capabilities.cache_lease_ms / 1000,
            capabilities.supports_decode_continuation,
        )

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.__aexit__(None, None, None)
            self._stream = None

    async def admit(
        self,
        request_id: str,
        tokens: Sequence[int],
        maximum_tokens: int,
        prompt_tokens: int,
        first_chunk_tokens: int = 0,
    ) -> Admission:
        decision = await self.client.try_admit_prefill(
            admission_request(request_id, tokens, maximum_tokens, prompt_tokens, first_chunk_tokens)
        )
        return _admission_from_pb(decision, request_id)

    def admission_batch_limits(self) -> tuple[int, int]:
        return self._batch_limits

    async def admit_many(self, probes: Sequence[Probe]) -> list[Admission]:
        response = await self.client.try_admit_prefill_batch(
            pb.TryAdmitPrefillBatchRequest(
                probes=[
                    admission_request(
                        p.request_id,
                        p.tokens,
                        p.maximum_tokens,
                        p.prompt_tokens,
                        p.first_chunk_tokens,
                    )
                    for p in probes
                ]
            )
        )
        if len(response.decisions) > len(probes):
            raise ContractViolation(
                f"TryAdmitPrefillBatch answered {len(response.decisions)} decisions for "
                f"{len(probes)} probes"
            )
        return [
            _admission_from_pb(decision, probe.request_id)
            for decision, probe in zip(response.decisions, probes, strict=False)
        ]

    async def maintain(self, request_id: str) -> Maintenance:
        response = await self.client.maintain_prefill_backing(
            pb.MaintainPrefillBackingRequest(request_id=request_id)
        )
        if response.WhichOneof("outcome") == "wait_for_release":
            return Maintenance("wait", response.wait_for_release.wait_condition)
        # maintained (backing installed), retry_admission (capacity changed meanwhile) and
        # no_longer_pending (nothing is held for it) all mean: probe admission again.
        return Maintenance("retry")

    async def cancel_admission(self, request_id: str) -> None:
        await self.client.cancel_prefill_admission(
            pb.CancelPrefillAdmissionRequest(request_id=request_id)
        )

    async def wait_for_capacity(self, wait: object, timeout_ms: int) -> bool:
        assert isinstance(wait, pb.CapacityWaitCondition)
        response = await self.client.wait_for_capacity_change(
            pb.WaitForCapacityChangeRequest(condition=wait, timeout_ms=timeout_ms)
        )
        return bool(response.changed)

    def submit(self, items: Sequence[PlannedItem]) -> Awaitable[StepResult]:
        assert self._stream is not None, "open() first"
        future = self._stream.submit(pb.UnifiedBatchRequest(items=encode_items(items)))
        return _decode_later(future)

    async def complete(
        self, request_id: str, cache_id: str, input_tokens: int, output_tokens: int
    ) -> None:
        await self.client.complete_cache(
            pb.CompleteCacheRequest(
                request_id=request_id,
                cache_id=cache_id,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
            )
        )

    async def release(self, cache_id: str) -> None:
        await self.client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))

    async def release_sources(self) -> list[ReleaseSource]:
        entries: list[ReleaseSource] = []
        token, seen = "", set()
        while True:
            page = await self.client.list_release_sources(
                pb.ListReleaseSourcesRequest(page_token=token)
            )
            entries.extend(
                ReleaseSource(
                    e.request_id,
                    e.cache_id,
                    frozenset((int(s.source), s.domain) for s in e.sources),
                    e.releasable_blocks,
                )
                for e in page.entries
            )
            token = page.next_page_token
            if not token:
                return entries
            if token in seen:  # pages are ordered by cache id: a token never comes back
                raise ContractViolation(f"ListReleaseSources repeated page token {token!r}")
            seen.add(token)

    async def preempt(self, request_id: str, cache_id: str, mode: int) -> Receipt:
        response = await self.client.preempt_execution_capacity(
            pb.PreemptExecutionCapacityRequest(
                request_id=request_id,
                cache_id=cache_id,
                mode=mode,  # type: ignore[arg-type]
            )
        )
        return Receipt(response.receipt.request_id, response.receipt.cache_id)

    async def renew_leases(self, cache_ids: Sequence[str]) -> list[str]:
        response = await self.client.renew_cache_lease(
            pb.RenewCacheLeaseRequest(cache_ids=cache_ids)
        )
        return list(response.not_live_cache_ids)


def encode_items(items: Sequence[PlannedItem]) -> pb.BatchItems:
    """Columnar BatchItems, built a column at a time (one extend per column, not per item)."""
    out = pb.BatchItems()
    out.kinds.extend([i.kind for i in items])  # type: ignore[misc]
    out.request_ids.extend([i.request_id for i in items])
    out.cache_ids.extend([i.cache_id for i in items])
    out.num_tokens.extend([len(i.tokens) for i in items])
    out.token_ids.extend(itertools.chain.from_iterable(i.tokens for i in items))
    out.positions.extend([i.position for i in items])
    out.total_prompt_tokens.extend([i.total_prompt_tokens for i in items])
    out.maximum_sequence_tokens.extend([i.maximum_sequence_tokens for i in items])
    if any(i.allow_narrowing for i in items):  # empty column: false for every item
        out.allow_narrowing.extend([i.allow_narrowing for i in items])
    if any(i.continuation for i in items):  # empty column: false for every item
        out.continue_decode.extend([i.continuation for i in items])
    fill_sampling_columns(out.sampling, [i.sampling for i in items])
    return out


def decode_results(response: pb.UnifiedBatchResponse) -> StepResult:
    results, t = response.results, response.timings
    return StepResult(
        statuses=list(results.statuses),
        committed_tokens=list(results.committed_tokens),
        token_ids=list(results.token_ids),
        timing=StepTiming(t.queue_ns, t.forward_ns, t.sample_ns, t.total_ns, t.collective_ns),
        errors={e.item_index: e.message for e in results.errors},
        blocked_sources={
            d.item_index: frozenset(
                (int(o.source), o.domain) for o in d.capacity.wait_condition.observed
            )
            for d in results.deferrals
        },
        waits={d.item_index: d.capacity.wait_condition for d in results.deferrals},
    )


async def _decode_later(future: Awaitable[pb.UnifiedBatchResponse]) -> StepResult:
    return decode_results(await future)


# -- scheduler ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Request:
    result: GenerationResult
    prompt: list[int]
    params: GenerationParams
    cache_id: str = ""
    lane: str = ""  # the executor it runs on (Admission.lane)
    context: list[int] = field(default_factory=list)  # prompt + replayed outputs
    computed: int = 0  # tokens with committed KV (context, then context + new outputs)
    wait: object | None = None
    # Its items in steps in flight (at most one unless decode_continuation).
    flights: int = 0
    # Decode continuation: the committed length its in-flight items lead to, how many of them
    # select a token, whether the latest does, and how many answers still in flight to
    # discard (continuations of an item that did not select its token, or sent after the
    # request ended).
    ahead: int = 0
    ahead_outputs: int = 0
    ahead_selects: bool = False
    discard: int = 0
    # Its last item was deferred (cleared when one runs): narrowed admissions wait meanwhile.
    blocked: bool = False
    maintenance_rounds: int = 0
    cancelled: bool = False
    touched_s: float = 0.0  # time.monotonic() when a call last named its cache

    @property
    def output(self) -> list[int]:
        return self.result.output_ids

    @property
    def in_flight(self) -> bool:
        return self.flights > 0

    @property
    def in_prefill(self) -> bool:
        return self.computed < len(self.context)

    @property
    def max_tokens(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step as the scheduler saw it (for benchmarks and tests)."""

    submitted_s: float
    finished_s: float
    num_decodes: int
    num_prefill_tokens: int
    num_prefill_items: int
    chunk_sizes: tuple[int, ...]
    timing: StepTiming
    # Keys the step's decodes attend to, summed (each decode's position + 1): the K/V its
    # attention reads, which bounds a decode step where memory is slow (the bench's floor).
    decode_keys: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_decodes + self.num_prefill_tokens


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    admission_probes: int = 0
    # Calls that carried several of those probes (BatchAdmission.admit_many).
    admission_batches: int = 0
    admissions_deferred: int = 0
    capacity_waits: int = 0
    # Waits that returned because a named source advanced.
    wakeups: int = 0
    # Releases this scheduler made itself (completion, preemption, cancel) that cleared a wait.
    own_releases: int = 0
    preemptions: int = 0
    # Admissions made with the executor's narrower first chunk, and chunks it narrowed.
    narrowed_admissions: int = 0
    narrowed_chunks: int = 0
    # TryAdmitPrefill answers of maintenance_deferred (each followed by MaintainPrefillBacking).
    maintenance_deferrals: int = 0
    deferred_items: int = 0
    failed_items: int = 0
    step_tokens: list[int] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)
    # Largest number of steps in flight at once.
    max_in_flight: int = 0
    # RenewCacheLease calls for caches held idle (see _renew_idle_leases).
    lease_renewals: int = 0
    # Requests re-admitted elsewhere after their executor was lost (fleet backends).
    failovers: int = 0
    # Decode continuation: continuation items sent, and answers discarded (the extra item of a
    # request that stopped, or a continuation voided by the item before it).
    continuations: int = 0
    discarded_items: int = 0
    # Steps planned late (continuation_lead_ms): their planning waited for the step in flight
    # to near its predicted end, or for a prompt that arrived meanwhile.
    held_plans: int = 0


@dataclass(slots=True)
class _Lane:
    """One executor's steps: its requests are planned together, its steps pipelined on their
    own, with its own step-cost fit and first-token hold, whatever the other lanes do."""

    key: str
    in_flight: deque[_InFlight] = field(default_factory=deque)
    cost: StepCostModel = field(default_factory=StepCostModel)  # for target_step_ms
    held_since: float | None = None  # when a prompt was first held (align_first_tokens)
    # When its last answer arrived (perf_counter): the step in flight then started running, if
    # it was sent before (continuation_lead_ms).
    answered_s: float = 0.0
    # Its next step's planning is being put off (continuation_lead_ms).
    holding: bool = False
    # Deferred items of a continuing lane, handled once the lane has nothing in flight
    # (preemption needs victims with no item in flight); the lane plans nothing meanwhile.
    blocked: list[tuple[_Request, frozenset[SourceKey], object | None]] = field(
        default_factory=list
    )


@dataclass(slots=True)
class _InFlight:
    result: asyncio.Future[StepResult]
    members: list[_Request]
    record: StepRecord
    # Tokens each member's item carried, and whether it selects a token if it runs whole.
    sizes: list[int] = field(default_factory=list)
    selects: list[bool] = field(default_factory=list)


class Scheduler:
    """Drives one executor. ``generate`` returns whole results, ``stream`` yields tokens as they
    come. Prompts enter at the call, optionally with arrival offsets (online traffic)."""

    def __init__(
        self, client: AsyncExecutorClient | Backend, config: SchedulerConfig | None = None
    ) -> None:
        self.backend: Backend = (
            GrpcBackend(client) if isinstance(client, AsyncExecutorClient) else client
        )
        # A backend over several executors reports the caches lost with one of them.
        self._failover: FailoverBackend | None = (
            self.backend if isinstance(self.backend, FailoverBackend) else None
        )
        self.config = config or SchedulerConfig()
        # A backend that decides several admission probes in one call.
        self._batcher: BatchAdmission | None = (
            self.backend
            if self.config.batch_admissions and isinstance(self.backend, BatchAdmission)
            else None
        )
        self.stats = SchedulerStats()
        # One lane per executor the running requests are on ("" for a single executor).
        self._lanes: dict[str, _Lane] = {"": _Lane("")}
        self.cost = self._lanes[""].cost  # a single executor's step time vs tokens
        self._limits = StepLimits()  # the executor's, known once the backend is open
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._by_index: dict[int, _Request] = {}
        self._cancelled: set[int] = set()
        self._background: set[asyncio.Future[None]] = set()
        self._prefix = f"r{time.monotonic_ns():x}"
        self.on_token: Callable[[int, int], None] | None = None

    def cancel(self, index: int) -> None:
        """Cancel request `index` of the current call; its capacity is freed at the next step
        boundary (or as soon as its in-flight step returns)."""
        self._cancelled.add(index)

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: GenerationParams | Sequence[GenerationParams] = GenerationParams(),
        arrivals_s: Sequence[float] | None = None,
    ) -> list[GenerationResult]:
        results: list[GenerationResult] = []
        async for _ in self._run(prompts, params, results, arrivals_s):
            pass
        return results

    async def stream(
        self,
        prompts: Sequence[Sequence[int]],
        params: GenerationParams | Sequence[GenerationParams] = GenerationParams(),
        arrivals_s: Sequence[float] | None = None,
    ) -> AsyncIterator[tuple[int, int]]:
        """Yield (prompt index, token id) as tokens are produced."""
        async for event in self._run(prompts, params, [], arrivals_s):
            yield event

    async def _run(
        self,
        prompts: Sequence[Sequence[int]],
        params: GenerationParams | Sequence[GenerationParams],
        results: list[GenerationResult],
        arrivals_s: Sequence[float] | None,
    ) -> AsyncIterator[tuple[int, int]]:
        per_prompt = [params] * len(prompts) if isinstance(params, GenerationParams) else params
        offsets = list(arrivals_s) if arrivals_s is not None else [0.0] * len(prompts)
        if len(offsets) != len(prompts):
            raise ValueError("arrivals_s needs one offset per prompt")
        pending: deque[tuple[float, _Request]] = deque()
        for index, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
            result = GenerationResult(index=index, request_id=f"{self._prefix}-{index}")
            results.append(result)
            request = _Request(result, list(prompt), p, context=list(prompt))
            self._by_index[index] = request
            pending.append((offsets[index], request))
        pending = deque(sorted(pending, key=lambda entry: entry[0]))
        start = time.perf_counter()
        self._limits = await self.backend.open()
        try:
            while pending or self._waiting or self._running or self._steps_in_flight:
                now = time.perf_counter()
                while pending and start + pending[0][0] <= now:
                    request = pending.popleft()[1]
                    request.result.arrival_s = start + (offsets[request.result.index] or 0.0)
                    self._waiting.append(request)
                await self._drop_cancelled()
                self._fail_over()
                await self._admit()
                await self._renew_idle_leases()
                wake: float | None = None  # the earliest end of a lane's hold
                for lane in self._active_lanes():
                    if lane.blocked and not lane.in_flight:
                        await self._handle_blocked(self._take_blocked(lane))
                    while len(lane.in_flight) < self._depth(lane) and not lane.blocked:
                        due = self._plan_due_s(lane, bool(pending))
                        if due is not None and time.perf_counter() < due:
                            lane.holding = True
                            wake = due if wake is None else min(wake, due)
                            break
                        step = self._plan(lane)
                        if step is None:
                            break
                        if lane.holding:
                            lane.holding = False
                            self.stats.held_plans += 1
                        lane.in_flight.append(step)
                    self.stats.max_in_flight = max(self.stats.max_in_flight, len(lane.in_flight))
                if self._steps_in_flight:
                    if wake is not None and pending:  # a prompt arriving first ends the hold
                        wake = min(wake, start + pending[0][0])
                    answered = await self._next_answered(wake)
                    if answered is None:  # a hold ended, or a prompt arrived, first
                        continue
                    answered.answered_s = time.perf_counter()
                    for event in await self._finish(answered.in_flight.popleft(), answered):
                        yield event
                elif (self._waiting and self._waiting[0].wait is not None) or self._parked():
                    await self._wait_for_capacity()
                elif pending:
                    arrival = max(0.0, start + pending[0][0] - time.perf_counter())
                    await asyncio.sleep(min(arrival, self._idle_bound_s()))
                elif self._running or self._waiting:
                    # Unreachable: with nothing in flight every running request can be planned
                    # (a positive budget always fits a decode or a chunk), and a waiting head
                    # either was admitted, was rejected, or holds a wait condition. Fail loudly
                    # rather than spin.
                    raise RuntimeError("scheduler stalled: nothing to run and nothing to wait on")
        finally:
            if self._background:
                await asyncio.gather(*self._background, return_exceptions=True)
            await self.backend.close()

    # -- failover ---------------------------------------------------------------------------

    def _fail_over(self) -> None:
        """Requests whose executor was lost (not in a step: those come back in the step's
        ``lost``) go first in the queue, to be re-admitted elsewhere with outputs replayed."""
        if self._failover is None:
            return
        lost = self._failover.take_lost()
        if not lost:
            return
        for request in [r for r in self._running if r.cache_id in lost and not r.in_flight]:
            self._running.remove(request)
            self._lose(request)

    def _lose(self, request: _Request) -> None:
        request.result.failovers += 1
        self.stats.failovers += 1
        self._requeue(request)

    # -- admission --------------------------------------------------------------------------

    async def _admit(self) -> None:
        # Every running request must fit one step, or a full set of decodes would starve prefill;
        # over several executors, one step of each (placement spreads them by load).
        width = self._failover.width() if self._failover is not None else 1
        cap = min(self.config.max_running, self._max_items) * max(1, width)
        while self._waiting and len(self._running) < cap:
            request = self._waiting[0]
            if request.wait is not None:
                return  # still waiting on its capacity sources
            burst = self._burst(cap - len(self._running))
            if len(burst) > 1:
                # All but the last decision are admitted or rejected (a deferral ends the
                # batch), and settle their requests at once; the last goes on below as the
                # head's decision.
                decisions = await self._probe_many(burst)
                for ahead, settled in zip(burst, decisions[:-1], strict=False):
                    self._settle_admission(ahead, settled)
                request, decision = burst[len(decisions) - 1], decisions[-1]
            else:
                decision = await self._probe(request)
            if decision.kind == "deferred" and self._narrow_admission(decision):
                # A hint, not a grant: re-probe with that first chunk.
                decision = await self._probe(request, decision.narrower_prefill_tokens)
                if decision.kind == "admitted":
                    self.stats.narrowed_admissions += 1
            if decision.kind in ("admitted", "rejected"):
                self._settle_admission(request, decision)
            elif decision.kind == "maintenance":
                self.stats.maintenance_deferrals += 1
                if await self._maintain(request, decision) == "wait":
                    return  # the head waits on a release
                # "retry": probe it again now; "failed": it left the queue, probe the next
            else:
                self.stats.admissions_deferred += 1
                request.wait = decision.wait
                return

    def _settle_admission(self, request: _Request, decision: Admission) -> None:
        """The head `request` admitted (it runs) or rejected (it ends)."""
        if self._waiting[0] is not request:
            raise RuntimeError("an admission decision settles the head of the queue only")
        if decision.kind == "admitted":
            self._waiting.popleft()
            request.cache_id = decision.cache_id
            request.lane = decision.lane
            request.computed = decision.cached_prompt_tokens
            request.touched_s = time.monotonic()
            request.maintenance_rounds = 0
            self._running.append(request)
        elif decision.kind == "rejected":
            self._waiting.popleft()
            self._finish_failed(request, "rejected", decision.reason)
        else:
            raise ContractViolation(
                f"an admission batch went on after {request.result.request_id!r} was "
                f"{decision.kind}"
            )

    def _burst(self, room: int) -> list[_Request]:
        """The waiting requests from the head one admission batch probes: at most `room` and
        the backend's limits, none waiting on a capacity source; just the head without a
        batching backend."""
        head = self._waiting[0]
        if self._batcher is None or room < 2:
            return [head]
        most_probes, most_tokens = self._batcher.admission_batch_limits()
        burst: list[_Request] = []
        tokens = 0
        for request in itertools.islice(self._waiting, min(room, most_probes)):
            tokens += len(request.context)
            if request.wait is not None or tokens > most_tokens:
                break
            burst.append(request)
        return burst or [head]

    async def _probe_many(self, burst: list[_Request]) -> list[Admission]:
        assert self._batcher is not None
        decisions = await self._batcher.admit_many(
            [Probe(r.result.request_id, r.context, r.max_tokens, len(r.prompt)) for r in burst]
        )
        if not decisions:
            raise ContractViolation(f"an admission batch of {len(burst)} probes decided none")
        self.stats.admission_probes += len(decisions)
        self.stats.admission_batches += 1
        return decisions

    async def _probe(self, request: _Request, first_chunk_tokens: int = 0) -> Admission:
        self.stats.admission_probes += 1
        return await self.backend.admit(
            request.result.request_id,
            request.context,
            request.max_tokens,
            len(request.prompt),
            first_chunk_tokens,
        )

    def _narrow_admission(self, decision: Admission) -> bool:
        """Whether to re-probe a deferred request with the executor's narrower first chunk:
        worth a step's prefill floor, and only while no running request is in prefill or
        blocked, so a partial claim never races another prefill for blocks, nor takes the
        blocks a deferred item (or a victim's release) was freeing for it."""
        return (
            self.config.narrow_admissions
            and decision.narrower_prefill_tokens >= MIN_PREFILL_TOKENS
            and not any(r.in_prefill or r.blocked for r in self._running)
        )

    async def _maintain(self, request: _Request, decision: Admission) -> str:
        """The executor needs physical maintenance before it can admit the head `request`:
        one bounded MaintainPrefillBacking attempt. Returns "retry" (probe again at once),
        "wait" (it now waits on a wait condition) or "failed" (maintenance failed: the
        admission is cancelled, as the contract asks, and the request ends with an error)."""
        request.maintenance_rounds += 1
        if request.maintenance_rounds > MAX_MAINTENANCE_ROUNDS:
            # Maintenance keeps answering "try again": wait for a source to advance instead.
            request.maintenance_rounds = 0
            request.wait = decision.wait
            return "wait"
        try:
            outcome = await self.backend.maintain(request.result.request_id)
        except ExecutorError as error:
            self._waiting.popleft()
            self._finish_failed(request, "error", f"prefill maintenance failed: {error}")
            await self.backend.cancel_admission(request.result.request_id)
            return "failed"
        if outcome.kind == "wait":
            request.wait = outcome.wait
            return "wait"
        return "retry"

    def _parked(self) -> list[_Request]:
        """Running requests whose deferred chunk waits on a capacity source (no release of
        ours could help it): they sit out steps until it advances."""
        return [r for r in self._running if r.wait is not None]

    async def _wait_for_capacity(self) -> None:
        """Nothing can run: park until a source named by the head request (or else by a
        parked running request) advances; then every wait re-checks once."""
        head = self._waiting[0] if self._waiting and self._waiting[0].wait else None
        request = head or next(iter(self._parked()), None)
        if request is None or request.wait is None:
            return
        self.stats.capacity_waits += 1
        timeout_ms = self.config.wait_timeout_ms
        if self._idle_bound_s() < math.inf:  # wake in time to renew the caches held idle
            timeout_ms = min(timeout_ms, math.ceil(self._idle_bound_s() * 1e3))
        if await self.backend.wait_for_capacity(request.wait, timeout_ms):
            self.stats.wakeups += 1
            request.wait = None
            for parked in self._parked():
                parked.wait = None

    # -- cache leases -----------------------------------------------------------------------

    def _idle_bound_s(self) -> float:
        """Longest the loop may sleep: half the cache lease while it holds caches."""
        lease_s = self._limits.cache_lease_s
        return lease_s / 2 if lease_s and self._running else math.inf

    async def _renew_idle_leases(self) -> None:
        """Renew the caches that no step has named for half the executor's cache lease (a
        prompt held for alignment, or waiting its turn to prefill), so none expires while this
        scheduler holds it. A cache the executor expired anyway is re-admitted as after a
        recompute preemption."""
        lease_s = self._limits.cache_lease_s
        now = time.monotonic()
        idle = [r for r in self._running if not r.in_flight and now - r.touched_s >= lease_s / 2]
        if not lease_s or not idle:
            return
        self.stats.lease_renewals += 1
        gone = set(await self.backend.renew_leases([r.cache_id for r in idle]))
        for request in idle:
            request.touched_s = now
            if request.cache_id in gone:
                self._running.remove(request)
                self._requeue(request)

    def _release_waits(self) -> None:
        """Our own releases advance sources too: let the head re-probe once, and parked
        chunks retry."""
        for parked in self._parked():
            parked.wait = None
        if self._waiting and self._waiting[0].wait is not None:
            self.stats.own_releases += 1
            self._waiting[0].wait = None

    # -- steps ------------------------------------------------------------------------------

    @property
    def _steps_in_flight(self) -> bool:
        return any(lane.in_flight for lane in self._lanes.values())

    def _active_lanes(self) -> list[_Lane]:
        """The lanes with running requests or steps in flight, in order of first use; a lane
        left with neither (its executor finished its work, or was lost) is dropped."""
        keys = dict.fromkeys(r.lane for r in self._running)
        for key, lane in list(self._lanes.items()):
            if lane.in_flight:
                keys[key] = None
            elif key not in keys and key:
                del self._lanes[key]
        return [self._lanes.setdefault(key, _Lane(key)) for key in keys]

    async def _next_answered(self, until: float | None = None) -> _Lane | None:
        """The lane whose oldest step in flight is answered first (steps of one lane are
        applied in order; lanes never wait for each other); None if none is by `until`
        (perf_counter; None = wait as long as it takes)."""
        lanes = [lane for lane in self._lanes.values() if lane.in_flight]
        done = [lane for lane in lanes if lane.in_flight[0].result.done()]
        if not done:
            heads = {lane.in_flight[0].result for lane in lanes}
            timeout = None if until is None else max(0.0, until - time.perf_counter())
            await asyncio.wait(heads, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            done = [lane for lane in lanes if lane.in_flight[0].result.done()]
        return done[0] if done else None

    def _plan(self, lane: _Lane) -> _InFlight | None:
        """Build and submit the lane's next step from its requests not already in flight."""
        running = [r for r in self._running if r.lane == lane.key]
        if self._continues(lane):
            return self._plan_continued(lane, running)
        config = self.config
        items: list[PlannedItem] = []
        members: list[_Request] = []
        decoding = sum(1 for r in running if not r.in_prefill)
        if (
            config.align_first_tokens
            and decoding == 0
            and not self._first_tokens_due(lane, running)
        ):
            return self._plan_held_prefill(lane, running)
        budget = planned = self._step_budget(decoding, lane)
        # Split decodes across the pipeline so consecutive steps carry alternating cohorts.
        steps_in_flight = len(lane.in_flight)
        decode_cap = math.ceil(decoding / config.pipeline_depth) if steps_in_flight == 0 else None
        num_decodes = 0
        for request in running:  # decodes first: they keep inter-token latency low
            if request.in_flight or request.in_prefill or budget <= 0:
                continue
            if decode_cap is not None and num_decodes >= decode_cap:
                break
            if len(items) >= self._max_items:
                break
            items.append(
                PlannedItem(
                    ItemKind.DECODE,
                    request.result.request_id,
                    request.cache_id,
                    (request.output[-1],),
                    request.computed,
                    sampling=request.params.sampling,
                )
            )
            members.append(request)
            budget -= 1
            num_decodes += 1
        chunks, budget = self._add_chunks(items, members, budget, False, running)
        if not items:
            return None
        return self._submit(items, members, num_decodes, chunks, planned - budget)

    # -- decode continuation -----------------------------------------------------------------

    def _continues(self, lane: _Lane) -> bool:
        """Decode continuation is asked for and the lane's executor supports it (over a fleet,
        each member answers for itself)."""
        if not (self.config.decode_continuation and self._limits.decode_continuation):
            return False
        return self._failover is None or self._failover.continues_decodes(lane.key)

    def _depth(self, lane: _Lane) -> int:
        """Steps kept in flight on a lane. Continuation keeps two: a request then has at most
        one continuation in flight, so a request that stops has exactly one extra item, and the
        completion's counts (prompt, outputs) match its committed length."""
        return 2 if self._continues(lane) else self.config.pipeline_depth

    def _plan_due_s(self, lane: _Lane, expecting: bool) -> float | None:
        """When the lane's next step is due to be planned (perf_counter), where its planning
        waits (continuation_lead_ms): decode continuation, one step in flight, prompts still to
        arrive (`expecting`), every running request of the lane in that step, and a step-time
        fit. Then it is continuation_lead_ms before the predicted end of the step in flight:
        its start (its submission, or the answer before it if that came later) plus the fit's
        time for what it holds. None: due now (a request not in flight, such as a prompt just
        admitted, is planned at once)."""
        lead_ms = self.config.continuation_lead_ms
        if lead_ms is None or not expecting or len(lane.in_flight) != 1:
            return None
        if not self._continues(lane):
            return None
        if any(not r.in_flight for r in self._running if r.lane == lane.key):
            return None
        cost = lane.cost.fit()
        if cost is None:
            return None
        record = lane.in_flight[0].record
        started = max(record.submitted_s, lane.answered_s)
        predicted = cost.seconds(record.num_decodes, record.num_prefill_tokens)
        return started + predicted - lead_ms / 1e3

    def _plan_continued(self, lane: _Lane, running: list[_Request]) -> _InFlight | None:
        """The next step with every running request that can decode, in flight or not (a
        continuation of its in-flight item, else a plain decode), then prefill chunks of the
        requests not in flight, first come first served."""
        decodes = [
            (request, item)
            for request in running
            if (item := self._decode_item(request)) is not None
        ]
        decoding = any(not r.in_prefill or (r.in_flight and r.ahead_selects) for r in running)
        if (
            self.config.align_first_tokens
            and not decoding
            and not self._first_tokens_due(lane, running)
        ):
            return self._plan_held_prefill(lane, running)
        items: list[PlannedItem] = []
        members: list[_Request] = []
        budget = planned = self._step_budget(len(decodes), lane)
        for request, item in decodes:
            if budget <= 0 or len(items) >= self._max_items:
                break
            items.append(item)
            members.append(request)
            budget -= 1
            self.stats.continuations += item.continuation
        num_decodes = len(items)
        chunks, budget = self._add_chunks(items, members, budget, False, running)
        if not items:
            return None
        return self._submit(items, members, num_decodes, chunks, planned - budget)

    def _decode_item(self, request: _Request) -> PlannedItem | None:
        """The request's decode for the next step: a plain one (its last output, at its
        committed length) when nothing of it is in flight; a continuation when its latest
        in-flight item selects a token and the request may go on after that token (a request
        that ends by length is never continued past its last token); else none."""
        params = request.params
        if request.result.finish_reason or params.sampling.full_logits:
            return None
        if not request.in_flight:
            if request.in_prefill:
                return None
            return PlannedItem(
                ItemKind.DECODE,
                request.result.request_id,
                request.cache_id,
                (request.output[-1],),
                request.computed,
                sampling=params.sampling,
            )
        if request.discard or not request.ahead_selects:
            return None
        if len(request.output) + request.ahead_outputs >= params.max_new_tokens:
            return None
        return PlannedItem(
            ItemKind.DECODE,
            request.result.request_id,
            request.cache_id,
            (),
            request.ahead,
            sampling=params.sampling,
            continuation=True,
        )

    def _add_chunks(
        self,
        items: list[PlannedItem],
        members: list[_Request],
        budget: int,
        hold_last: bool,
        running: list[_Request],
    ) -> tuple[list[int], int]:
        """Prefill chunks of `running`, first come first served, within `budget` tokens; with
        `hold_last` each prompt stops short of its last token. Returns (chunk sizes, budget
        left)."""
        chunks: list[int] = []
        for request in running:
            if budget <= 0 or len(items) >= self._max_items:
                break
            end = len(request.context) - 1 if hold_last else len(request.context)
            if request.in_flight or request.computed >= end or request.wait is not None:
                continue
            chunk = request.context[request.computed : min(end, request.computed + budget)]
            items.append(self._chunk_item(request, chunk))
            members.append(request)
            chunks.append(len(chunk))
            budget -= len(chunk)
        return chunks, budget

    def _chunk_item(self, request: _Request, chunk: list[int]) -> PlannedItem:
        return PlannedItem(
            ItemKind.PREFILL_CHUNK,
            request.result.request_id,
            request.cache_id,
            chunk,
            request.computed,
            len(request.context),
            request.max_tokens,
            request.params.sampling,
            # Admitted whole, a chunk always fits; with a narrowed admission it may not.
            allow_narrowing=True,
        )

    def _submit(
        self,
        items: list[PlannedItem],
        members: list[_Request],
        num_decodes: int,
        chunks: list[int],
        tokens: int,
    ) -> _InFlight:
        now = time.monotonic()
        selects = [_selects(item) for item in items]
        decode_keys = 0
        for request, item, selecting in zip(members, items, selects, strict=True):
            request.flights += 1
            request.touched_s = now
            request.ahead = item.position + (len(item.tokens) or 1)
            if item.kind == ItemKind.DECODE:
                decode_keys += request.ahead  # its position + 1: the keys it attends to
            request.ahead_outputs += selecting
            request.ahead_selects = selecting
        self.stats.steps += 1
        self.stats.step_tokens.append(tokens)
        record = StepRecord(
            submitted_s=time.perf_counter(),
            finished_s=0.0,
            num_decodes=num_decodes,
            num_prefill_tokens=sum(chunks),
            num_prefill_items=len(chunks),
            chunk_sizes=tuple(chunks),
            timing=StepTiming(),
            decode_keys=decode_keys,
        )
        sizes = [len(item.tokens) for item in items]
        # A task, so the loop can wait for whichever lane answers first.
        answer = asyncio.ensure_future(self.backend.submit(items))
        return _InFlight(answer, members, record, sizes, selects)

    def _first_tokens_due(self, lane: _Lane, running: list[_Request]) -> bool:
        """With nothing decoding on the lane: whether its running prompts start now: none
        being in flight, all of them are held at their last token or what is left of them fits
        the next plain step (the plain step's budget, not max_prefill_step_tokens: that step
        must hold every last token); or, in flight or not, the first was held
        max_first_token_hold_ms ago. (Decode continuation keeps a step in flight nearly always:
        a bound checked only with none would hold the prompts until every one is prefilled.)"""
        if not any(r.in_flight for r in running):
            remaining = sum(len(r.context) - r.computed for r in running)
            if remaining <= len(running) or remaining <= self._step_budget(0, lane):
                lane.held_since = None
                return True
        if not any(r.computed >= len(r.context) - 1 for r in running):
            return False
        now = time.perf_counter()
        if lane.held_since is None:
            lane.held_since = now
        if (now - lane.held_since) * 1e3 >= self.config.max_first_token_hold_ms:
            lane.held_since = None
            return True
        return False

    def _plan_held_prefill(self, lane: _Lane, running: list[_Request]) -> _InFlight | None:
        """Nothing is decoding, so no inter-token latency is at stake: steps of
        max_prefill_step_tokens prefill each prompt up to, not including, its last token. The
        prompts then start together (``_first_tokens_due``): one plain step computes every last
        token and the whole batch decodes from the next step on, in full-size decode steps,
        instead of each prompt starting alone and waiting out the others' prefill between its
        tokens."""
        items: list[PlannedItem] = []
        members: list[_Request] = []
        budget = self._held_prefill_tokens
        chunks, left = self._add_chunks(items, members, budget, True, running)
        if not items:
            return None
        return self._submit(items, members, 0, chunks, budget - left)

    def _step_budget(self, decoding: int, lane: _Lane) -> int:
        """Tokens the lane's next step may hold, within max_step_tokens: its decodes plus the
        prefill that the step-time target leaves room for on its executor (never less than
        min_prefill_share of the target, nor MIN_PREFILL_TOKENS)."""
        config, ceiling = self.config, self._max_tokens
        if config.target_step_ms <= 0:
            return ceiling
        prefill = lane.cost.prefill_budget(
            config.target_step_ms / 1e3, decoding, config.min_prefill_share, MIN_PREFILL_TOKENS
        )
        return ceiling if prefill is None else min(ceiling, decoding + prefill)

    @property
    def _max_tokens(self) -> int:
        """max_step_tokens, within what the executor accepts in one forward."""
        return self._within_executor(self.config.max_step_tokens)

    @property
    def _held_prefill_tokens(self) -> int:
        """max_prefill_step_tokens (at least max_step_tokens), within what the executor accepts
        in one forward."""
        config = self.config
        return self._within_executor(max(config.max_step_tokens, config.max_prefill_step_tokens))

    def _within_executor(self, tokens: int) -> int:
        """`tokens`, capped by what the executor accepts in one forward (when it says)."""
        limit = self._limits.max_tokens
        return min(tokens, limit) if limit else tokens

    @property
    def _max_items(self) -> int:
        """Items (decodes plus chunks) the executor accepts in one forward."""
        return self._limits.max_items or sys.maxsize

    def _observe_cost(self, record: StepRecord, lane: _Lane) -> None:
        timing = record.timing
        # The executor's own time for the step; the round trip only when it reports none.
        engine_ns = timing.forward_ns + timing.sample_ns
        seconds = engine_ns / 1e9 if engine_ns > 0 else record.finished_s - record.submitted_s
        lane.cost.observe(record.num_decodes, record.num_prefill_tokens, seconds)

    async def _finish(self, step: _InFlight, lane: _Lane) -> list[tuple[int, int]]:
        """Apply one step's results: record tokens, retire finished requests, preempt."""
        result = await step.result
        now = time.perf_counter()
        record = dataclasses.replace(step.record, finished_s=now, timing=result.timing)
        self.stats.records.append(record)
        self._observe_cost(record, lane)
        events: list[tuple[int, int]] = []
        blocked: list[tuple[_Request, frozenset[SourceKey], object | None]] = []
        statuses, committed, tokens = result.statuses, result.committed_tokens, result.token_ids
        for k, request in enumerate(step.members):
            request.flights -= 1
            request.ahead_outputs -= step.selects[k]
            if request.discard:
                # Sent as a continuation of an item that selected nothing, or after the request
                # ended (the one extra token of a stop): nothing in it is the request's.
                request.discard -= 1
                self.stats.discarded_items += 1
                if request.result.finish_reason and not request.in_flight:
                    self._retire(request)  # it ended while this item was in flight
                continue
            if request.flights and (
                k in result.lost or statuses[k] != ItemStatus.TOKEN or request.result.finish_reason
            ):
                request.discard = request.flights  # its continuations in flight are void
            if k in result.lost:
                if request in self._running and not request.result.finish_reason:
                    self._running.remove(request)
                    self._lose(request)
                continue
            status = statuses[k]
            request.blocked = status == ItemStatus.DEFERRED
            if status == ItemStatus.DEFERRED:
                self.stats.deferred_items += 1
                sources = result.blocked_sources.get(k, frozenset())
                blocked.append((request, sources, result.waits.get(k)))
                continue
            if status == ItemStatus.FAILED:
                self.stats.failed_items += 1
                self._finish_failed(request, "error", result.errors.get(k, "item failed"))
                continue
            # A narrowed chunk committed only its prefix: the next chunk starts from there.
            if step.sizes and committed[k] - request.computed < step.sizes[k]:
                self.stats.narrowed_chunks += 1
            request.computed = committed[k]
            if status == ItemStatus.TOKEN and not request.result.finish_reason:
                token = tokens[k]
                if result.executors:
                    request.result.executor = result.executors[k]
                self._record(request, token, now)
                if request.flights and request.result.finish_reason:
                    request.discard = request.flights  # stopped: the continuation is extra
                events.append((request.result.index, token))
                if self.on_token is not None:
                    self.on_token(request.result.index, token)
        finished = [q for q in step.members if q.result.finish_reason and q in self._running]
        for request in finished:
            self._running.remove(request)
            request.result.finished_s = now
            if not request.in_flight:  # else retired when its last item in flight returns
                self._retire(request)
        if self._continues(lane):
            # Preempting needs victims with no item in flight: wait for the lane to drain.
            lane.blocked.extend(blocked)
        else:
            await self._handle_blocked(blocked)
        return events

    def _retire(self, request: _Request) -> None:
        """Complete a finished request's cache. Nothing of it is in flight: a stopped
        request's one extra continuation has run, so its last output was fed back and the
        counts equal the committed length, which they allow. Completion needs no answer before
        the next step: it is sent without waiting (the engine orders it after the steps already
        queued, which is all that matters)."""
        self._spawn(
            self.backend.complete(
                request.result.request_id,
                request.cache_id,
                len(request.prompt),
                len(request.output),
            )
        )
        self._release_waits()

    def _take_blocked(
        self, lane: _Lane
    ) -> list[tuple[_Request, frozenset[SourceKey], object | None]]:
        blocked, lane.blocked = lane.blocked, []
        return blocked

    async def _handle_blocked(
        self, blocked: list[tuple[_Request, frozenset[SourceKey], object | None]]
    ) -> None:
        """Deferred items: preempt for each, or park a chunk on its wait condition."""
        for request, sources, wait in blocked:
            if request in self._running and not request.result.finish_reason:
                preempted = await self._preempt_for(request, sources)
                if not preempted and request.in_prefill:
                    request.wait = wait  # sits out steps until a named source advances

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _record(self, request: _Request, token: int, now: float) -> None:
        result = request.result
        if not result.output_ids:
            result.first_token_s = now - result.arrival_s
        result.output_ids.append(token)
        result.token_times_s.append(now)
        if token in request.params.stop_token_ids:
            result.finish_reason = "stop"
        elif len(result.output_ids) >= request.params.max_new_tokens:
            result.finish_reason = "length"

    async def _preempt_for(self, blocked: _Request, sources: frozenset[SourceKey]) -> bool:
        """An item was deferred: retire the most recently admitted other request, not in
        flight (a queued step may still reference those), whose release the executor says
        (ListReleaseSources) advances a source the item waits on. A prefill chunk (only a
        narrowed admission's can defer) preempts only requests admitted after it, so a partial
        claim never evicts older work; it waits for that work to finish instead."""
        position = self._running.index(blocked)
        candidates = self._running[position + 1 :] if blocked.in_prefill else self._running
        victims = [r for r in candidates if r is not blocked and not r.in_flight]
        if not victims:
            return False  # older work finishes (or the chunk waits), a lone request fits
        live = {(e.request_id, e.cache_id): e for e in await self.backend.release_sources()}
        useful = [
            r
            for r in victims
            if (entry := live.get((r.result.request_id, r.cache_id))) is not None
            and (not sources or entry.sources & sources)
        ]
        if not useful:
            return False  # no release would help now
        victim = useful[-1]
        self._running.remove(victim)
        # Awaited: the blocked item's retry must find the victim's blocks free.
        receipt = await self.backend.preempt(
            victim.result.request_id, victim.cache_id, self.config.preemption_mode
        )
        if receipt != Receipt(victim.result.request_id, victim.cache_id):
            raise ContractViolation(
                f"preempting {victim.result.request_id!r} (cache {victim.cache_id!r}) returned "
                f"a receipt for {receipt.request_id!r} (cache {receipt.cache_id!r})"
            )
        self.stats.preemptions += 1
        victim.result.num_preemptions += 1
        self._requeue(victim)
        return True

    def _requeue(self, victim: _Request) -> None:
        """Put a request whose cache is gone first in the queue, its outputs to be replayed."""
        victim.context = victim.prompt + victim.output
        victim.cache_id, victim.computed, victim.wait = "", 0, None
        victim.blocked = False
        self._release_waits()
        self._waiting.appendleft(victim)

    async def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        for index in list(self._cancelled):
            request = self._by_index.get(index)
            if request is None or request.result.finish_reason not in ("", "cancelled"):
                self._cancelled.discard(index)
                continue
            request.result.finish_reason = "cancelled"
            if request in self._running:
                if request.in_flight:
                    continue  # released once its step returns
                self._running.remove(request)
                await self.backend.release(request.cache_id)
                self._release_waits()
            elif request in self._waiting:
                self._waiting.remove(request)
            self._cancelled.discard(index)

    def _finish_failed(self, request: _Request, reason: str, error: str) -> None:
        request.result.finish_reason = reason
        request.result.error = error


def _selects(item: PlannedItem) -> bool:
    """Whether the item selects a token if it runs whole: a decode, or a final chunk."""
    end = item.position + len(item.tokens)
    return item.kind == ItemKind.DECODE or end == item.total_prompt_tokens


async def generate(
    target: str,
    prompts: Sequence[Sequence[int]],
    params: GenerationParams = GenerationParams(),
    config: SchedulerConfig | None = None,
) -> list[GenerationResult]:
    """One-call convenience: connect, generate, disconnect."""
    async with AsyncExecutorClient(target) as client:
        return await Scheduler(client, config).generate(prompts, params)


__all__ = [
    "Admission",
    "Backend",
    "ContractViolation",
    "FailoverBackend",
    "GenerationParams",
    "GenerationResult",
    "GrpcBackend",
    "Maintenance",
    "PlannedItem",
    "Receipt",
    "ReleaseSource",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "StepLimits",
    "StepRecord",
    "StepResult",
    "StepTiming",
    "generate",
]
