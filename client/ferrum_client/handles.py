"""Typed remote handles to one executor: `ExecutorClient` (blocking) and
`AsyncExecutorClient` (asyncio). Both mirror the executor operations one to one, take and
return the generated protobuf messages, and raise `ferrum_client.errors` exceptions.

Security: pass `credentials` (see `ferrum_client.channel.tls_credentials`) for TLS / mTLS and
`token` for bearer-token auth (sent as `authorization` metadata; use it over TLS or loopback).
`session_id` (sent as `ferrum-session` metadata) names the caller's session: the executor keeps
step ids per caller, so give each scheduler its own, stable across its reconnects.

Retries: read-only calls are retried by the channel on UNAVAILABLE. A mutating call is retried
(on UNAVAILABLE, within the same overall timeout) only when it carries a non-zero `step_id`,
because the executor then runs it at most once and replays the stored result.
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
from ferrum_client.errors import ExecutorError, from_rpc_error, from_step_error
from ferrum_client.pb import executor_pb2 as pb
from ferrum_client.pb import executor_pb2_grpc as pb_grpc

R = TypeVar("R")
_CANCELLED = grpc.StatusCode.CANCELLED


def _retry_delay(request: Any, error: grpc.RpcError, attempt: int) -> float | None:
    """Seconds to wait before retrying a step-id call, or None when it must not be retried."""
    code = error.code() if hasattr(error, "code") else None
    if not getattr(request, "step_id", 0) or code not in STEP_RETRYABLE:
        return None
    if attempt + 1 >= STEP_RETRY_ATTEMPTS:
        return None
    ceiling = min(STEP_RETRY_MAX_BACKOFF_S, STEP_RETRY_INITIAL_BACKOFF_S * 2**attempt)
    return random.uniform(0, ceiling)


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
    """asyncio handle, same operations as ExecutorClient, plus the step stream."""

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
            grpc.aio.secure_channel(target, credentials, options)
            if credentials
            else grpc.aio.insecure_channel(target, options)
        )
        self._stub = pb_grpc.ExecutorServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
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
        await self._channel.close(None)

    async def _call(self, method: str, request: Any) -> Any:
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        attempt = 0
        while True:
            try:
                return await getattr(self._stub, method)(
                    request, timeout=_remaining(deadline), metadata=self._metadata
                )
            except grpc.RpcError as error:
                delay = _retry_delay(request, error, attempt)
                if delay is None:
                    raise from_rpc_error(error) from None
            await asyncio.sleep(delay)
            attempt += 1

    async def health(self, service: str = "") -> int:
        try:
            response = await self._health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self.timeout_s
            )
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
        try:
            return await self._stub.WaitForCapacityChange(
                request, timeout=None, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

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
            stream = self._stub.WatchExecutionEvents(
                pb.WatchExecutionEventsRequest(), metadata=self._metadata
            )
            async for response in stream:
                yield response.event
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    async def watch_capacity(self) -> AsyncIterator[pb.WatchCapacityResponse]:
        """Capacity changes as they happen (the first message is the current state)."""
        try:
            watch = self._stub.WatchCapacity(pb.WatchCapacityRequest(), metadata=self._metadata)
            async for event in watch:
                yield event
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    def step_stream(self) -> StepStream:
        """Open the hot-path stream; use `async with client.step_stream() as stream`."""
        return StepStream(self._stub, self._metadata)


class StepStream:
    """Pipelined unified steps over one bidirectional stream.

    `submit` sends a step at once and returns a future for its result, so the next step can be
    queued while the executor runs this one. Results arrive in submission order.
    """

    def __init__(self, stub: pb_grpc.ExecutorServiceStub, metadata: Metadata | None = None) -> None:
        self._stub = stub
        self._metadata = metadata
        self._outbox: asyncio.Queue[pb.StepStreamRequest | None] = asyncio.Queue()
        self._waiting: dict[int, asyncio.Future[pb.UnifiedBatchResponse]] = {}
        self._next_step_id = 1
        self._reader: asyncio.Task[None] | None = None
        self._call: Any = None

    async def __aenter__(self) -> StepStream:
        self._call = self._stub.StepStream(
            self._requests(),  # type: ignore[arg-type]
            metadata=self._metadata,
        )
        self._reader = asyncio.ensure_future(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._outbox.put(None)
        if self._reader is not None:
            await self._reader

    async def _requests(self) -> AsyncIterator[pb.StepStreamRequest]:
        while (request := await self._outbox.get()) is not None:
            yield request

    async def _read(self) -> None:
        try:
            async for response in self._call:
                future = self._waiting.pop(response.step_id)
                if response.HasField("error"):
                    error = response.error
                    future.set_exception(from_step_error(error.code, error.message, error.reason))
                else:
                    future.set_result(response.result)
        except grpc.RpcError as error:
            self._fail_waiting(from_rpc_error(error))
        except asyncio.CancelledError:
            self._fail_waiting(ExecutorError("the step stream was cancelled", _CANCELLED))
            raise

    def _fail_waiting(self, failure: ExecutorError) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(failure)
        self._waiting.clear()

    def cancel(self) -> None:
        """Abandon the stream: steps the executor has not started are dropped, and (by default)
        the executor releases the caches this stream opened or touched."""
        if self._call is not None:
            self._call.cancel()

    def submit(self, request: pb.UnifiedBatchRequest) -> asyncio.Future[pb.UnifiedBatchResponse]:
        step_id = self._next_step_id
        self._next_step_id += 1
        future: asyncio.Future[pb.UnifiedBatchResponse] = asyncio.get_running_loop().create_future()
        self._waiting[step_id] = future
        self._outbox.put_nowait(pb.StepStreamRequest(step_id=step_id, batch=request))
        return future

    async def run(self, request: pb.UnifiedBatchRequest) -> pb.UnifiedBatchResponse:
        return await self.submit(request)
