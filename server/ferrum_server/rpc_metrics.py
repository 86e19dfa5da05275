"""A grpc.aio server interceptor that feeds the grpc_server_* metrics of `Metrics`.

For every call it counts `grpc_server_started_total`, then, once the handler is done,
`grpc_server_handled_total{grpc_code}` and `grpc_server_handling_seconds`. The code is the one
the handler set (context.set_code / context.abort), CANCELLED when the task was cancelled,
UNKNOWN for any other exception, and OK otherwise. Async handlers are wrapped in the same shape
they have (coroutine or async generator), because grpc.aio dispatches on it; sync handlers,
which this server does not use, pass through uncounted.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc
import grpc.aio

from ferrum_server.metrics import Metrics

if TYPE_CHECKING:  # the stubs make these generic; at run time they are plain classes
    _Interceptor: TypeAlias = grpc.aio.ServerInterceptor[Any, Any]
    _Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor
    _Handler = grpc.RpcMethodHandler

_CODE_BY_VALUE = {code.value[0]: code.name for code in grpc.StatusCode}
_TYPES = {
    (False, False): "unary",
    (True, False): "client_stream",
    (False, True): "server_stream",
    (True, True): "bidi_stream",
}


def _code_name(context: Any, exc: BaseException | None) -> str:
    """The status code name the call ended with."""
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        name: str | None = code.name
    elif isinstance(code, int):
        name = _CODE_BY_VALUE.get(code, "UNKNOWN")
    else:
        name = None
    if exc is None:
        return name or "OK"
    return name if name and name != "OK" else "UNKNOWN"


class RpcMetricsInterceptor(_Interceptor):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        kind = _TYPES[(bool(handler.request_streaming), bool(handler.response_streaming))]
        behaviour = handler.unary_unary or handler.unary_stream or handler.stream_unary
        behaviour = behaviour or handler.stream_stream
        wrapped = self._wrap(behaviour, method, kind)
        if wrapped is None:
            return handler
        factory = {
            "unary": grpc.unary_unary_rpc_method_handler,
            "client_stream": grpc.stream_unary_rpc_method_handler,
            "server_stream": grpc.unary_stream_rpc_method_handler,
            "bidi_stream": grpc.stream_stream_rpc_method_handler,
        }[kind]
        return factory(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _wrap(self, behaviour: Any, method: str, kind: str) -> Any:
        metrics = self.metrics

        def finish(context: Any, started: float, exc: BaseException | None) -> None:
            code = _code_name(context, exc)
            metrics.observe_rpc(method, code, time.perf_counter() - started, kind)

        if inspect.isasyncgenfunction(behaviour):

            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                metrics.rpc_start(method, kind)
                started = time.perf_counter()
                try:
                    async for response in behaviour(request, context):
                        yield response
                except BaseException as exc:
                    finish(context, started, exc)
                    raise
                finish(context, started, None)

            return stream

        if inspect.iscoroutinefunction(behaviour):

            async def call(request: Any, context: Any) -> Any:
                metrics.rpc_start(method, kind)
                started = time.perf_counter()
                try:
                    response = await behaviour(request, context)
                except BaseException as exc:
                    finish(context, started, exc)
                    raise
                finish(context, started, None)
                return response

            return call
        return None
