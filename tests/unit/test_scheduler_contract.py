"""The reference scheduler obeys the capacity contract (issue #14, item 8), against a fake
executor: a scripted stand-in for ``AsyncExecutorClient`` behind the real ``GrpcBackend``, so
the protobuf answers are read exactly as they would be from a server.

Covered: maintenance_deferred leads to MaintainPrefillBacking and then a re-probe or a wait on
the condition it names (never a wait on an empty condition); preemption receipts must name the
victim's request and cache; victims come from ListReleaseSources (all pages), chosen among the
requests whose release advances the blocked source; a narrower admission hint is re-probed with
first_chunk_tokens, chunks allow narrowing, and the next chunk starts where the narrowed one
ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from ferrum_client import pb
from ferrum_client.errors import InternalError
from ferrum_client.scheduler import (
    ContractViolation,
    GenerationParams,
    GrpcBackend,
    Scheduler,
    SchedulerConfig,
)

KV = (pb.CAPACITY_SOURCE_DOMAIN, 0)
SLOTS = (pb.CAPACITY_SOURCE_ACTIVE_SEQUENCE_SLOTS, 0)
TOKEN = 7


def _condition(*sources: tuple[int, int]) -> pb.CapacityWaitCondition:
    return pb.CapacityWaitCondition(
        coordinator_id=1,
        observed=[pb.CapacityAvailabilityEpoch(source=s, domain=d, epoch=3) for s, d in sources],  # type: ignore[arg-type]
    )


def _admitted(request: pb.TryAdmitPrefillRequest, cache_id: str) -> pb.TryAdmitPrefillResponse:
    return pb.TryAdmitPrefillResponse(
        admitted=pb.AdmissionReceipt(request_id=request.request_id, cache_id=cache_id)
    )


@dataclass
class _Stream:
    executor: FakeExecutor

    async def __aenter__(self) -> _Stream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def submit(self, request: pb.UnifiedBatchRequest) -> asyncio.Future[pb.UnifiedBatchResponse]:
        future: asyncio.Future[pb.UnifiedBatchResponse] = asyncio.Future()
        future.set_result(self.executor.step(request.items))
        return future


@dataclass
class FakeExecutor:
    """Answers GrpcBackend's calls. Admission answers come from `admissions` (a function of
    the request and the probe number) and admit by default; a step item is deferred when
    `defer(request_id, kind)` says so, narrowed to `narrow_to` tokens when that is set for its
    request; every other item runs (a final chunk or decode selects TOKEN)."""

    admissions: Callable[[pb.TryAdmitPrefillRequest, int], pb.TryAdmitPrefillResponse | None] = (
        lambda request, probe: None
    )
    maintenance: list[pb.MaintainPrefillBackingResponse | Exception] = field(default_factory=list)
    defer: Callable[[str, int], bool] = lambda request_id, kind: False
    narrow_to: dict[str, int] = field(default_factory=dict)
    release_sources: Callable[[dict[str, str]], list[pb.ReleaseSourceEntry]] | None = None
    receipt: Callable[[pb.PreemptExecutionCapacityRequest], pb.PreemptionReceipt] | None = None
    page_size: int = 1
    calls: list[tuple[str, Any]] = field(default_factory=list)
    items: list[pb.BatchItems] = field(default_factory=list)
    live: dict[str, str] = field(default_factory=dict)  # cache id -> request id
    _probes: int = 0

    async def get_capabilities(self) -> pb.GetCapabilitiesResponse:
        capabilities = pb.ExecutorCapabilities(max_batch_size=16)
        capabilities.admission_limits.maximum_scheduled_tokens = 256
        return pb.GetCapabilitiesResponse(capabilities=capabilities)

    def step_stream(self) -> _Stream:
        return _Stream(self)

    async def try_admit_prefill(
        self, request: pb.TryAdmitPrefillRequest
    ) -> pb.TryAdmitPrefillResponse:
        self.calls.append(("TryAdmitPrefill", request))
        self._probes += 1
        answer = self.admissions(request, self._probes)
        if answer is None:
            cache_id = f"c{self._probes}"
            self.live[cache_id] = request.request_id
            answer = _admitted(request, cache_id)
        return answer

    async def maintain_prefill_backing(
        self, request: pb.MaintainPrefillBackingRequest
    ) -> pb.MaintainPrefillBackingResponse:
        self.calls.append(("MaintainPrefillBacking", request))
        answer = self.maintenance.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def cancel_prefill_admission(
        self, request: pb.CancelPrefillAdmissionRequest
    ) -> pb.CancelPrefillAdmissionResponse:
        self.calls.append(("CancelPrefillAdmission", request))
        return pb.CancelPrefillAdmissionResponse()

    async def wait_for_capacity_change(
        self, request: pb.WaitForCapacityChangeRequest
    ) -> pb.WaitForCapacityChangeResponse:
        self.calls.append(("WaitForCapacityChange", request))
        return pb.WaitForCapacityChangeResponse(changed=True)

    async def list_release_sources(
        self, request: pb.ListReleaseSourcesRequest
    ) -> pb.ListReleaseSourcesResponse:
        self.calls.append(("ListReleaseSources", request))
        assert self.release_sources is not None
        entries = sorted(self.release_sources(self.live), key=lambda e: e.cache_id)
        after = [e for e in entries if e.cache_id > request.page_token]
        page = after[: self.page_size]
        more = len(after) > self.page_size
        return pb.ListReleaseSourcesResponse(
            entries=page, next_page_token=page[-1].cache_id if more else ""
        )

    async def preempt_execution_capacity(
        self, request: pb.PreemptExecutionCapacityRequest
    ) -> pb.PreemptExecutionCapacityResponse:
        self.calls.append(("PreemptExecutionCapacity", request))
        self.live.pop(request.cache_id, None)
        receipt = (
            self.receipt(request)
            if self.receipt is not None
            else pb.PreemptionReceipt(request_id=request.request_id, cache_id=request.cache_id)
        )
        return pb.PreemptExecutionCapacityResponse(receipt=receipt)

    async def complete_cache(self, request: pb.CompleteCacheRequest) -> pb.CompleteCacheResponse:
        self.live.pop(request.cache_id, None)
        return pb.CompleteCacheResponse(released=True)

    async def release_cache(self, request: pb.ReleaseCacheRequest) -> pb.ReleaseCacheResponse:
        self.live.pop(request.cache_id, None)
        return pb.ReleaseCacheResponse(released=True)

    async def renew_cache_lease(
        self, request: pb.RenewCacheLeaseRequest
    ) -> pb.RenewCacheLeaseResponse:
        return pb.RenewCacheLeaseResponse()

    def step(self, items: pb.BatchItems) -> pb.UnifiedBatchResponse:
        self.items.append(items)
        results = pb.BatchResults()
        for i, kind in enumerate(items.kinds):
            request_id, count = items.request_ids[i], items.num_tokens[i]
            position = items.positions[i]
            results.cache_ids.append(items.cache_ids[i])
            if self.defer(request_id, kind):
                results.statuses.append(pb.ITEM_STATUS_DEFERRED)
                results.committed_tokens.append(position)
                results.token_ids.append(0)
                results.deferrals.append(
                    pb.ExecutionDeferral(
                        item_index=i,
                        request_id=request_id,
                        capacity=pb.ExecutionCapacityDeferral(wait_condition=_condition(KV)),
                    )
                )
                continue
            ran = min(count, self.narrow_to.pop(request_id, count))
            end = position + ran
            final = kind == pb.ITEM_KIND_DECODE or end == items.total_prompt_tokens[i]
            results.statuses.append(pb.ITEM_STATUS_TOKEN if final else pb.ITEM_STATUS_INTERMEDIATE)
            results.committed_tokens.append(end)
            results.token_ids.append(TOKEN if final else 0)
            results.completed_num_tokens.append(ran)
        return pb.UnifiedBatchResponse(results=results)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


def _run(
    executor: FakeExecutor, prompts: list[list[int]], max_new_tokens: int = 3
) -> tuple[Scheduler, list[Any]]:
    scheduler = Scheduler(GrpcBackend(executor), SchedulerConfig(max_step_tokens=64))  # type: ignore[arg-type]
    params = GenerationParams(max_new_tokens=max_new_tokens)
    results = asyncio.run(scheduler.generate(prompts, params))
    return scheduler, results


# -- maintenance_deferred ----------------------------------------------------------------------


def _maintenance_first(
    request: pb.TryAdmitPrefillRequest, probe: int
) -> pb.TryAdmitPrefillResponse | None:
    if probe > 1:
        return None
    return pb.TryAdmitPrefillResponse(
        maintenance_deferred=pb.PrefillMaintenanceDeferral(
            request_id=request.request_id, wait_condition=_condition(KV)
        )
    )


def test_maintenance_deferral_runs_maintenance_then_probes_again() -> None:
    executor = FakeExecutor(
        admissions=_maintenance_first,
        maintenance=[pb.MaintainPrefillBackingResponse(maintained=pb.MaintenanceMaintained())],
    )
    scheduler, results = _run(executor, [[1, 2, 3]])
    assert results[0].finish_reason == "length" and results[0].output_ids == [TOKEN] * 3
    names = executor.names()
    assert names[:3] == ["TryAdmitPrefill", "MaintainPrefillBacking", "TryAdmitPrefill"]
    maintain = executor.calls[1][1]
    assert maintain.request_id == results[0].request_id
    # Never a wait, and above all never one on the (empty) plain-deferral condition.
    assert "WaitForCapacityChange" not in names
    assert scheduler.stats.maintenance_deferrals == 1


def test_maintenance_that_waits_for_a_release_waits_on_the_condition_it_names() -> None:
    named = _condition(SLOTS)
    executor = FakeExecutor(
        admissions=_maintenance_first,
        maintenance=[
            pb.MaintainPrefillBackingResponse(
                wait_for_release=pb.MaintenanceWaitForRelease(wait_condition=named)
            )
        ],
    )
    _, results = _run(executor, [[1, 2, 3]])
    assert results[0].finish_reason == "length"
    names = executor.names()
    assert names[:4] == [
        "TryAdmitPrefill",
        "MaintainPrefillBacking",
        "WaitForCapacityChange",
        "TryAdmitPrefill",
    ]
    assert executor.calls[2][1].condition == named


def test_failed_maintenance_cancels_the_admission_and_fails_only_that_request() -> None:
    executor = FakeExecutor(
        admissions=_maintenance_first, maintenance=[InternalError("internal error")]
    )
    _, results = _run(executor, [[1, 2, 3], [4, 5]])
    assert results[0].finish_reason == "error" and "maintenance" in results[0].error
    assert results[1].finish_reason == "length"
    cancel = [r for name, r in executor.calls if name == "CancelPrefillAdmission"]
    assert [r.request_id for r in cancel] == [results[0].request_id]


# -- preemption: victims from ListReleaseSources, receipts checked ----------------------------


def _first_decode_of(index: int) -> Callable[[str, int], bool]:
    """Defer the first decode item of request `index` (ids end in -<index>)."""
    state = {"done": False}

    def defer(request_id: str, kind: int) -> bool:
        if state["done"] or kind != pb.ITEM_KIND_DECODE or not request_id.endswith(f"-{index}"):
            return False
        state["done"] = True
        return True

    return defer


def _sources(kv_free: set[str]) -> Callable[[dict[str, str]], list[pb.ReleaseSourceEntry]]:
    """Every live cache; only the requests whose id ends in one of `kv_free` free KV blocks."""

    def entries(live: dict[str, str]) -> list[pb.ReleaseSourceEntry]:
        out = []
        for cache_id, request_id in live.items():
            frees = request_id.rsplit("-", 1)[1] in kv_free
            sources = [SLOTS, KV] if frees else [SLOTS]
            out.append(
                pb.ReleaseSourceEntry(
                    request_id=request_id,
                    cache_id=cache_id,
                    sources=[
                        pb.CapacityAvailabilityEpoch(source=s, domain=d, epoch=2)  # type: ignore[arg-type]
                        for s, d in sources
                    ],
                    releasable_blocks=3 if frees else 0,
                )
            )
        return out

    return entries


def test_the_victim_is_a_request_whose_release_frees_the_blocked_source() -> None:
    """Request 0's decode is deferred on KV blocks. The most recently admitted request (2)
    holds only shared blocks, so its release would free no KV block; request 1's would. The
    scheduler reads every page of ListReleaseSources and preempts request 1."""
    executor = FakeExecutor(defer=_first_decode_of(0), release_sources=_sources({"1"}))
    scheduler, results = _run(executor, [[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    assert all(r.finish_reason == "length" for r in results)
    preempts = [r for name, r in executor.calls if name == "PreemptExecutionCapacity"]
    assert [p.request_id for p in preempts] == [results[1].request_id]
    assert [r.num_preemptions for r in results] == [0, 1, 0]
    pages = [r.page_token for name, r in executor.calls if name == "ListReleaseSources"]
    assert pages == ["", "c1", "c2"]  # one entry a page: three pages, in order
    assert scheduler.stats.preemptions == 1


def test_no_victim_when_no_release_would_help() -> None:
    executor = FakeExecutor(defer=_first_decode_of(0), release_sources=_sources(set()))
    _, results = _run(executor, [[1, 2, 3], [4, 5, 6]])
    assert all(r.finish_reason == "length" for r in results)
    assert "PreemptExecutionCapacity" not in executor.names()


@pytest.mark.parametrize("wrong", ["request", "cache"])
def test_a_receipt_for_another_request_or_cache_is_a_contract_violation(wrong: str) -> None:
    def receipt(request: pb.PreemptExecutionCapacityRequest) -> pb.PreemptionReceipt:
        if wrong == "request":
            return pb.PreemptionReceipt(request_id="someone-else", cache_id=request.cache_id)
        return pb.PreemptionReceipt(request_id=request.request_id, cache_id="c999")

    executor = FakeExecutor(
        defer=_first_decode_of(0), release_sources=_sources({"1"}), receipt=receipt
    )
    with pytest.raises(ContractViolation, match="returned a receipt for"):
        _run(executor, [[1, 2, 3], [4, 5, 6]])


def test_a_release_source_listing_that_repeats_a_page_token_is_a_contract_violation() -> None:
    executor = FakeExecutor(defer=_first_decode_of(0), release_sources=_sources({"1"}))

    async def looping(request: pb.ListReleaseSourcesRequest) -> pb.ListReleaseSourcesResponse:
        return pb.ListReleaseSourcesResponse(next_page_token="c1")

    executor.list_release_sources = looping  # type: ignore[method-assign]
    with pytest.raises(ContractViolation, match="repeated page token"):
        _run(executor, [[1, 2, 3], [4, 5, 6]])


# -- narrowing ------------------------------------------------------------------------------


def test_a_narrower_admission_hint_is_reprobed_and_chunks_continue_where_they_ended() -> None:
    prompt = list(range(1, 61))

    def hinted(request: pb.TryAdmitPrefillRequest, probe: int) -> pb.TryAdmitPrefillResponse | None:
        if request.first_chunk_tokens or probe > 3:  # admitted whole after a few waits
            return None
        return pb.TryAdmitPrefillResponse(
            deferred=pb.AdmissionDeferred(wait_condition=_condition(KV), narrower_prefill_tokens=40)
        )

    executor = FakeExecutor(admissions=hinted)
    request_id = ""

    def narrow_first(request_id_: str, kind: int) -> bool:
        nonlocal request_id
        if not request_id:
            request_id = request_id_
            executor.narrow_to[request_id_] = 25  # the first chunk runs 25 of its tokens
        return False

    executor.defer = narrow_first
    scheduler, results = _run(executor, [prompt], max_new_tokens=2)
    assert results[0].finish_reason == "length"
    probes = [r for name, r in executor.calls if name == "TryAdmitPrefill"]
    assert [p.first_chunk_tokens for p in probes] == [0, 40]
    assert "WaitForCapacityChange" not in executor.names()
    chunks = [
        (items.positions[0], items.num_tokens[0], list(items.allow_narrowing))
        for items in executor.items
        if items.kinds[0] == pb.ITEM_KIND_PREFILL_CHUNK
    ]
    # 60 tokens in a 64-token budget: one chunk of 59 (the last token is held for alignment
    # only when more than a step is left, which is not the case here), narrowed to 25; the
    # next chunk starts at 25.
    assert chunks[0][0] == 0 and chunks[0][2] == [True]
    assert chunks[1][0] == 25
    assert scheduler.stats.narrowed_admissions == 1 and scheduler.stats.narrowed_chunks == 1
