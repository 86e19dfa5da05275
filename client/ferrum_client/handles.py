"""Typed remote handles to one executor: `ExecutorClient` (blocking) and
`AsyncExecutorClient` (asyncio). Both mirror the executor operations one to one, take and
return the generated protobuf messages, and raise `ferrum_client.errors` exceptions.

Security: pass `credentials` (see `ferrum_client.channel.tls_credentials`) for TLS / mTLS and
`token` for bearer-token auth (sent as `authorization` metadata; use it over TLS or loopback).
`session_id` (sent as `ferrum-session` metadata) names the caller's session: the executor keeps
step ids per caller, so give each scheduler its own, stable across its reconnects.

Retries: read-only calls are retried by the channel on UNAVAILABLE. A mutating call is retried
(on UNAVAILABLE, within the same overall timeout) only when it carries a non-zero `step_id`,
because the executor then runs it at most once and replays the stored result. Any call whose
stream the server refused (HTTP/2 REFUSED_STREAM: the server processed nothing) is retried too.

Concurrency: `AsyncExecutorClient` keeps at most `calls_per_connection` calls (128) on each of up
to `max_connections` connections (4); further calls wait in the client, first come first served
(see `ferrum_client.connections`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ferrum_client.channel import (
    CHANNEL_OPTIONS,
    STEP_RETRY_ATTEMPTS,
    STEP_RETRY_INITIAL_BACKOFF_S,
    STEP_RETRY_MAX_BACKOFF_S,
    STEP_RETRYABLE,
    Metadata,
    call_metadata,
)
from ferrum_client.connections import (
    CALLS_PER_CONNECTION,
    MAX_CONNECTIONS,
    ConnectionPool,
    Slot,
)
from ferrum_client.errors import (
    ClientClosedError,
    ExecutorError,
    StreamClosedError,
    UnavailableError,
    from_rpc_error,
    from_step_error,
)
from ferrum_client.pb import executor_pb2 as pb
from ferrum_client.pb import executor_pb2_grpc as pb_grpc

R = TypeVar("R")
_CANCELLED = grpc.StatusCode.CANCELLED
# How grpc core words an RST_STREAM with HTTP/2 error code REFUSED_STREAM (7).
_REFUSED_STREAM = "RST_STREAM with error code 7"
REFUSED_STREAM_ATTEMPTS = 16


def _refused_stream(error: grpc.RpcError) -> bool:
    """The server refused the stream before reading it (HTTP/2 REFUSED_STREAM, RFC 9113 8.7):
    nothing ran, so any call may be sent again. grpc reports it only in the details."""
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else None) or ""
    return code == grpc.StatusCode.UNAVAILABLE and _REFUSED_STREAM in details


def _retry_delay(request: Any, error: grpc.RpcError, attempt: int) -> float | None:
    """Seconds to wait before retrying a step-id call or a refused stream, or None when the
    call must not be retried."""
    code = error.code() if hasattr(error, "code") else None
    refused = _refused_stream(error)
    step_call = getattr(request, "step_id", 0) and code in STEP_RETRYABLE
    if not step_call and not refused:
        return None
    # A refused stream never ran: it is resent for longer (still within the call's deadline),
    # since a burst above the server's stream limit may be refused several times over.
    if attempt + 1 >= (REFUSED_STREAM_ATTEMPTS if refused else STEP_RETRY_ATTEMPTS):
        return None
    ceiling = min(STEP_RETRY_MAX_BACKOFF_S, STEP_RETRY_INITIAL_BACKOFF_S * 2**attempt)
    return random.uniform(0, ceiling)


def _raise_if_closed_under_us() -> None:
    """grpc.aio ends a call cancelled by `close()` with asyncio.CancelledError, in a task that
    nobody cancelled: turn that into a typed error, and let a real cancellation through."""
    task = asyncio.current_task()
    if task is not None and not task.cancelling():
        raise ClientClosedError("the client was closed while the call ran") from None


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class ExecutorClient:
    """Blocking handle. Use as a context manager or call close()."""

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float | None = 60.0,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        session_id: str | None = None,
    ) -> None:
        options = list(CHANNEL_OPTIONS)
        self._channel = (
            grpc.secure_channel(target, credentials, options)
            if credentials
            else grpc.insecure_channel(target, options)
        )
        self._stub = pb_grpc.ExecutorServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.timeout_s = timeout_s
        self._metadata = call_metadata(token, session_id)

    def __enter__(self) -> ExecutorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request: Any) -> Any:
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        attempt = 0
        while True:
            try:
                return getattr(self._stub, method)(
                    request, timeout=_remaining(deadline), metadata=self._metadata
                )
            except grpc.RpcError as error:
                delay = _retry_delay(request, error, attempt)
                if delay is None:
                    raise from_rpc_error(error) from None
            time.sleep(delay)
            attempt += 1

    def health(self, service: str = "") -> int:
        """grpc.health.v1 status (1 = SERVING, 2 = NOT_SERVING)."""
        try:
            return int(
                self._health.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=self.timeout_s
                ).status
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    def get_info(self) -> pb.GetInfoResponse:
        return self._call("GetInfo", pb.GetInfoRequest())  # type: ignore[no-any-return]

    def get_capabilities(self) -> pb.GetCapabilitiesResponse:
        return self._call("GetCapabilities", pb.GetCapabilitiesRequest())  # type: ignore[no-any-return]

    def get_status(self) -> pb.GetStatusResponse:
        return self._call("GetStatus", pb.GetStatusRequest())  # type: ignore[no-any-return]

    def get_metrics(self) -> pb.GetMetricsResponse:
        return self._call("GetMetrics", pb.GetMetricsRequest())  # type: ignore[no-any-return]

    def get_kv_slot_capacity(self) -> pb.GetKvSlotCapacityResponse:
        return self._call("GetKvSlotCapacity", pb.GetKvSlotCapacityRequest())  # type: ignore[no-any-return]

    def warmup(self, request: pb.WarmupRequest | None = None) -> pb.WarmupResponse:
        return self._call("Warmup", request or pb.WarmupRequest())  # type: ignore[no-any-return]

    def prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        return self._call("Prefill", request)  # type: ignore[no-any-return]

    def decode(self, request: pb.DecodeRequest) -> pb.DecodeResponse:
        return self._call("Decode", request)  # type: ignore[no-any-return]

    def batch_prefill(self, request: pb.BatchPrefillRequest) -> pb.BatchPrefillResponse:
        return self._call("BatchPrefill", request)  # type: ignore[no-any-return]

    def batch_decode(self, request: pb.BatchDecodeRequest) -> pb.BatchDecodeResponse:
        return self._call("BatchDecode", request)  # type: ignore[no-any-return]

    def unified_batch(self, request: pb.UnifiedBatchRequest) -> pb.UnifiedBatchResponse:
        return self._call("UnifiedBatch", request)  # type: ignore[no-any-return]

    def forward_verify(self, request: pb.ForwardVerifyRequest) -> pb.ForwardVerifyResponse:
        return self._call("ForwardVerify", request)  # type: ignore[no-any-return]

    def truncate_kv(self, request: pb.TruncateKvRequest) -> pb.TruncateKvResponse:
        return self._call("TruncateKv", request)  # type: ignore[no-any-return]

    def reserve_kv_slots(self, request: pb.ReserveKvSlotsRequest) -> pb.ReserveKvSlotsResponse:
        return self._call("ReserveKvSlots", request)  # type: ignore[no-any-return]

    def release_cache(self, request: pb.ReleaseCacheRequest) -> pb.ReleaseCacheResponse:
        return self._call("ReleaseCache", request)  # type: ignore[no-any-return]

    def complete_cache(self, request: pb.CompleteCacheRequest) -> pb.CompleteCacheResponse:
        return self._call("CompleteCache", request)  # type: ignore[no-any-return]

    def try_admit_prefill(self, request: pb.TryAdmitPrefillRequest) -> pb.TryAdmitPrefillResponse:
        return self._call("TryAdmitPrefill", request)  # type: ignore[no-any-return]

    def try_admit_prefill_batch(
        self, request: pb.TryAdmitPrefillBatchRequest
    ) -> pb.TryAdmitPrefillBatchResponse:
        """Several probes in one call, decided in order until one is deferred (only where
        capabilities say supports_admission_batch)."""
        return self._call("TryAdmitPrefillBatch", request)  # type: ignore[no-any-return]

    def cancel_prefill_admission(
        self, request: pb.CancelPrefillAdmissionRequest
    ) -> pb.CancelPrefillAdmissionResponse:
        return self._call("CancelPrefillAdmission", request)  # type: ignore[no-any-return]

    def maintain_prefill_backing(
        self, request: pb.MaintainPrefillBackingRequest
    ) -> pb.MaintainPrefillBackingResponse:
        return self._call("MaintainPrefillBacking", request)  # type: ignore[no-any-return]

    def get_capacity_snapshot(self) -> pb.GetCapacitySnapshotResponse:
        return self._call("GetCapacitySnapshot", pb.GetCapacitySnapshotRequest())  # type: ignore[no-any-return]

    def wait_for_capacity_change(
        self, request: pb.WaitForCapacityChangeRequest
    ) -> pb.WaitForCapacityChangeResponse:
        return self._call("WaitForCapacityChange", request)  # type: ignore[no-any-return]

    def list_release_sources(
        self, request: pb.ListReleaseSourcesRequest | None = None
    ) -> pb.ListReleaseSourcesResponse:
        """One page (up to 1024 entries); pass `next_page_token` back as `page_token`."""
        request = request or pb.ListReleaseSourcesRequest()
        return self._call("ListReleaseSources", request)  # type: ignore[no-any-return]

    def preempt_execution_capacity(
        self, request: pb.PreemptExecutionCapacityRequest
    ) -> pb.PreemptExecutionCapacityResponse:
        return self._call("PreemptExecutionCapacity", request)  # type: ignore[no-any-return]

    def renew_cache_lease(self, request: pb.RenewCacheLeaseRequest) -> pb.RenewCacheLeaseResponse:
        return self._call("RenewCacheLease", request)  # type: ignore[no-any-return]

    def get_resource_snapshot(self) -> pb.GetResourceSnapshotResponse:
        return self._call("GetResourceSnapshot", pb.GetResourceSnapshotRequest())  # type: ignore[no-any-return]

    def get_cache_metrics(self) -> pb.GetCacheMetricsResponse:
        return self._call("GetCacheMetrics", pb.GetCacheMetricsRequest())  # type: ignore[no-any-return]

    def watch_execution_events(self) -> Iterator[pb.ExecutionEvent]:
        """Execution events as they happen; the first is `subscribed`. Cancel by closing the
        iterator (or the client). A reader more than 1024 events behind gets `events_dropped`."""
        stream = self._stub.WatchExecutionEvents(
            pb.WatchExecutionEventsRequest(), metadata=self._metadata
        )
        try:
            for response in stream:
                yield response.event
        except grpc.RpcError as error:
            if error.code() != _CANCELLED:
                raise from_rpc_error(error) from None
        finally:
            stream.cancel()  # type: ignore[no-untyped-call]


class AsyncExecutorClient:
    """asyncio handle, same operations as ExecutorClient, plus the step stream.

    At most `calls_per_connection` calls run on each of up to `max_connections` connections
    (a step stream or a capacity watch counts as one call while open); further calls wait in the
    client, first come first served, and that wait counts against `timeout_s`. Keep
    `calls_per_connection` at most half the executor's --max-concurrent-streams (256 by
    default): see `ferrum_client.connections` for why.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float | None = 60.0,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        session_id: str | None = None,
        calls_per_connection: int = CALLS_PER_CONNECTION,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        # Each connection is the channel's own (a local subchannel pool): by default grpc would
        # share one connection among equal channels, and the per-connection bound would not hold.
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]

        def open_channel() -> grpc.aio.Channel:
            if credentials:
                return grpc.aio.secure_channel(target, credentials, options)
            return grpc.aio.insecure_channel(target, options)

        self._pool = ConnectionPool(open_channel, calls_per_connection, max_connections)
        self.timeout_s = timeout_s
        self._metadata = call_metadata(token, session_id)

    async def __aenter__(self) -> AsyncExecutorClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection; calls still running or waiting for a slot fail with
        ClientClosedError."""
        await self._pool.close()

    @property
    def pool(self) -> ConnectionPool:
        """The connections and their call slots (in_flight, queued)."""
        return self._pool

    async def _call(self, method: str, request: Any) -> Any:
        return await self._call_within(method, request, self.timeout_s)

    async def _call_within(
        self, method: str, request: Any, timeout_s: float | None, long_lived: bool = False
    ) -> Any:
        """One call through a pooled slot within `timeout_s` (the wait for the slot included),
        retried as the module docstring says."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        attempt = 0
        while True:
            try:
                async with self._pool.slot(_remaining(deadline), long_lived=long_lived) as lane:
                    return await getattr(lane.stub, method)(
                        request, timeout=_remaining(deadline), metadata=self._metadata
                    )
            except asyncio.CancelledError:
                _raise_if_closed_under_us()
                raise
            except grpc.RpcError as error:
                delay = _retry_delay(request, error, attempt)
                if delay is None:
                    raise from_rpc_error(error) from None
            await asyncio.sleep(delay)
            attempt += 1

    async def health(self, service: str = "") -> int:
        try:
            async with self._pool.slot(self.timeout_s) as lane:
                response = await lane.health.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=self.timeout_s
                )
        except asyncio.CancelledError:
            _raise_if_closed_under_us()
            raise
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return int(response.status)

    async def get_info(self) -> pb.GetInfoResponse:
        return await self._call("GetInfo", pb.GetInfoRequest())  # type: ignore[no-any-return]

    async def get_capabilities(self) -> pb.GetCapabilitiesResponse:
        return await self._call("GetCapabilities", pb.GetCapabilitiesRequest())  # type: ignore[no-any-return]

    async def get_status(self) -> pb.GetStatusResponse:
        return await self._call("GetStatus", pb.GetStatusRequest())  # type: ignore[no-any-return]

    async def get_metrics(self) -> pb.GetMetricsResponse:
        return await self._call("GetMetrics", pb.GetMetricsRequest())  # type: ignore[no-any-return]

    async def get_kv_slot_capacity(self) -> pb.GetKvSlotCapacityResponse:
        return await self._call("GetKvSlotCapacity", pb.GetKvSlotCapacityRequest())  # type: ignore[no-any-return]

    async def warmup(self, request: pb.WarmupRequest | None = None) -> pb.WarmupResponse:
        return await self._call("Warmup", request or pb.WarmupRequest())  # type: ignore[no-any-return]

    async def prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        return await self._call("Prefill", request)  # type: ignore[no-any-return]

    async def decode(self, request: pb.DecodeRequest) -> pb.DecodeResponse:
        return await self._call("Decode", request)  # type: ignore[no-any-return]

    async def batch_prefill(self, request: pb.BatchPrefillRequest) -> pb.BatchPrefillResponse:
        return await self._call("BatchPrefill", request)  # type: ignore[no-any-return]

    async def batch_decode(self, request: pb.BatchDecodeRequest) -> pb.BatchDecodeResponse:
        return await self._call("BatchDecode", request)  # type: ignore[no-any-return]

    async def unified_batch(self, request: pb.UnifiedBatchRequest) -> pb.UnifiedBatchResponse:
        return await self._call("UnifiedBatch", request)  # type: ignore[no-any-return]

    async def forward_verify(self, request: pb.ForwardVerifyRequest) -> pb.ForwardVerifyResponse:
        return await self._call("ForwardVerify", request)  # type: ignore[no-any-return]

    async def truncate_kv(self, request: pb.TruncateKvRequest) -> pb.TruncateKvResponse:
        return await self._call("TruncateKv", request)  # type: ignore[no-any-return]

    async def reserve_kv_slots(
        self, request: pb.ReserveKvSlotsRequest
    ) -> pb.ReserveKvSlotsResponse:
        return await self._call("ReserveKvSlots", request)  # type: ignore[no-any-return]

    async def release_cache(self, request: pb.ReleaseCacheRequest) -> pb.ReleaseCacheResponse:
        return await self._call("ReleaseCache", request)  # type: ignore[no-any-return]

    async def complete_cache(self, request: pb.CompleteCacheRequest) -> pb.CompleteCacheResponse:
        return await self._call("CompleteCache", request)  # type: ignore[no-any-return]

    async def try_admit_prefill(
        self, request: pb.TryAdmitPrefillRequest
    ) -> pb.TryAdmitPrefillResponse:
        return await self._call("TryAdmitPrefill", request)  # type: ignore[no-any-return]

    async def try_admit_prefill_batch(
        self, request: pb.TryAdmitPrefillBatchRequest
    ) -> pb.TryAdmitPrefillBatchResponse:
        """Several probes in one call, decided in order until one is deferred (only where
        capabilities say supports_admission_batch)."""
        return await self._call("TryAdmitPrefillBatch", request)  # type: ignore[no-any-return]

    async def cancel_prefill_admission(
        self, request: pb.CancelPrefillAdmissionRequest
    ) -> pb.CancelPrefillAdmissionResponse:
        return await self._call("CancelPrefillAdmission", request)  # type: ignore[no-any-return]

    async def maintain_prefill_backing(
        self, request: pb.MaintainPrefillBackingRequest
    ) -> pb.MaintainPrefillBackingResponse:
        return await self._call("MaintainPrefillBacking", request)  # type: ignore[no-any-return]

    async def get_capacity_snapshot(self) -> pb.GetCapacitySnapshotResponse:
        return await self._call("GetCapacitySnapshot", pb.GetCapacitySnapshotRequest())  # type: ignore[no-any-return]

    async def wait_for_capacity_change(
        self, request: pb.WaitForCapacityChangeRequest
    ) -> pb.WaitForCapacityChangeResponse:
        # The wait can legitimately outlast the default call timeout.
        return await self._call_within("WaitForCapacityChange", request, None, long_lived=True)  # type: ignore[no-any-return]

    async def list_release_sources(
        self, request: pb.ListReleaseSourcesRequest | None = None
    ) -> pb.ListReleaseSourcesResponse:
        """One page (up to 1024 entries); pass `next_page_token` back as `page_token`."""
        request = request or pb.ListReleaseSourcesRequest()
        return await self._call("ListReleaseSources", request)  # type: ignore[no-any-return]

    async def preempt_execution_capacity(
        self, request: pb.PreemptExecutionCapacityRequest
    ) -> pb.PreemptExecutionCapacityResponse:
        return await self._call("PreemptExecutionCapacity", request)  # type: ignore[no-any-return]

    async def renew_cache_lease(
        self, request: pb.RenewCacheLeaseRequest
    ) -> pb.RenewCacheLeaseResponse:
        return await self._call("RenewCacheLease", request)  # type: ignore[no-any-return]

    async def get_resource_snapshot(self) -> pb.GetResourceSnapshotResponse:
        return await self._call("GetResourceSnapshot", pb.GetResourceSnapshotRequest())  # type: ignore[no-any-return]

    async def get_cache_metrics(self) -> pb.GetCacheMetricsResponse:
        return await self._call("GetCacheMetrics", pb.GetCacheMetricsRequest())  # type: ignore[no-any-return]

    async def watch_execution_events(self) -> AsyncIterator[pb.ExecutionEvent]:
        """Execution events as they happen; the first is `subscribed`. A reader more than 1024
        events behind gets an `events_dropped` marker (how many it missed) instead."""
        try:
            async with self._pool.slot(self.timeout_s, long_lived=True) as lane:
                stream = lane.stub.WatchExecutionEvents(
                    pb.WatchExecutionEventsRequest(), metadata=self._metadata
                )
                async for response in stream:
                    yield response.event
        except asyncio.CancelledError:
            _raise_if_closed_under_us()
            raise
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    async def watch_capacity(self) -> AsyncIterator[pb.WatchCapacityResponse]:
        """Capacity changes as they happen (the first message is the current state). The
        watch holds a call slot until the iteration ends."""
        try:
            async with self._pool.slot(self.timeout_s, long_lived=True) as lane:
                watch = lane.stub.WatchCapacity(pb.WatchCapacityRequest(), metadata=self._metadata)
                async for event in watch:
                    yield event
        except asyncio.CancelledError:
            _raise_if_closed_under_us()
            raise
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    async def watch_health(self, service: str = "") -> AsyncIterator[int]:
        """grpc.health.v1 Watch: the serving status (1 = SERVING, 2 = NOT_SERVING) now and on
        every change. The watch holds a call slot until the iteration ends."""
        try:
            async with self._pool.slot(self.timeout_s, long_lived=True) as lane:
                watch = lane.health.Watch(health_pb2.HealthCheckRequest(service=service))
                async for response in watch:
                    yield int(response.status)
        except asyncio.CancelledError:
            _raise_if_closed_under_us()
            raise
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    def step_stream(self) -> StepStream:
        """Open the hot-path stream; use `async with client.step_stream() as stream`."""
        return StepStream(self._pool, self._metadata, self.timeout_s)


class StepStream:
    """Pipelined unified steps over one bidirectional stream.

    `submit` sends a step at once and returns a future for its result, so the next step can be
    queued while the executor runs this one. Results arrive in submission order. Once the stream
    has ended (cancelled, closed, or failed because the executor went away), steps still waiting
    fail with the error that ended it and `submit` raises `StreamClosedError` at once.
    """

    def __init__(
        self,
        pool: ConnectionPool,
        metadata: Metadata | None = None,
        open_timeout_s: float | None = None,
    ) -> None:
        self._pool = pool
        self._metadata = metadata
        self._open_timeout_s = open_timeout_s
        self._outbox: asyncio.Queue[pb.StepStreamRequest | None] = asyncio.Queue()
        self._waiting: dict[int, asyncio.Future[pb.UnifiedBatchResponse]] = {}
        self._next_step_id = 1
        self._reader: asyncio.Task[None] | None = None
        self._call: Any = None
        self._slot: Slot | None = None
        # Why no step can be submitted any more (None while the stream is usable).
        self._closed: StreamClosedError | None = None

    async def __aenter__(self) -> StepStream:
        # The stream holds a call slot for its whole life; the reader gives it back.
        self._slot = await self._pool.acquire(self._open_timeout_s, long_lived=True)
        self._call = self._slot.lane.stub.StepStream(
            self._requests(),
            metadata=self._metadata,
        )
        self._reader = asyncio.ensure_future(self._read())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Half-close and wait for the answers still due. After `cancel()` (or a failure) this
        returns at once and raises nothing: the steps' futures carry the outcome. A task
        cancelled inside the block cancels the stream: nobody is left to use its answers."""
        if isinstance(exc, asyncio.CancelledError):
            self.cancel()
        if self._closed is None:
            self._closed = StreamClosedError("the step stream is closed", _CANCELLED)
            await self._outbox.put(None)
        reader = self._reader
        if reader is None:
            return
        try:
            # Waits without taking on the reader's outcome: a CancelledError here is this
            # task's own cancellation, never the stream's.
            await asyncio.wait([reader])
        except asyncio.CancelledError:
            self.cancel()  # nobody is left to read the answers
            raise
        if not reader.cancelled() and (error := reader.exception()) is not None:
            raise error

    async def _requests(self) -> AsyncIterator[pb.StepStreamRequest]:
        while (request := await self._outbox.get()) is not None:
            yield request

    async def _read(self) -> None:
        failure: ExecutorError | None = None  # None: the executor ended the stream itself
        try:
            async for response in self._call:
                future = self._waiting.pop(response.step_id, None)
                if future is None or future.done():
                    continue  # no longer awaited (the caller cancelled that future)
                if response.HasField("error"):
                    error = response.error
                    future.set_exception(from_step_error(error.code, error.message, error.reason))
                else:
                    future.set_result(response.result)
        except grpc.RpcError as error:
            failure = from_rpc_error(error)
        except asyncio.CancelledError:
            failure = ExecutorError("the step stream was cancelled", _CANCELLED)
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the reader task itself was cancelled (loop shutdown): pass it on
            # Otherwise grpc ended the iteration because the call was cancelled (`cancel()`,
            # or the client closed): the stream has ended, and that is all.
        finally:
            self._end(failure)
            if self._slot is not None:
                self._pool.release(self._slot)
                self._slot = None

    def _end(self, failure: ExecutorError | None) -> None:
        """The stream has ended: fail the steps still waiting, and every later submit."""
        if failure is None:
            failure = UnavailableError("the executor ended the step stream before answering")
            if self._closed is None:  # ended by the executor (a drain), not by the caller
                self._closed = StreamClosedError(
                    "the executor ended the step stream", failure.code, failure
                )
        elif failure.code != _CANCELLED or self._closed is None:
            cause = None if failure.code == _CANCELLED else failure
            self._closed = StreamClosedError(
                f"the step stream has ended: {failure}", failure.code, cause
            )
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(failure)
        self._waiting.clear()

    def cancel(self) -> None:
        """Abandon the stream: steps the executor has not started are dropped, and (by default)
        the executor releases the caches this stream opened or touched. Steps still waiting fail
        with CANCELLED, and `submit` raises `StreamClosedError` from now on."""
        if self._closed is None:
            self._closed = StreamClosedError("the step stream was cancelled", _CANCELLED)
        if self._call is not None:
            self._call.cancel()

    def submit(self, request: pb.UnifiedBatchRequest) -> asyncio.Future[pb.UnifiedBatchResponse]:
        """Send a step; raises `StreamClosedError` at once if the stream has ended."""
        if (closed := self._closed) is not None:
            raise StreamClosedError(str(closed), closed.code, closed.cause)
        step_id = self._next_step_id
        self._next_step_id += 1
        future: asyncio.Future[pb.UnifiedBatchResponse] = asyncio.get_running_loop().create_future()
        self._waiting[step_id] = future
        self._outbox.put_nowait(pb.StepStreamRequest(step_id=step_id, batch=request))
        return future

    async def run(self, request: pb.UnifiedBatchRequest) -> pb.UnifiedBatchResponse:
        return await self.submit(request)
