"""The gRPC servicer: each RPC is one straight function, protobuf in -> domain (convert.py) ->
engine -> protobuf out (convert.py, descriptions.py).

Two decorators give every RPC its frame: `_maps_errors` (the edge checks that hold for every
request, id lengths, and the one error map) on all of them, and `_mutating` on the calls that
change state, which also runs the body through the dispatcher: fencing and per-caller step-id
deduplication, the call's deadline, and a caller that leaves (the body gets the call's `Ticket`
for `engine.run`).

Requests are converted off the event loop: a batch over the item or token limit is refused
from its columns' lengths alone, and the per-item conversion runs on the parse thread, so a
large request never holds up other calls (health included) while it is read.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from ferrum_client.pb import executor_pb2 as pb
from ferrum_client.pb import executor_pb2_grpc as pb_grpc
from google.protobuf.message import Message

from ferrum_server import convert, descriptions, logs
from ferrum_server.capacity import Admitted, Decision, SlotReservation
from ferrum_server.capacity_notifier import CapacityNotifier
from ferrum_server.dispatch import Dispatcher, deadline_of, step_scope
from ferrum_server.domain import CapacityDeferral, DeferralMode, ItemKind, Step, StepOutcome
from ferrum_server.engine import Engine
from ferrum_server.errors import (
    INTERNAL_MESSAGE,
    REASON_METADATA,
    Draining,
    ExecutorError,
    ExecutorFaulted,
    InvalidArgument,
    Unavailable,
    public_message,
)
from ferrum_server.step_ledger import StepLedger
from ferrum_server.tickets import Ticket

_LOG = logs.get(__name__)
R = TypeVar("R")
Req = TypeVar("Req", bound=Message)
Handler = Callable[..., Awaitable[R]]
# A mutating RPC as written: the request and the call's ticket in, the response out.
Body = Callable[["ExecutorServicer", Req, Ticket[Any]], Awaitable[R]]
# The same RPC as gRPC calls it: the request and the call's context in.
Rpc = Callable[["ExecutorServicer", Req, Any], Awaitable[R]]

# grpc.aio ends a stream handler's request iterator the same way whether the client half-closed
# or the connection was lost (a failed read is reported as the end of the stream); the lost
# connection's cancellation follows a moment later (0.2 ms typical, 2 ms worst seen on a loaded
# 2-core machine) and only reaches a handler that is still running. A StepStream whose caches
# are still open waits this long at the end of its requests before it counts as ended normally.
HALF_CLOSE_GRACE_S = 0.25
# Steps a StepStream may have read but not yet answered (--step-stream-window).
STEP_STREAM_WINDOW = 16
_DRAINING = "the executor is draining; reconnect to another executor"


# Longest id a log line carries: a refused overlong id is logged cut to this, not whole.
_LOGGED_ID_CHARS = 64


def _clip(value: str) -> str:
    return value if len(value) <= _LOGGED_ID_CHARS else value[:_LOGGED_ID_CHARS] + "..."


def _ids(request: Any) -> dict[str, object]:
    """Request and cache ids of a request, for logs (never tokens); each clipped."""
    ids: dict[str, object] = {}
    for name in ("request_id", "cache_id"):
        value = getattr(request, name, "")
        if value:
            ids[name] = _clip(value)
    items = getattr(request, "items", None)
    if items is not None and hasattr(items, "cache_ids"):
        ids["cache_ids"] = [_clip(c) for c in items.cache_ids if c][:16]
        ids["num_items"] = len(items.kinds)
    return ids


def _trailers(exc: ExecutorError) -> tuple[tuple[str, str], ...]:
    """The typed reason of an error whose status code alone is ambiguous, for the client."""
    return ((REASON_METADATA, exc.reason.name),) if exc.reason else ()


def _maps_errors(handler: Handler[R]) -> Handler[R]:
    """Check a batch's size and the request's ids, then run the handler; turn domain errors
    into their status codes and anything else into a bare INTERNAL."""

    @functools.wraps(handler)
    async def wrapper(
        self: ExecutorServicer, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> R:
        try:
            items = getattr(request, "items", None)
            if isinstance(items, pb.BatchItems):
                convert.check_batch_size(items, self.engine.limits)
            convert.check_ids(request)
            return await handler(self, request, context)
        except ExecutorError as exc:
            _LOG.info(
                "rpc_failed",
                method=handler.__name__,
                code=exc.code.name,
                reason=type(exc).__name__,
                **_ids(request),
            )
            await context.abort(exc.code, public_message(exc), _trailers(exc))
        except Exception:
            _LOG.exception("rpc_failed", method=handler.__name__, code="INTERNAL", **_ids(request))
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
        raise AssertionError("unreachable")  # abort() always raises

    return wrapper


# The bodies of the mutating RPCs by method name, the name the step ledger fingerprints. A
# StepStream step starts UnifiedBatch's body from here, so a step id runs once whether it came
# by the stream or by a unary call.
_BODIES: dict[str, Body[Any, Any]] = {}


def _mutating(body: Body[Req, R]) -> Rpc[Req, R]:
    """A state-changing RPC: the body runs through the dispatcher, under the one error map."""
    method = body.__name__
    _BODIES[method] = body

    @_maps_errors
    @functools.wraps(body)
    async def rpc(self: ExecutorServicer, request: Req, context: Any) -> R:
        return await self.dispatch.mutate(
            method, request, context, functools.partial(body, self, request)
        )

    return rpc


# Put in a StepStream's answer queue when a drain begins.
_DRAIN = "drain"


def _step_error(exc: BaseException) -> pb.StepError:
    if isinstance(exc, ExecutorError):
        return pb.StepError(
            code=exc.code.value[0],
            message=public_message(exc),
            reason=pb.ErrorReason.ValueType(exc.reason),
        )
    return pb.StepError(code=grpc.StatusCode.INTERNAL.value[0], message=INTERNAL_MESSAGE)


class ExecutorServicer(pb_grpc.ExecutorServiceServicer):
    def __init__(
        self,
        engine: Engine,
        notifier: CapacityNotifier,
        *,
        step_ledger_size: int = 4096,
        step_ledger_max_bytes: int = 64 * 1024**2,
        step_ledger_evicted_ids: int = 65536,
        release_on_disconnect: bool = True,
        half_close_grace_s: float = HALF_CLOSE_GRACE_S,
        stream_window: int = STEP_STREAM_WINDOW,
    ) -> None:
        self.engine = engine
        self.notifier = notifier
        # Takes new requests: on after warmup, off once a drain begins.
        self.accepting = False
        # Runs steps and calls on the caches it holds: on after warmup, off once a drain's
        # finishing phase ends (then only the calls in flight are answered).
        self.running = False
        ledger = StepLedger(
            step_ledger_size,
            step_ledger_max_bytes,
            step_ledger_evicted_ids,
            on_bytes=engine.recorder.metrics.set_step_ledger_bytes,
        )
        self.draining = False
        self.dispatch = Dispatcher(engine, ledger)
        self.release_on_disconnect = release_on_disconnect
        self.half_close_grace_s = half_close_grace_s
        self.stream_window = stream_window
        # One thread, so requests are converted in the order they came (a stream's steps reach
        # the engine in order); it overlaps the engine's forward, as the event loop did.
        self._parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferrum-parse")
        # The answer queues of the open StepStreams, to wake the idle ones when a drain begins.
        self._streams: set[asyncio.Queue[Any]] = set()

    def _require_ready(self) -> None:
        """Work on held caches (steps, truncation, slot growth) runs until a drain closes."""
        if self.engine.fault is not None:
            raise ExecutorFaulted(
                f"the executor faulted ({self.engine.fault}) and runs nothing more; restart it"
            )
        if not self.running:
            raise Unavailable("the executor is not serving (warming up or draining)")

    def _require_admitting(self) -> None:
        """New requests (admissions, warmups) only while SERVING; steps that would open a cache
        are refused by the engine (it owns the cache table)."""
        self._require_ready()
        if not self.accepting:
            raise Draining()

    def mark_serving(self) -> None:
        self.accepting = self.running = True

    def begin_finishing(self) -> None:
        """A drain's first phase: take no new request (calls already in flight still run);
        every call on the caches held (steps, completion, release, capacity waits and watches)
        goes on."""
        self.accepting = False
        self.engine.begin_drain(time.perf_counter_ns())

    def begin_drain(self) -> None:
        """A drain's closing phase: refuse all work, and end at once (UNAVAILABLE) the calls
        that only wait: capacity waits and watches, and StepStreams with no step in flight (the
        others end once their steps are answered). It lasts as long as the work in flight."""
        self.accepting = self.running = False
        self.draining = True
        self.notifier.end_waits(_DRAINING)
        for answers in self._streams:
            answers.put_nowait(_DRAIN)

    def close(self) -> None:
        self._parser.shutdown(wait=False, cancel_futures=True)

    async def _parse(self, convert_fn: Callable[..., R], *args: object) -> R:
        """Run a request conversion on the parse thread (never on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._parser, convert_fn, *args)

    async def _execute(
        self,
        ticket: Ticket[Any],
        parse: Callable[..., Step],
        *args: object,
        inline: bool = False,
    ) -> tuple[Step, StepOutcome]:
        """Convert the request with parse(*args) off the loop (on it where `inline`: a small
        batch, `convert.converts_inline`), then run the step."""
        # Stamped on receipt: the step's queue time counts its conversion, and a drain that
        # begins while it converts still lets it open its cache (it was in flight).
        received_ns = time.perf_counter_ns()
        self._require_ready()
        step = parse(*args) if inline else await self._parse(parse, *args)
        return step, await self.engine.run_step(ticket, step, received_ns)

    # -- identity and status --------------------------------------------------------------

    @_maps_errors
    async def GetInfo(self, request: pb.GetInfoRequest, context: Any) -> pb.GetInfoResponse:
        return descriptions.info_response(self.engine)

    @_maps_errors
    async def GetCapabilities(
        self, request: pb.GetCapabilitiesRequest, context: Any
    ) -> pb.GetCapabilitiesResponse:
        return pb.GetCapabilitiesResponse(capabilities=descriptions.capabilities(self.engine))

    @_maps_errors
    async def GetStatus(self, request: pb.GetStatusRequest, context: Any) -> pb.GetStatusResponse:
        accepting = self.accepting
        # Read now, on the loop: the engine-thread read below waits for the running step.
        running = self.engine.stats.running_items
        status = await self.engine.call(descriptions.status_of, self.engine)
        return descriptions.status_response(self.engine, status, accepting, running)

    @_maps_errors
    async def GetMetrics(
        self, request: pb.GetMetricsRequest, context: Any
    ) -> pb.GetMetricsResponse:
        return pb.GetMetricsResponse(metrics=descriptions.metrics(self.engine))

    @_maps_errors
    async def GetKvSlotCapacity(
        self, request: pb.GetKvSlotCapacityRequest, context: Any
    ) -> pb.GetKvSlotCapacityResponse:
        usage = await self.engine.call(self.engine.kv.usage)
        return pb.GetKvSlotCapacityResponse(snapshot=convert.kv_usage_to_pb(usage))

    @_maps_errors
    async def Warmup(self, request: pb.WarmupRequest, context: Any) -> pb.WarmupResponse:
        engine = self.engine
        outcome = await engine.call(engine.warmup, request.num_tokens)
        return convert.warmup_response(outcome, engine.kv, engine.memory_plan.activation_peak_bytes)

    # -- execution ------------------------------------------------------------------------

    @_mutating
    async def Prefill(self, request: pb.PrefillRequest, ticket: Ticket[Any]) -> pb.PrefillResponse:
        limits = self.engine.limits
        convert.check_prompt_size(len(request.input_tokens), limits.max_sequence_length)
        step, outcome = await self._execute(
            ticket, convert.prefill_step_from_pb, request, self.engine.kv.block_size
        )
        return convert.prefill_response(step, outcome, self.engine.kv.block_size)

    @_mutating
    async def Decode(self, request: pb.DecodeRequest, ticket: Ticket[Any]) -> pb.DecodeResponse:
        _, outcome = await self._execute(ticket, convert.decode_step_from_pb, request)
        return convert.decode_response(outcome, self.engine.kv.block_size)

    @_mutating
    async def BatchPrefill(
        self, request: pb.BatchPrefillRequest, ticket: Ticket[Any]
    ) -> pb.BatchPrefillResponse:
        convert.check_batch_size(request.items, self.engine.limits)
        _, outcome = await self._execute(
            ticket,
            convert.step_from_pb,
            request.items,
            DeferralMode.ALL_OR_NOTHING,
            request.executor_instance_id,
            ItemKind.PREFILL_CHUNK,
            inline=convert.converts_inline(request.items),
        )
        return convert.batch_prefill_response(outcome)

    @_mutating
    async def BatchDecode(
        self, request: pb.BatchDecodeRequest, ticket: Ticket[Any]
    ) -> pb.BatchDecodeResponse:
        convert.check_batch_size(request.items, self.engine.limits)
        _, outcome = await self._execute(
            ticket,
            convert.step_from_pb,
            request.items,
            DeferralMode.ALL_OR_NOTHING,
            request.executor_instance_id,
            ItemKind.DECODE,
            inline=convert.converts_inline(request.items),
        )
        return convert.batch_decode_response(outcome)

    @_mutating
    async def UnifiedBatch(
        self, request: pb.UnifiedBatchRequest, ticket: Ticket[Any]
    ) -> pb.UnifiedBatchResponse:
        convert.check_batch_size(request.items, self.engine.limits)
        _, outcome = await self._execute(
            ticket,
            convert.step_from_pb,
            request.items,
            DeferralMode.PER_ITEM,
            request.executor_instance_id,
            inline=convert.converts_inline(request.items),
        )
        return convert.unified_response(outcome)

    def _start_step(
        self, batch: pb.UnifiedBatchRequest, deadline: float | None, scope: str
    ) -> tuple[Ticket[Any] | None, asyncio.Future[pb.UnifiedBatchResponse]]:
        """Submit one stream step as a UnifiedBatch (so deduplicated with the same caller's
        unary UnifiedBatch calls by batch.step_id)."""
        body = functools.partial(_BODIES["UnifiedBatch"], self, batch)
        try:
            convert.check_batch_size(batch.items, self.engine.limits)
            convert.check_ids(batch)
            return self.dispatch.start("UnifiedBatch", batch, deadline, body, scope)
        except ExecutorError as exc:
            refused: asyncio.Future[pb.UnifiedBatchResponse] = (
                asyncio.get_running_loop().create_future()
            )
            refused.set_exception(exc)
            return None, refused

    async def StepStream(
        self, request_iterator: AsyncIterator[pb.StepStreamRequest], context: Any
    ) -> AsyncIterator[pb.StepStreamResponse]:
        """Submit each step as it arrives (the engine runs them in order); answer in order.

        At most `stream_window` steps are read but not yet answered: while the window is full
        the stream reads no request, so HTTP/2 flow control holds back a client that sends
        steps without reading their answers (the server neither runs nor buffers its backlog).

        If the stream ends abnormally (cancelled, connection lost), steps not yet started are
        dropped, and with release_on_disconnect every cache the stream's steps opened or
        touched is released once the running step has finished. A lost connection can look
        like a half-close at first, so a normal end waits `half_close_grace_s` for a late
        cancellation while any of those caches is still open. A drain ends the stream with
        UNAVAILABLE as soon as it has no step in flight.
        """
        Pending = tuple[int, Ticket[Any] | None, asyncio.Future[pb.UnifiedBatchResponse]]
        # Steps read but not answered yet, oldest first (at most stream_window of them), then
        # None at the end of the requests; _DRAIN when a drain begins.
        pending: asyncio.Queue[Pending | str | None] = asyncio.Queue()
        unanswered: collections.deque[Pending] = collections.deque()
        window = asyncio.Semaphore(self.stream_window)
        touched: set[str] = set()
        deadline = deadline_of(context)
        broken = False
        try:
            scope = step_scope(context.invocation_metadata())
        except InvalidArgument as exc:
            await context.abort(exc.code, public_message(exc))

        async def read() -> None:
            nonlocal broken
            try:
                while True:
                    await window.acquire()  # a full window stops reading: backpressure
                    request = await anext(request_iterator, None)
                    if request is None:
                        break
                    entry = (request.step_id, *self._start_step(request.batch, deadline, scope))
                    unanswered.append(entry)
                    pending.put_nowait(entry)
            except Exception:
                broken = True  # the connection failed under us: treat as a disconnect
            finally:
                pending.put_nowait(None)

        self._streams.add(pending)
        if self.draining:
            pending.put_nowait(_DRAIN)
        reader = asyncio.ensure_future(read())
        ended_normally = False
        try:
            while (entry := await pending.get()) is not None:
                if isinstance(entry, str):  # _DRAIN
                    if not unanswered:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, _DRAINING)
                    continue
                step_id, _, future = entry
                try:
                    # Shielded: if the stream is cancelled here, the step is abandoned below
                    # (its ticket left), never cancelled half-way.
                    result = await asyncio.shield(future)
                except ExecutorError as exc:
                    response = pb.StepStreamResponse(step_id=step_id, error=_step_error(exc))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    _LOG.exception("step_failed", step_id=step_id)
                    response = pb.StepStreamResponse(step_id=step_id, error=_step_error(exc))
                else:
                    touched.update(c for c in result.results.cache_ids if c)
                    response = pb.StepStreamResponse(step_id=step_id, result=result)
                yield response
                # Only once delivered: a stream cancelled at the yield still abandons this step.
                unanswered.popleft()
                window.release()
                if self.draining and not unanswered:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, _DRAINING)
            if not broken and self.release_on_disconnect and await self._holds_any(touched):
                # The requests ended: a half-close, or a lost connection whose cancellation is
                # still on its way (see HALF_CLOSE_GRACE_S). Stay cancellable until it would
                # have arrived, or the caches of a dead stream would be kept forever.
                await asyncio.sleep(self.half_close_grace_s)
            ended_normally = not broken
        finally:
            self._streams.discard(pending)
            reader.cancel()
            if not ended_normally:
                self._abandon_stream(unanswered, touched)

    async def _holds_any(self, cache_ids: set[str]) -> bool:
        """Whether any of the caches is still open (a client that completed or released them
        all has nothing a late cancellation could release, so it need not wait)."""
        if not cache_ids:
            return False
        live = self.engine.kv.caches
        return await self.engine.call(lambda: any(c in live for c in cache_ids))

    def _abandon_stream(self, unanswered: collections.deque[Any], touched: set[str]) -> None:
        futures = []
        for _, ticket, future in unanswered:
            if ticket is not None:
                self.dispatch.leave(ticket)
            futures.append(future)
        _LOG.info("stream_abandoned", unanswered_steps=len(futures))
        if self.release_on_disconnect:
            self.dispatch.spawn(self._release_stream_caches(futures, touched))

    async def _release_stream_caches(
        self, futures: list[asyncio.Future[pb.UnifiedBatchResponse]], touched: set[str]
    ) -> None:
        for future in futures:
            try:
                result = await future
            except Exception:
                continue  # dropped or refused: it touched nothing
            touched.update(c for c in result.results.cache_ids if c)
        released = await self.engine.call(self.engine.release_caches, sorted(touched))
        _LOG.info("stream_caches_released", caches_released=released)

    @_mutating
    async def ForwardVerify(
        self, request: pb.ForwardVerifyRequest, ticket: Ticket[Any]
    ) -> pb.ForwardVerifyResponse:
        convert.check_token_count(len(request.token_ids), self.engine.limits.max_batch_tokens)
        step, outcome = await self._execute(ticket, convert.verify_step_from_pb, request)
        return convert.verify_response(step, outcome, self.engine.kv.block_size)

    @_mutating
    async def TruncateKv(
        self, request: pb.TruncateKvRequest, ticket: Ticket[Any]
    ) -> pb.TruncateKvResponse:
        self._require_ready()
        engine = self.engine
        cache, freed = await engine.run(
            ticket,
            engine.truncate,
            request.cache_id,
            request.new_length,
            request.executor_instance_id,
        )
        return convert.truncate_response(cache, freed, engine.kv.block_size)

    # -- KV and release -------------------------------------------------------------------

    @_mutating
    async def ReserveKvSlots(
        self, request: pb.ReserveKvSlotsRequest, ticket: Ticket[Any]
    ) -> pb.ReserveKvSlotsResponse:
        self._require_ready()
        admitting = self.accepting  # as the call arrived: one in flight at a drain still runs
        engine = self.engine
        slots = await self._parse(convert.slot_requests_from_pb, request)
        if not admitting and any(not slot.cache_id for slot in slots):
            raise Draining()  # a slot without a cache id opens one

        def release_opened(outcome: SlotReservation | CapacityDeferral) -> None:
            # The caches opened for requests without a cache id: nobody will learn their ids.
            if isinstance(outcome, SlotReservation):
                allocations = zip(outcome.allocations, slots, strict=True)
                engine.release_caches([a[0] for a, slot in allocations if not slot.cache_id])

        outcome = await engine.run(
            ticket,
            engine.capacity.reserve_slots,
            slots,
            request.executor_instance_id,
            on_orphan=release_opened,
        )
        return convert.reservation_to_pb(outcome)

    @_mutating
    async def ReleaseCache(
        self, request: pb.ReleaseCacheRequest, ticket: Ticket[Any]
    ) -> pb.ReleaseCacheResponse:
        engine = self.engine
        result = await engine.run(
            ticket, engine.release, request.cache_id, request.executor_instance_id
        )
        return convert.release_response(result, engine.kv.clock.snapshot())

    @_mutating
    async def CompleteCache(
        self, request: pb.CompleteCacheRequest, ticket: Ticket[Any]
    ) -> pb.CompleteCacheResponse:
        engine = self.engine
        result, work = await engine.run(
            ticket,
            engine.complete_observed,
            request.request_id,
            request.cache_id,
            request.input_tokens,
            request.output_tokens,
            request.executor_instance_id,
        )
        return convert.complete_response(result, engine.kv.clock.snapshot(), work)

    # -- capacity protocol ----------------------------------------------------------------

    @_mutating
    async def TryAdmitPrefill(
        self, request: pb.TryAdmitPrefillRequest, ticket: Ticket[Any]
    ) -> pb.TryAdmitPrefillResponse:
        self._require_admitting()
        engine = self.engine
        origin = convert.request_origin_from_pb(request.request_origin)

        def release_admitted(decision: Decision) -> None:
            if isinstance(decision, Admitted):
                engine.release_caches([decision.cache_id])

        decision = await engine.run(
            ticket,
            engine.try_admit,
            request.request_id,
            await self._parse(list, request.input_tokens),
            request.maximum_sequence_tokens,
            request.product_prompt_tokens,
            request.replayed_output_tokens,
            request.executor_instance_id,
            request.first_chunk_tokens,
            origin,
            on_orphan=release_admitted,
        )
        return convert.decision_to_pb(decision, self.notifier.state, engine.kv)

    @_mutating
    async def TryAdmitPrefillBatch(
        self, request: pb.TryAdmitPrefillBatchRequest, ticket: Ticket[Any]
    ) -> pb.TryAdmitPrefillBatchResponse:
        self._require_admitting()
        engine = self.engine

        def release_admitted(decisions: list[Decision]) -> None:
            engine.release_caches([d.cache_id for d in decisions if isinstance(d, Admitted)])

        decisions = await engine.run(
            ticket,
            engine.try_admit_batch,
            await self._parse(convert.admission_probes_from_pb, request),
            request.executor_instance_id,
            on_orphan=release_admitted,
        )
        return convert.decisions_to_pb(decisions, self.notifier.state, engine.kv)

    @_maps_errors
    async def CancelPrefillAdmission(
        self, request: pb.CancelPrefillAdmissionRequest, context: Any
    ) -> pb.CancelPrefillAdmissionResponse:
        released, work = await self.engine.call(
            self.engine.cancel_admission_observed,
            request.request_id,
            request.executor_instance_id,
        )
        return convert.cancel_response(released, work)

    @_maps_errors
    async def MaintainPrefillBacking(
        self, request: pb.MaintainPrefillBackingRequest, context: Any
    ) -> pb.MaintainPrefillBackingResponse:
        # The KV pool is allocated whole at start-up, so admission never asks for backing
        # growth and no maintenance is ever pending. The call names a request, so it renews
        # the leases of that request's caches.
        await self.engine.call(
            self.engine.renew_request, request.request_id, request.executor_instance_id
        )
        return pb.MaintainPrefillBackingResponse(no_longer_pending=pb.MaintenanceNoLongerPending())

    @_maps_errors
    async def RenewCacheLease(
        self, request: pb.RenewCacheLeaseRequest, context: Any
    ) -> pb.RenewCacheLeaseResponse:
        cache_ids = convert.renewal_from_pb(request, self.engine.config.max_batch_size)
        engine = self.engine
        not_live = await engine.call(engine.renew_leases, cache_ids, request.executor_instance_id)
        return convert.renew_response(cache_ids, not_live, engine.config.cache_lease_s)

    @_maps_errors
    async def GetCapacitySnapshot(
        self, request: pb.GetCapacitySnapshotRequest, context: Any
    ) -> pb.GetCapacitySnapshotResponse:
        engine = self.engine
        usage = await engine.call(engine.kv.usage)
        return convert.capacity_snapshot_response(
            self.notifier.state, usage, engine.kv, engine.config, engine.fault is not None
        )

    @_maps_errors
    async def WaitForCapacityChange(
        self, request: pb.WaitForCapacityChangeRequest, context: Any
    ) -> pb.WaitForCapacityChangeResponse:
        observed = convert.condition_from_pb(request.condition)
        remaining = context.time_remaining()
        timeout_s = request.timeout_ms / 1000 if request.timeout_ms else remaining
        result = await self.notifier.wait(request.condition.coordinator_id, observed, timeout_s)
        return convert.wait_response(result)

    async def WatchCapacity(
        self, request: pb.WatchCapacityRequest, context: Any
    ) -> AsyncIterator[pb.WatchCapacityResponse]:
        """The current state, then each newer one. A subscriber that reads slowly gets the
        newest state at its next read: changes coalesce, nothing accumulates for it."""
        watch = self.notifier.watch()
        block_size = self.engine.kv.block_size
        try:
            state = self.notifier.state
            while True:
                yield convert.watch_response(state, block_size)
                state = await watch.next()
        except Unavailable as exc:  # a drain began
            await context.abort(exc.code, public_message(exc))
        finally:
            self.notifier.unwatch(watch)

    @_maps_errors
    async def ListReleaseSources(
        self, request: pb.ListReleaseSourcesRequest, context: Any
    ) -> pb.ListReleaseSourcesResponse:
        page_size = convert.release_sources_page_size(request.page_size)
        entries = await self.engine.call(
            self.engine.capacity.release_sources, request.page_token, page_size + 1
        )
        return convert.release_sources_to_pb(entries, page_size)

    @_mutating
    async def PreemptExecutionCapacity(
        self, request: pb.PreemptExecutionCapacityRequest, ticket: Ticket[Any]
    ) -> pb.PreemptExecutionCapacityResponse:
        mode = convert.preemption_mode_from_pb(request.mode)
        receipt = await self.engine.run(
            ticket,
            self.engine.preempt,
            request.request_id,
            request.cache_id,
            mode,
            request.executor_instance_id,
        )
        return convert.receipt_to_pb(receipt)

    # -- snapshots and events -------------------------------------------------------------

    @_maps_errors
    async def GetResourceSnapshot(
        self, request: pb.GetResourceSnapshotRequest, context: Any
    ) -> pb.GetResourceSnapshotResponse:
        resources = await self.engine.call(descriptions.resources_of, self.engine)
        return descriptions.resource_snapshot_response(self.engine, resources)

    @_maps_errors
    async def GetCacheMetrics(
        self, request: pb.GetCacheMetricsRequest, context: Any
    ) -> pb.GetCacheMetricsResponse:
        return descriptions.cache_metrics_of(self.engine)

    async def WatchExecutionEvents(
        self, request: pb.WatchExecutionEventsRequest, context: Any
    ) -> AsyncIterator[pb.WatchExecutionEventsResponse]:
        events = self.engine.events
        try:
            subscription = events.subscribe()
        except ExecutorError as exc:
            await context.abort(exc.code, public_message(exc))
        try:
            yield convert.subscribed_to_pb(
                subscription.next_sequence, subscription.capacity, self.notifier.state
            )
            while True:
                for event in await subscription.take():
                    yield convert.execution_event_to_pb(event)
        finally:
            events.unsubscribe(subscription)
