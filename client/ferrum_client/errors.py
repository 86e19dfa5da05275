"""Typed exceptions for executor status codes."""

from __future__ import annotations

from typing import Any

import grpc

from ferrum_client.pb import executor_pb2 as pb


class ExecutorError(Exception):
    """An executor call failed; `code` is the gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgumentError(ExecutorError):
    """The request is malformed; do not retry."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(ExecutorError):
    """Unknown or released cache id."""

    code = grpc.StatusCode.NOT_FOUND


class StaleExecutorError(ExecutorError):
    """The executor restarted since the caller last synced (FAILED_PRECONDITION)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StepResultEvictedError(ExecutorError):
    """FAILED_PRECONDITION with reason STEP_RESULT_EVICTED: the step id was used, but the
    executor no longer holds its result. The step ran (or may have) and is never run again under
    this id: re-read the state (GetStatus, ListReleaseSources) before going on."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class PositionMismatchError(ExecutorError):
    """The caller's view of a sequence is out of step (ABORTED): re-read and retry the step."""

    code = grpc.StatusCode.ABORTED


class AlreadyExistsError(ExecutorError):
    """A step id was reused for a different request (a caller bug)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class DeadlineExceededError(ExecutorError):
    """The deadline passed; if the step had not started, it never will."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnauthenticatedError(ExecutorError):
    """Missing or invalid token."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(ExecutorError):
    """The token's role does not allow this method."""

    code = grpc.StatusCode.PERMISSION_DENIED


class UnavailableError(ExecutorError):
    """Warming up, draining or unreachable: retry elsewhere or later."""

    code = grpc.StatusCode.UNAVAILABLE


class ExecutorDrainingError(UnavailableError):
    """UNAVAILABLE with reason DRAINING: the executor takes no new request but still runs the
    requests it holds to their end. Place new work elsewhere; keep stepping the running ones."""

    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhaustedError(ExecutorError):
    """A size or concurrency limit was hit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class InternalError(ExecutorError):
    """A fault after work may have been submitted: never replay automatically."""

    code = grpc.StatusCode.INTERNAL


class ClientClosedError(ExecutorError):
    """The client was closed before or while the call ran (it was cancelled locally)."""

    code = grpc.StatusCode.CANCELLED


class StreamClosedError(ExecutorError):
    """A step was submitted on a step stream that has ended: open a new stream.

    `code` is why it ended: CANCELLED when the caller cancelled or closed it, otherwise the code
    of the failure that ended it (UNAVAILABLE when the executor went away), which is `cause`.
    """

    def __init__(
        self, message: str, code: grpc.StatusCode, cause: ExecutorError | None = None
    ) -> None:
        super().__init__(message, code)
        self.cause = cause


_BY_CODE: dict[grpc.StatusCode, type[ExecutorError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        StaleExecutorError,
        PositionMismatchError,
        UnavailableError,
        ResourceExhaustedError,
        InternalError,
        AlreadyExistsError,
        DeadlineExceededError,
        UnauthenticatedError,
        PermissionDeniedError,
    )
}


# Typed reasons (pb.ErrorReason names without the prefix), where the code alone is ambiguous.
# Unary calls carry the name in this trailing metadata; stream steps in StepError.reason.
REASON_METADATA = "ferrum-error-reason"
_BY_REASON: dict[str, type[ExecutorError]] = {
    "STEP_RESULT_EVICTED": StepResultEvictedError,
    "DRAINING": ExecutorDrainingError,
}


def from_status(code: grpc.StatusCode, message: str, reason: str = "") -> ExecutorError:
    typed = _BY_REASON.get(reason)
    if typed is not None and typed.code == code:
        return typed(message)
    cls = _BY_CODE.get(code, ExecutorError)
    return cls(message, code) if cls is ExecutorError else cls(message)


def _reason(error: grpc.RpcError) -> str:
    # (key, value) pairs: namedtuples from the blocking channel, a Metadata object from aio.
    trailers: Any = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == REASON_METADATA:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


def from_rpc_error(error: grpc.RpcError) -> ExecutorError:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return from_status(code, details or "", _reason(error))


def from_step_error(code: int, message: str, reason: int = 0) -> ExecutorError:
    known = reason in pb.ErrorReason.values()
    name = pb.ErrorReason.Name(pb.ErrorReason.ValueType(reason)) if known and reason else ""
    name = name.removeprefix("ERROR_REASON_")
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return from_status(status, message, name)
    return ExecutorError(message)
