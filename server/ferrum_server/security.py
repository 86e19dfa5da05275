"""Transport security and caller authentication.

TLS when a certificate and key are configured; mutual TLS when a client CA is configured too
(clients without a certificate signed by that CA fail the handshake). Optional bearer tokens,
checked by a server interceptor: the token file holds `role:token` lines, role `read` (Get*,
Watch*, WaitForCapacityChange, ListReleaseSources) or `execute` (every method). grpc.health.v1
never needs a token, so probes work; with TLS on, a plaintext health-only port serves them.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from ferrum_server import logs
from ferrum_server.config_flags import flag

if TYPE_CHECKING:  # the stubs make these generic; at run time they are plain classes
    _Interceptor: TypeAlias = grpc.aio.ServerInterceptor[Any, Any]
    _Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor
    _Handler = grpc.RpcMethodHandler

ROLES = ("read", "execute")
_SERVICE = "/ferrum.executor.v1.ExecutorService/"
_READ_METHODS = frozenset(
    _SERVICE + name
    for name in (
        "GetInfo",
        "GetCapabilities",
        "GetStatus",
        "GetMetrics",
        "GetKvSlotCapacity",
        "GetCapacitySnapshot",
        "WaitForCapacityChange",
        "WatchCapacity",
        "ListReleaseSources",
        "GetResourceSnapshot",
        "GetCacheMetrics",
        "WatchExecutionEvents",
    )
)
_LOG = logs.get(__name__)
_OPEN_PREFIX = "/grpc.health.v1.Health/"
_AUTH_HEADER = "authorization"
# A caller without a token may name its session, so that what the executor keeps per caller
# (step ids, limits) is kept apart from other callers'. Longer values are refused.
SESSION_HEADER = "ferrum-session"
MAX_SESSION_BYTES = 256
ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """Paths only (never secrets themselves), so the config can be logged at start."""

    tls_cert: str = field(
        default="", metadata=flag("PEM certificate chain; with --tls-key turns TLS on")
    )
    tls_key: str = field(default="", metadata=flag("PEM private key of --tls-cert"))
    # Set = mutual TLS.
    tls_client_ca: str = field(
        default="",
        metadata=flag("PEM CA bundle client certificates must chain to (mutual TLS)"),
    )
    auth_token_file: str = field(
        default="",
        metadata=flag("file of role:token lines (roles read, execute); '' = off"),
    )

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)


def _read(path: str, what: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file: {exc.strerror}") from None


def server_credentials(config: SecurityConfig) -> grpc.ServerCredentials | None:
    if not config.tls:
        return None
    key = _read(config.tls_key, "TLS key")
    chain = _read(config.tls_cert, "TLS certificate")
    client_ca = _read(config.tls_client_ca, "TLS client CA") if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, chain)],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def load_tokens(path: str) -> list[tuple[str, bytes]]:
    """(role, token) pairs from a `role:token` file; blank lines and `#` comments skipped."""
    tokens: list[tuple[str, bytes]] = []
    for number, line in enumerate(_read(path, "auth token").decode().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        role, sep, token = line.partition(":")
        if not sep or role not in ROLES or not token:
            # The line number only: the line itself may be a secret.
            raise ValueError(f"auth token file line {number}: expected read:TOKEN or execute:TOKEN")
        tokens.append((role, token.encode()))
    if not tokens:
        raise ValueError("the auth token file holds no token")
    return tokens


def caller_identity(metadata: Any) -> str:
    """Who is calling, for what the executor keeps per caller (never the secret itself).

    With a bearer token: a digest of the token (the interceptor has already checked it). Without
    one: the caller-chosen `ferrum-session` header, or ANONYMOUS (every such caller is one).
    A session header longer than MAX_SESSION_BYTES raises ValueError.
    """
    session = ""
    for key, value in metadata or ():
        text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        if key == _AUTH_HEADER and text.startswith("Bearer "):
            digest = hashlib.blake2b(text[len("Bearer ") :].encode(), digest_size=8)
            return "token:" + digest.hexdigest()
        if key == SESSION_HEADER:
            session = text
    if len(session.encode()) > MAX_SESSION_BYTES:
        raise ValueError(f"the {SESSION_HEADER} header is longer than {MAX_SESSION_BYTES} bytes")
    return "session:" + session if session else ANONYMOUS


def required_role(method: str) -> str | None:
    """The role a method needs; None for the health service (always open)."""
    if method.startswith(_OPEN_PREFIX):
        return None
    return "read" if method in _READ_METHODS else "execute"


class TokenAuthInterceptor(_Interceptor):
    """Refuses calls without a valid `authorization: Bearer <token>` for the method's role."""

    def __init__(self, tokens: list[tuple[str, bytes]]) -> None:
        self._tokens = tokens

    def role_of(self, presented: bytes) -> str | None:
        # Compare against every token, without stopping early, so the time taken does not
        # reveal which (or whether a) token matched.
        role = None
        for candidate_role, token in self._tokens:
            if hmac.compare_digest(presented, token) and role != "execute":
                role = candidate_role
        return role

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler:
        needed = required_role(handler_call_details.method)
        handler = await continuation(handler_call_details)
        if needed is None or handler is None:
            return handler
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == _AUTH_HEADER:
                text = value.decode() if isinstance(value, bytes) else value
                if text.startswith("Bearer "):
                    presented = text[len("Bearer ") :].encode()
        role = self.role_of(presented) if presented else None
        if role is None:
            # Logged without the token; the refusal is counted by the RPC metrics
            # (grpc_server_handled_total with its code), which wrap this interceptor.
            _LOG.warning(
                "auth_refused",
                method=handler_call_details.method,
                code="UNAUTHENTICATED",
                reason="invalid token" if presented else "no token",
            )
            return refusal(handler, grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")
        if needed == "execute" and role != "execute":
            _LOG.warning(
                "auth_refused",
                method=handler_call_details.method,
                code="PERMISSION_DENIED",
                reason=f"a {role} token on an execute method",
            )
            return refusal(handler, grpc.StatusCode.PERMISSION_DENIED, "token lacks this role")
        return handler


def refusal(handler: _Handler, code: grpc.StatusCode, message: str) -> _Handler:
    """A handler of the same shape as `handler` that aborts before reading anything."""

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator, as grpc.aio expects

    if handler.response_streaming:
        behaviour: Callable[..., Any] = streaming
        factory = (
            grpc.stream_stream_rpc_method_handler
            if handler.request_streaming
            else grpc.unary_stream_rpc_method_handler
        )
    else:
        behaviour = unary
        factory = (
            grpc.stream_unary_rpc_method_handler
            if handler.request_streaming
            else grpc.unary_unary_rpc_method_handler
        )
    return factory(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class _Malformed:
    """Stands in for a request whose bytes did not parse."""


_MALFORMED = _Malformed()
_MALFORMED_TEXT = "malformed request message"


class MalformedRequestInterceptor(_Interceptor):
    """Answers undecodable requests with INVALID_ARGUMENT and a fixed text.

    Left alone, grpc.aio reports a failed parse as UNKNOWN with the parser's exception class and
    text in the status message; this keeps internals out of replies and names the real cause.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except DecodeError:
                return _MALFORMED

        if handler.request_streaming:
            behaviour = handler.stream_stream or handler.stream_unary
            wrapped = _guard_stream(behaviour, bool(handler.response_streaming))
        else:
            behaviour = handler.unary_stream or handler.unary_unary
            wrapped = _guard_unary(behaviour, bool(handler.response_streaming))
        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(bool(handler.request_streaming), bool(handler.response_streaming))]
        return factory(
            wrapped,
            request_deserializer=deserialize,
            response_serializer=handler.response_serializer,
        )


def _yields(behaviour: Any) -> bool:
    """Whether a streaming handler yields its responses. The other shape grpc.aio allows writes
    them with `context.write` and returns (the standard health servicer's Watch does)."""
    return inspect.isasyncgenfunction(behaviour)


def _guard_unary(behaviour: Any, streaming: bool) -> Any:
    if streaming and _yields(behaviour):

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            if request is _MALFORMED:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED_TEXT)
            async for response in behaviour(request, context):
                yield response

        return stream

    async def unary(request: Any, context: Any) -> Any:
        if request is _MALFORMED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED_TEXT)
        return await behaviour(request, context)

    return unary


def _guard_stream(behaviour: Any, streaming: bool) -> Any:
    def checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async def iterate() -> AsyncIterator[Any]:
            async for request in requests:
                if request is _MALFORMED:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED_TEXT)
                yield request

        return iterate()

    if streaming and _yields(behaviour):

        async def stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async for response in behaviour(checked(requests, context), context):
                yield response

        return stream

    async def unary(requests: AsyncIterator[Any], context: Any) -> Any:
        return await behaviour(checked(requests, context), context)

    return unary
