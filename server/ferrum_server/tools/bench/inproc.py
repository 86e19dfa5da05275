"""The scheduler's ``Backend`` over an ``Engine`` in this process: no gRPC, no protobuf.

Steps still run on the engine's worker thread (``Engine.call``), so the scheduler's pipelining
behaves exactly as over the step stream; only the transport is gone. The benchmark uses it to
price the RPC layer (gRPC throughput / in-process throughput).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence

from ferrum_client.batch import SamplingOptions
from ferrum_client.scheduler import (
    Admission,
    Maintenance,
    PlannedItem,
    Probe,
    Receipt,
    ReleaseSource,
    StepLimits,
    StepResult,
    StepTiming,
)

from ferrum_server.capacity import AdmissionProbe, Admitted, Decision, Deferred, PreemptionMode
from ferrum_server.capacity_notifier import CapacityNotifier
from ferrum_server.convert import sampling_from_pb
from ferrum_server.domain import (
    GREEDY,
    CapacityDeferral,
    DeferralMode,
    ItemKind,
    Sampling,
    Step,
    StepItem,
)
from ferrum_server.engine import Engine


def _sampling(options: SamplingOptions) -> Sampling:
    # The same mapping the servicer applies to the wire form, so both paths sample alike.
    return GREEDY if options == SamplingOptions() else sampling_from_pb(options.to_pb())


class InProcessBackend:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._notifier: CapacityNotifier | None = None

    async def open(self) -> StepLimits:
        # The server's own wait mechanism: woken by the engine's epoch bumps, never polled.
        self._notifier = CapacityNotifier(self.engine.kv, asyncio.get_running_loop())
        config = self.engine.config
        return StepLimits(config.max_batch_tokens, config.max_batch_size, decode_continuation=True)

    async def close(self) -> None:
        if self._notifier is not None:
            self._notifier.close()
            self._notifier = None

    async def admit(
        self,
        request_id: str,
        tokens: Sequence[int],
        maximum_tokens: int,
        prompt_tokens: int,
        first_chunk_tokens: int = 0,
    ) -> Admission:
        engine = self.engine
        decision = await engine.call(
            engine.try_admit,
            request_id,
            list(tokens),
            maximum_tokens,
            prompt_tokens,
            len(tokens) - prompt_tokens,
            0,
            first_chunk_tokens,
        )
        return _admission(decision)

    def admission_batch_limits(self) -> tuple[int, int]:
        return self.engine.config.max_batch_size, self.engine.admission_batch_tokens

    async def admit_many(self, probes: Sequence[Probe]) -> list[Admission]:
        engine = self.engine
        decisions = await engine.call(
            engine.try_admit_batch,
            [
                AdmissionProbe(
                    p.request_id,
                    list(p.tokens),
                    p.maximum_tokens,
                    p.prompt_tokens,
                    len(p.tokens) - p.prompt_tokens,
                    first_chunk_tokens=p.first_chunk_tokens,
                )
                for p in probes
            ],
        )
        return [_admission(decision) for decision in decisions]

    async def maintain(self, request_id: str) -> Maintenance:
        # The pool is allocated whole at start-up: the engine never asks for maintenance, and
        # the server answers MaintainPrefillBacking with no_longer_pending (probe again).
        return Maintenance("retry")

    async def cancel_admission(self, request_id: str) -> None:
        await self.engine.call(self.engine.capacity.cancel_admission, request_id)

    async def release_sources(self) -> list[ReleaseSource]:
        entries = await self.engine.call(self.engine.capacity.release_sources)
        return [
            ReleaseSource(
                e.request_id,
                e.cache_id,
                frozenset((int(source), domain) for (source, domain), _ in e.sources),
                e.releasable_blocks,
            )
            for e in entries
        ]

    async def wait_for_capacity(self, wait: object, timeout_ms: int) -> bool:
        # An admission's Deferred, or a step item's CapacityDeferral: both name the sources.
        assert isinstance(wait, Deferred | CapacityDeferral) and self._notifier is not None
        result = await self._notifier.wait(
            wait.epochs.coordinator_id, wait.observed, timeout_ms / 1000
        )
        return result.changed

    def submit(self, items: Sequence[PlannedItem]) -> Awaitable[StepResult]:
        step = Step(
            [
                StepItem(
                    kind=ItemKind(item.kind),  # both valued as the proto's ItemKind
                    request_id=item.request_id,
                    cache_id=item.cache_id,
                    token_ids=list(item.tokens),
                    position=item.position,
                    total_prompt_tokens=item.total_prompt_tokens,
                    max_sequence_tokens=item.maximum_sequence_tokens,
                    sampling=_sampling(item.sampling),
                    allow_narrowing=item.allow_narrowing,
                    continuation=item.continuation,
                )
                for item in items
            ],
            DeferralMode.PER_ITEM,
        )
        # Queued on the engine thread now (not when awaited), like a message on the stream.
        future = asyncio.ensure_future(
            self.engine.call(self.engine.execute, step, time.perf_counter_ns())
        )
        return _result(future)

    async def complete(
        self, request_id: str, cache_id: str, input_tokens: int, output_tokens: int
    ) -> None:
        await self.engine.call(
            self.engine.complete, request_id, cache_id, input_tokens, output_tokens
        )

    async def release(self, cache_id: str) -> None:
        await self.engine.call(self.engine.release, cache_id)

    async def preempt(self, request_id: str, cache_id: str, mode: int) -> Receipt:
        swap = mode == 2  # pb.PREEMPTION_MODE_SWAP
        receipt = await self.engine.call(
            self.engine.capacity.preempt,
            request_id,
            cache_id,
            PreemptionMode.SWAP if swap else PreemptionMode.RECOMPUTE,
        )
        return Receipt(receipt.request_id, receipt.cache_id)

    async def renew_leases(self, cache_ids: Sequence[str]) -> list[str]:
        return await self.engine.call(self.engine.renew_leases, list(cache_ids))


async def _result(future: Awaitable[object]) -> StepResult:
    from ferrum_server.domain import StepOutcome

    outcome = await future
    assert isinstance(outcome, StepOutcome)
    results, t = outcome.results, outcome.timings
    errors: dict[int, str] = {}
    blocked: dict[int, frozenset[tuple[int, int]]] = {}
    waits: dict[int, object] = {}
    for index, r in enumerate(results):
        failure = getattr(r, "failure", None)
        if failure is not None:
            errors[index] = str(getattr(failure, "message", failure))
        if r.deferral is not None:
            blocked[index] = frozenset((int(s), d) for (s, d), _ in r.deferral.observed)
            waits[index] = r.deferral
    return StepResult(
        statuses=[int(r.status) for r in results],
        committed_tokens=[r.committed_tokens for r in results],
        token_ids=[r.token_ids[0] if r.token_ids else 0 for r in results],
        timing=StepTiming(t.queue_ns, t.forward_ns, t.sample_ns, t.total_ns, t.collective_ns),
        errors=errors,
        blocked_sources=blocked,
        waits=waits,
    )


def _admission(decision: Decision) -> Admission:
    if isinstance(decision, Admitted):
        return Admission("admitted", decision.cache_id, decision.cached_prompt_tokens)
    if isinstance(decision, Deferred):
        return Admission(
            "deferred", wait=decision, narrower_prefill_tokens=decision.narrower_prefill_tokens
        )
    return Admission("rejected", reason=decision.reason)
