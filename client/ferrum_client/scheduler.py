"""A reference scheduler: continuous batching over one executor, driven through the client.

Each step packs decodes first, then prefill chunks, under a token budget, into one unified
batch on the step stream. Requests enter through the executor's admission probe; a deferred
request waits on the exact capacity sources the executor named (no polling); a decode that
cannot grow preempts the most recently admitted other request, which is re-admitted later with
its outputs replayed. Imports no torch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from ferrum_client.batch import GREEDY, BatchBuilder, SamplingOptions, item_views
from ferrum_client.handles import AsyncExecutorClient, StepStream
from ferrum_client.pb import executor_pb2 as pb


@dataclass(frozen=True, slots=True)
class GenerationParams:
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    sampling: SamplingOptions = GREEDY


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Most tokens per step (prefill chunks plus decodes); small budgets keep inter-token
    # latency low while a burst of prompts is prefilled.
    max_step_tokens: int = 512
    max_running: int = 64
    # PREEMPTION_MODE_RECOMPUTE or PREEMPTION_MODE_SWAP.
    preemption_mode: pb.PreemptionMode.ValueType = pb.PREEMPTION_MODE_RECOMPUTE
    # Longest single wait for a capacity change before re-checking (never a polling interval:
    # the wait returns as soon as a named source advances).
    wait_timeout_ms: int = 30_000


@dataclass(slots=True)
class GenerationResult:
    index: int
    request_id: str
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "length", "stop", "rejected", "cancelled", "error"
    error: str = ""
    num_preemptions: int = 0
    first_token_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Request:
    result: GenerationResult
    prompt: list[int]
    params: GenerationParams
    arrival_s: float
    cache_id: str = ""
    context: list[int] = field(default_factory=list)  # prompt + replayed outputs
    computed: int = 0  # tokens with committed KV (context, then context + new outputs)
    wait: pb.CapacityWaitCondition | None = None

    @property
    def output(self) -> list[int]:
        return self.result.output_ids

    @property
    def in_prefill(self) -> bool:
        return self.computed < len(self.context)


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    admission_probes: int = 0
    admissions_deferred: int = 0
    capacity_waits: int = 0
    # Waits that returned because a named source advanced.
    wakeups: int = 0
    # Releases this scheduler made itself (completion, preemption, cancel) that cleared a wait.
    own_releases: int = 0
    preemptions: int = 0
    deferred_items: int = 0
    step_tokens: list[int] = field(default_factory=list)


class Scheduler:
    """Drives one executor. Use `generate` for whole results or `stream` for tokens as they
    come; both accept new prompts only at the call."""

    def __init__(self, client: AsyncExecutorClient, config: SchedulerConfig | None = None) -> None:
        self.client = client
        self.config = config or SchedulerConfig()
        self.stats = SchedulerStats()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._cancelled: set[int] = set()
        self._prefix = f"r{time.monotonic_ns():x}"

    def cancel(self, index: int) -> None:
        """Cancel request `index` of the current call; its capacity is freed at the next step."""
        self._cancelled.add(index)

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: GenerationParams | Sequence[GenerationParams] = GenerationParams(),
    ) -> list[GenerationResult]:
        results: list[GenerationResult] = []
        async for _ in self._run(prompts, params, results):
            pass
        return results

    async def stream(
        self,
        prompts: Sequence[Sequence[int]],
        params: GenerationParams | Sequence[GenerationParams] = GenerationParams(),
    ) -> AsyncIterator[tuple[int, int]]:
        """Yield (prompt index, token id) as tokens are produced."""
        async for event in self._run(prompts, params, []):
            yield event

    async def _run(
        self,
        prompts: Sequence[Sequence[int]],
        params: GenerationParams | Sequence[GenerationParams],
        results: list[GenerationResult],
    ) -> AsyncIterator[tuple[int, int]]:
        per_prompt = [params] * len(prompts) if isinstance(params, GenerationParams) else params
        now = time.perf_counter()
        for index, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
            result = GenerationResult(index=index, request_id=f"{self._prefix}-{index}")
            results.append(result)
            self._waiting.append(_Request(result, list(prompt), p, now, context=list(prompt)))
        async with self.client.step_stream() as stream:
            while self._waiting or self._running:
                await self._drop_cancelled()
                await self._admit()
                if not self._running:
                    await self._wait_for_capacity()
                    continue
                for event in await self._step(stream):
                    yield event

    # -- admission --------------------------------------------------------------------------

    async def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_running:
            request = self._waiting[0]
            if request.wait is not None:
                return  # still waiting on its capacity sources
            decision = await self._probe(request)
            kind = decision.WhichOneof("decision")
            if kind == "admitted":
                self._waiting.popleft()
                request.cache_id = decision.admitted.cache_id
                request.computed = decision.admitted.cached_prompt_tokens
                self._running.append(request)
            elif kind == "rejected":
                self._waiting.popleft()
                self._finish_failed(request, "rejected", decision.rejected.reason)
            else:
                self.stats.admissions_deferred += 1
                request.wait = decision.deferred.wait_condition
                return

    async def _probe(self, request: _Request) -> pb.TryAdmitPrefillResponse:
        self.stats.admission_probes += 1
        return await self.client.try_admit_prefill(
            pb.TryAdmitPrefillRequest(
                request_id=request.result.request_id,
                input_tokens=request.context,
                maximum_sequence_tokens=len(request.prompt) + request.params.max_new_tokens,
                product_prompt_tokens=len(request.prompt),
                replayed_output_tokens=len(request.context) - len(request.prompt),
                request_origin=pb.REQUEST_ORIGIN_PRODUCT,
            )
        )

    async def _wait_for_capacity(self) -> None:
        """Nothing can run: park until a source named by the head request advances."""
        request = self._waiting[0]
        if request.wait is None:
            return
        self.stats.capacity_waits += 1
        response = await self.client.wait_for_capacity_change(
            pb.WaitForCapacityChangeRequest(
                condition=request.wait, timeout_ms=self.config.wait_timeout_ms
            )
        )
        if response.changed:
            self.stats.wakeups += 1
            request.wait = None

    def _release_waits(self) -> None:
        """Our own releases advance sources too: let the head re-probe once."""
        if self._waiting and self._waiting[0].wait is not None:
            self.stats.own_releases += 1
            self._waiting[0].wait = None

    # -- steps ------------------------------------------------------------------------------

    async def _step(self, stream: StepStream) -> list[tuple[int, int]]:
        budget = self.config.max_step_tokens
        batch = BatchBuilder()
        members: list[_Request] = []
        for request in self._running:  # decodes first: they keep inter-token latency low
            if not request.in_prefill and budget > 0:
                batch.add_decode(
                    request.result.request_id,
                    request.cache_id,
                    request.output[-1],
                    request.computed,
                    sampling=request.params.sampling,
                )
                members.append(request)
                budget -= 1
        for request in self._running:
            if request.in_prefill and budget > 0:
                chunk = request.context[request.computed : request.computed + budget]
                batch.add_prefill_chunk(
                    request.result.request_id,
                    request.cache_id,
                    chunk,
                    request.computed,
                    len(request.context),
                    maximum_sequence_tokens=len(request.prompt) + request.params.max_new_tokens,
                    sampling=request.params.sampling,
                )
                members.append(request)
                budget -= len(chunk)
        self.stats.steps += 1
        self.stats.step_tokens.append(self.config.max_step_tokens - budget)
        response = await stream.run(pb.UnifiedBatchRequest(items=batch.build()))
        events: list[tuple[int, int]] = []
        blocked: list[_Request] = []
        now = time.perf_counter()
        for request, view in zip(members, item_views(response.results), strict=True):
            if view.deferred:
                self.stats.deferred_items += 1
                blocked.append(request)
                continue
            request.computed = view.committed_tokens
            if view.has_token:
                self._record(request, view.token_id, now)
                events.append((request.result.index, view.token_id))
        for request in [r for r in self._running if r.result.finish_reason]:
            self._running.remove(request)
            await self.client.complete_cache(
                pb.CompleteCacheRequest(
                    request_id=request.result.request_id,
                    cache_id=request.cache_id,
                    input_tokens=len(request.prompt),
                    output_tokens=len(request.output),
                )
            )
            self._release_waits()
        for request in blocked:
            if request in self._running:
                await self._preempt_for(request)
        return events

    def _record(self, request: _Request, token: int, now: float) -> None:
        result = request.result
        if not result.output_ids:
            result.first_token_s = now - request.arrival_s
        result.output_ids.append(token)
        result.token_times_s.append(now)
        if token in request.params.stop_token_ids:
            result.finish_reason = "stop"
        elif len(result.output_ids) >= request.params.max_new_tokens:
            result.finish_reason = "length"

    async def _preempt_for(self, blocked: _Request) -> None:
        """A decode could not grow: retire the most recently admitted other request."""
        victims = [r for r in self._running if r is not blocked]
        if not victims:
            return  # its own admission guaranteed the fit: the next step will run
        victim = victims[-1]
        self._running.remove(victim)
        await self.client.preempt_execution_capacity(
            pb.PreemptExecutionCapacityRequest(
                request_id=victim.result.request_id,
                cache_id=victim.cache_id,
                mode=self.config.preemption_mode,
            )
        )
        self.stats.preemptions += 1
        victim.result.num_preemptions += 1
        victim.context = victim.prompt + victim.output
        victim.cache_id, victim.computed, victim.wait = "", 0, None
        self._release_waits()
        self._waiting.appendleft(victim)

    async def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        for request in [r for r in self._running if r.result.index in self._cancelled]:
            self._running.remove(request)
            await self.client.release_cache(pb.ReleaseCacheRequest(cache_id=request.cache_id))
            request.result.finish_reason = "cancelled"
            self._release_waits()
        for request in [r for r in self._waiting if r.result.index in self._cancelled]:
            self._waiting.remove(request)
            request.result.finish_reason = "cancelled"

    def _finish_failed(self, request: _Request, reason: str, error: str) -> None:
        request.result.finish_reason = reason
        request.result.error = error


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
    "GenerationParams",
    "GenerationResult",
    "Scheduler",
    "SchedulerConfig",
    "generate",
]
