"""The gRPC servicer: protobuf <-> domain mapping and status codes, nothing else."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from ferrum_client.pb import executor_pb2 as pb
from ferrum_client.pb import executor_pb2_grpc as pb_grpc

from ferrum_server import convert, info, logs
from ferrum_server.capacity import PreemptionMode
from ferrum_server.domain import DeferralMode, ItemKind, ItemStatus, Step, StepOutcome
from ferrum_server.engine import Engine
from ferrum_server.errors import INTERNAL_MESSAGE, ExecutorError, InvalidArgument, Unavailable
from ferrum_server.waits import CapacityNotifier

_LOG = logs.get(__name__)
R = TypeVar("R")
Handler = Callable[..., Awaitable[R]]


def _ids(request: Any) -> dict[str, object]:
    """Request and cache ids of a request, for logs (never tokens)."""
    ids: dict[str, object] = {}
    for name in ("request_id", "cache_id"):
        value = getattr(request, name, "")
        if value:
            ids[name] = value
    items = getattr(request, "items", None)
    if items is not None and hasattr(items, "cache_ids"):
        ids["cache_ids"] = [c for c in items.cache_ids if c][:16]
        ids["num_items"] = len(items.kinds)
    return ids


def _maps_errors(handler: Handler[R]) -> Handler[R]:
    """Turn domain errors into their status codes and anything else into a bare INTERNAL."""

    @functools.wraps(handler)
    async def wrapper(
        self: ExecutorServicer, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> R:
        try:
            return await handler(self, request, context)
        except ExecutorError as exc:
            _LOG.info(
                "rpc_failed",
                method=handler.__name__,
                code=exc.code.name,
                reason=type(exc).__name__,
                **_ids(request),
            )
            await context.abort(exc.code, exc.message)
        except Exception:
            _LOG.exception("rpc_failed", method=handler.__name__, code="INTERNAL", **_ids(request))
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
        raise AssertionError("unreachable")  # abort() always raises

    return wrapper


class ExecutorServicer(pb_grpc.ExecutorServiceServicer):
    def __init__(self, engine: Engine, notifier: CapacityNotifier) -> None:
        self.engine = engine
        self.notifier = notifier
        self.accepting = False  # flipped on after warmup, off when draining

    def _require_ready(self) -> None:
        if not self.accepting:
            raise Unavailable("the executor is not serving (warming up or draining)")

    async def _execute(self, step: Step) -> StepOutcome:
        self._require_ready()
        return await self.engine.call(self.engine.execute, step, time.perf_counter_ns())

    # -- identity and status --------------------------------------------------------------

    @_maps_errors
    async def GetInfo(self, request: pb.GetInfoRequest, context: Any) -> pb.GetInfoResponse:
        return info.info_response(self.engine)

    @_maps_errors
    async def GetCapabilities(
        self, request: pb.GetCapabilitiesRequest, context: Any
    ) -> pb.GetCapabilitiesResponse:
        return pb.GetCapabilitiesResponse(capabilities=info.capabilities(self.engine))

    @_maps_errors
    async def GetStatus(self, request: pb.GetStatusRequest, context: Any) -> pb.GetStatusResponse:
        return await self.engine.call(info.status_response, self.engine, self.accepting)

    @_maps_errors
    async def GetMetrics(
        self, request: pb.GetMetricsRequest, context: Any
    ) -> pb.GetMetricsResponse:
        return pb.GetMetricsResponse(metrics=info.metrics(self.engine))

    @_maps_errors
    async def GetKvSlotCapacity(
        self, request: pb.GetKvSlotCapacityRequest, context: Any
    ) -> pb.GetKvSlotCapacityResponse:
        snapshot = await self.engine.call(info.kv_snapshot, self.engine)
        return pb.GetKvSlotCapacityResponse(snapshot=snapshot)

    @_maps_errors
    async def Warmup(self, request: pb.WarmupRequest, context: Any) -> pb.WarmupResponse:
        num_tokens, forward_ms = await self.engine.call(self.engine.warmup, request.num_tokens)
        kv = self.engine.kv
        return pb.WarmupResponse(
            num_tokens=num_tokens,
            forward_ms=forward_ms,
            total_blocks=kv.pool.num_blocks,
            block_size=kv.block_size,
            max_supported_total_tokens=kv.pool.num_blocks * kv.block_size,
        )

    # -- execution ------------------------------------------------------------------------

    @_maps_errors
    async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:
        step = convert.prefill_step_from_pb(request)
        outcome = await self._execute(step)
        timings = convert.timings_to_pb(outcome.timings)
        deferral = convert.single_deferral(outcome)
        if deferral is not None:
            return pb.PrefillResponse(deferred=deferral, timings=timings)
        result, item = outcome.results[0], step.items[0]
        chunk = pb.PrefillChunk(
            tokens_processed=item.position,
            tokens_to_process=len(item.token_ids),
            total_prompt_tokens=item.total_prompt_tokens,
        )
        completion = pb.PrefillCompletion(
            kv_cache=pb.KvCacheRef(
                cache_id=result.cache_id,
                num_tokens=result.committed_tokens,
                block_size=self.engine.kv.block_size,
            ),
            planned_chunk=chunk,
            completed_chunk=chunk,
            request_id=item.request_id,
        )
        if result.status != ItemStatus.INTERMEDIATE:
            completion.output.CopyFrom(convert.sampling_output_to_pb(result))
        return pb.PrefillResponse(completed=completion, timings=timings)

    @_maps_errors
    async def Decode(self, request: pb.DecodeRequest, context: Any) -> pb.DecodeResponse:
        outcome = await self._execute(convert.decode_step_from_pb(request))
        timings = convert.timings_to_pb(outcome.timings)
        deferral = convert.single_deferral(outcome)
        if deferral is not None:
            return pb.DecodeResponse(deferred=deferral, timings=timings)
        result = outcome.results[0]
        return pb.DecodeResponse(
            completed=pb.DecodeOutput(
                kv_cache=pb.KvCacheRef(
                    cache_id=result.cache_id,
                    num_tokens=result.committed_tokens,
                    block_size=self.engine.kv.block_size,
                ),
                output=convert.sampling_output_to_pb(result),
            ),
            timings=timings,
        )

    async def _batch(
        self, items: pb.BatchItems, mode: DeferralMode, instance_id: int, only: ItemKind | None
    ) -> tuple[pb.BatchResults, pb.ExecutionDeferral | None, pb.StepTimings]:
        outcome = await self._execute(convert.step_from_pb(items, mode, instance_id, only))
        timings = convert.timings_to_pb(outcome.timings)
        if mode == DeferralMode.ALL_OR_NOTHING and outcome.results[0].deferral is not None:
            return pb.BatchResults(), convert.single_deferral(outcome), timings
        return convert.results_to_pb(outcome.results), None, timings

    @_maps_errors
    async def BatchPrefill(
        self, request: pb.BatchPrefillRequest, context: Any
    ) -> pb.BatchPrefillResponse:
        results, deferral, timings = await self._batch(
            request.items,
            DeferralMode.ALL_OR_NOTHING,
            request.executor_instance_id,
            ItemKind.PREFILL_CHUNK,
        )
        if deferral is not None:
            return pb.BatchPrefillResponse(not_submitted=deferral, timings=timings)
        return pb.BatchPrefillResponse(completed=results, timings=timings)

    @_maps_errors
    async def BatchDecode(
        self, request: pb.BatchDecodeRequest, context: Any
    ) -> pb.BatchDecodeResponse:
        results, deferral, timings = await self._batch(
            request.items,
            DeferralMode.ALL_OR_NOTHING,
            request.executor_instance_id,
            ItemKind.DECODE,
        )
        if deferral is not None:
            return pb.BatchDecodeResponse(deferred=deferral, timings=timings)
        return pb.BatchDecodeResponse(completed=results, timings=timings)

    @_maps_errors
    async def UnifiedBatch(
        self, request: pb.UnifiedBatchRequest, context: Any
    ) -> pb.UnifiedBatchResponse:
        return await self._unified(request)

    async def _unified(self, request: pb.UnifiedBatchRequest) -> pb.UnifiedBatchResponse:
        results, _, timings = await self._batch(
            request.items, DeferralMode.PER_ITEM, request.executor_instance_id, None
        )
        return pb.UnifiedBatchResponse(results=results, timings=timings)

    async def StepStream(
        self, request_iterator: AsyncIterator[pb.StepStreamRequest], context: Any
    ) -> AsyncIterator[pb.StepStreamResponse]:
        """Submit each step as it arrives (the engine runs them in order); answer in order."""
        pending: asyncio.Queue[tuple[int, asyncio.Task[pb.UnifiedBatchResponse]] | None] = (
            asyncio.Queue()
        )

        async def read() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.ensure_future(self._unified(request.batch))
                    await pending.put((request.step_id, task))
            finally:
                await pending.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (entry := await pending.get()) is not None:
                step_id, task = entry
                try:
                    result = await task
                except ExecutorError as exc:
                    yield pb.StepStreamResponse(
                        step_id=step_id,
                        error=pb.StepError(code=exc.code.value[0], message=exc.message),
                    )
                    continue
                except Exception:
                    _LOG.exception("step_failed", step_id=step_id)
                    yield pb.StepStreamResponse(
                        step_id=step_id,
                        error=pb.StepError(
                            code=grpc.StatusCode.INTERNAL.value[0], message=INTERNAL_MESSAGE
                        ),
                    )
                    continue
                yield pb.StepStreamResponse(step_id=step_id, result=result)
        finally:
            reader.cancel()

    @_maps_errors
    async def ForwardVerify(
        self, request: pb.ForwardVerifyRequest, context: Any
    ) -> pb.ForwardVerifyResponse:
        outcome = await self._execute(convert.verify_step_from_pb(request))
        timings = convert.timings_to_pb(outcome.timings)
        deferral = convert.single_deferral(outcome)
        if deferral is not None:
            return pb.ForwardVerifyResponse(deferred=deferral, timings=timings)
        result = outcome.results[0]
        drafts = list(request.token_ids)[1:]
        accepted = 0
        for draft, chosen in zip(drafts, result.token_ids, strict=False):
            if draft != chosen:
                break
            accepted += 1
        output = pb.ForwardVerifyOutput(
            kv_cache=pb.KvCacheRef(
                cache_id=result.cache_id,
                num_tokens=result.committed_tokens,
                block_size=self.engine.kv.block_size,
            ),
            token_ids=result.token_ids,
            token_logprobs=result.logprobs,
            logits=result.logits,
            num_accepted_greedy=accepted if result.token_ids else 0,
        )
        return pb.ForwardVerifyResponse(completed=output, timings=timings)

    @_maps_errors
    async def TruncateKv(
        self, request: pb.TruncateKvRequest, context: Any
    ) -> pb.TruncateKvResponse:
        self._require_ready()
        seq, freed = await self.engine.call(
            self.engine.truncate,
            request.cache_id,
            request.new_length,
            request.executor_instance_id,
        )
        return pb.TruncateKvResponse(
            kv_cache=convert.kv_ref(seq, self.engine.kv.block_size), blocks_freed=freed
        )

    # -- KV and release -------------------------------------------------------------------

    @_maps_errors
    async def ReserveKvSlots(
        self, request: pb.ReserveKvSlotsRequest, context: Any
    ) -> pb.ReserveKvSlotsResponse:
        self._require_ready()
        return await self.engine.call(info.reserve_kv_slots, self.engine, request)

    @_maps_errors
    async def ReleaseCache(
        self, request: pb.ReleaseCacheRequest, context: Any
    ) -> pb.ReleaseCacheResponse:
        result = await self.engine.call(
            self.engine.release, request.cache_id, request.executor_instance_id
        )
        return pb.ReleaseCacheResponse(
            released=result.released,
            blocks_freed=result.blocks_freed,
            epochs=convert.epochs_to_pb(self.engine.kv.clock.snapshot()),
        )

    @_maps_errors
    async def CompleteCache(
        self, request: pb.CompleteCacheRequest, context: Any
    ) -> pb.CompleteCacheResponse:
        result = await self.engine.call(
            self.engine.complete,
            request.request_id,
            request.cache_id,
            request.executor_instance_id,
        )
        return pb.CompleteCacheResponse(
            released=result.released,
            blocks_freed=result.blocks_freed,
            epochs=convert.epochs_to_pb(self.engine.kv.clock.snapshot()),
        )

    # -- capacity protocol ----------------------------------------------------------------

    @_maps_errors
    async def TryAdmitPrefill(
        self, request: pb.TryAdmitPrefillRequest, context: Any
    ) -> pb.TryAdmitPrefillResponse:
        self._require_ready()
        engine = self.engine
        decision = await engine.call(
            engine.try_admit,
            request.request_id,
            list(request.input_tokens),
            request.maximum_sequence_tokens,
            request.product_prompt_tokens,
            request.replayed_output_tokens,
            request.executor_instance_id,
        )
        return convert.decision_to_pb(decision, self.notifier.state, engine.kv)

    @_maps_errors
    async def CancelPrefillAdmission(
        self, request: pb.CancelPrefillAdmissionRequest, context: Any
    ) -> pb.CancelPrefillAdmissionResponse:
        released = await self.engine.call(
            self.engine.capacity.cancel_admission,
            request.request_id,
            request.executor_instance_id,
        )
        return pb.CancelPrefillAdmissionResponse(released=released)

    @_maps_errors
    async def MaintainPrefillBacking(
        self, request: pb.MaintainPrefillBackingRequest, context: Any
    ) -> pb.MaintainPrefillBackingResponse:
        # The KV pool is allocated whole at start-up, so admission never asks for backing
        # growth and no maintenance is ever pending.
        return pb.MaintainPrefillBackingResponse(no_longer_pending=pb.MaintenanceNoLongerPending())

    @_maps_errors
    async def GetCapacitySnapshot(
        self, request: pb.GetCapacitySnapshotRequest, context: Any
    ) -> pb.GetCapacitySnapshotResponse:
        engine = self.engine
        kv_snapshot = await engine.call(info.kv_snapshot, engine)
        state = self.notifier.state
        return pb.GetCapacitySnapshotResponse(
            epochs=convert.epochs_to_pb(state.epochs),
            sources=convert.sources_to_pb(sorted(state.generations.items())),
            kv=kv_snapshot,
            capacity=convert.capacity_snapshot_to_pb(state, engine.kv),
            limits=pb.AdmissionLimits(
                maximum_active_sequences=engine.config.max_batch_size,
                maximum_scheduled_tokens=engine.config.max_batch_tokens,
            ),
        )

    @_maps_errors
    async def WaitForCapacityChange(
        self, request: pb.WaitForCapacityChangeRequest, context: Any
    ) -> pb.WaitForCapacityChangeResponse:
        observed = convert.condition_from_pb(request.condition)
        remaining = context.time_remaining()
        timeout_s = request.timeout_ms / 1000 if request.timeout_ms else remaining
        result = await self.notifier.wait(request.condition.coordinator_id, observed, timeout_s)
        return pb.WaitForCapacityChangeResponse(
            changed=result.changed,
            current=convert.epochs_to_pb(result.state.epochs),
            sources=convert.sources_to_pb(result.sources),
        )

    async def WatchCapacity(
        self, request: pb.WatchCapacityRequest, context: Any
    ) -> AsyncIterator[pb.WatchCapacityResponse]:
        queue = self.notifier.watch()
        block_size = self.engine.kv.block_size
        try:
            state = self.notifier.state
            while True:
                yield pb.WatchCapacityResponse(
                    epochs=convert.epochs_to_pb(state.epochs),
                    sources=convert.sources_to_pb(sorted(state.generations.items())),
                    kv=convert.kv_state_to_pb(state, block_size),
                )
                state = await queue.get()
        finally:
            self.notifier.unwatch(queue)

    @_maps_errors
    async def ListReleaseSources(
        self, request: pb.ListReleaseSourcesRequest, context: Any
    ) -> pb.ListReleaseSourcesResponse:
        entries = await self.engine.call(self.engine.capacity.release_sources)
        return convert.release_sources_to_pb(entries)

    @_maps_errors
    async def PreemptExecutionCapacity(
        self, request: pb.PreemptExecutionCapacityRequest, context: Any
    ) -> pb.PreemptExecutionCapacityResponse:
        if request.mode not in (
            pb.PREEMPTION_MODE_UNSPECIFIED,
            pb.PREEMPTION_MODE_RECOMPUTE,
            pb.PREEMPTION_MODE_SWAP,
        ):
            raise InvalidArgument(f"unknown preemption mode {request.mode}")
        mode = (
            PreemptionMode.SWAP
            if request.mode == pb.PREEMPTION_MODE_SWAP
            else (PreemptionMode.RECOMPUTE)
        )
        receipt = await self.engine.call(
            self.engine.capacity.preempt,
            request.request_id,
            request.cache_id,
            mode,
            request.executor_instance_id,
        )
        return convert.receipt_to_pb(receipt)
