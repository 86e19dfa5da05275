"""Concurrent-call limits: a total and a per-caller share, with the health service exempt.

grpc's own `maximum_concurrent_rpcs` counts every call alike, so one caller parking waits could
make health checks and liveness probes answer RESOURCE_EXHAUSTED, and a kubelet would restart a
healthy pod. This interceptor counts instead, from a call's start to its end (a stream for its
whole life):

- every call but grpc.health.v1 (Check, Watch, List; the liveness probe is a Check) against the
  total (`--max-concurrent-rpcs`);
- and against its caller's share (`--max-concurrent-rpcs-per-caller`), the caller being
  `security.caller_identity` (a token's digest, or the `ferrum-session` header, else one
  anonymous caller), so that one caller cannot take the whole total.

A call over either limit ends at once with RESOURCE_EXHAUSTED, before its handler runs; only
that caller's call is refused. Counting happens when the handler starts, on the event loop
thread, so the check and the count are one step and a call refused elsewhere (auth) never counts.
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc
import grpc.aio

from ferrum_server import logs, security

if TYPE_CHECKING:  # the stubs make these generic; at run time they are plain classes
    _Interceptor: TypeAlias = grpc.aio.ServerInterceptor[Any, Any]
    _Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor
    _Handler = grpc.RpcMethodHandler

_LOG = logs.get(__name__)
EXEMPT_PREFIX = "/grpc.health.v1.Health/"
_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class CallCounts:
    """Calls in progress, in total and per caller; 0 as a limit means none."""

    def __init__(self, total: int, per_caller: int) -> None:
        self.total_limit = total
        self.per_caller_limit = per_caller
        self.total = 0
        self.by_caller: collections.Counter[str] = collections.Counter()

    def refusal(self, caller: str) -> str | None:
        """Why a new call of `caller` is refused now, or None when it may start."""
        if self.total_limit and self.total >= self.total_limit:
            return f"the executor is at its limit of {self.total_limit} concurrent calls"
        if self.per_caller_limit and self.by_caller[caller] >= self.per_caller_limit:
            return f"this caller is at its limit of {self.per_caller_limit} concurrent calls"
        return None

    def enter(self, caller: str) -> None:
        self.total += 1
        self.by_caller[caller] += 1

    def leave(self, caller: str) -> None:
        self.total -= 1
        self.by_caller[caller] -= 1
        if not self.by_caller[caller]:
            del self.by_caller[caller]


class CallLimitInterceptor(_Interceptor):
    def __init__(self, total: int, per_caller: int) -> None:
        self.counts = CallCounts(total, per_caller)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(EXEMPT_PREFIX):
            return handler
        try:
            caller = security.caller_identity(handler_call_details.invocation_metadata)
        except ValueError as exc:
            return security.refusal(handler, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        shape = (bool(handler.request_streaming), bool(handler.response_streaming))
        behaviour = handler.unary_unary or handler.unary_stream or handler.stream_unary
        behaviour = behaviour or handler.stream_stream
        return _FACTORIES[shape](
            self._counted(behaviour, method, caller),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _counted(self, behaviour: Any, method: str, caller: str) -> Any:
        """The handler in its own shape (grpc.aio dispatches on it), counted while it runs."""
        counts = self.counts

        async def admit(context: Any) -> None:
            reason = counts.refusal(caller)
            if reason is not None:
                _LOG.info("rpc_refused", method=method, code="RESOURCE_EXHAUSTED", reason=reason)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
            counts.enter(caller)

        if inspect.isasyncgenfunction(behaviour):

            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                await admit(context)
                try:
                    async for response in behaviour(request, context):
                        yield response
                finally:
                    counts.leave(caller)

            return stream

        async def call(request: Any, context: Any) -> Any:
            await admit(context)
            try:
                return await behaviour(request, context)
            finally:
                counts.leave(caller)

        return call
