"""Domain errors and the one place that maps them to gRPC status codes.

Handlers raise these; the servicer turns them into status codes with short, fixed-shape
messages. Anything else becomes INTERNAL with a generic text (details go to the log only).
"""

from __future__ import annotations

import enum

import grpc


class ErrorReason(enum.IntEnum):
    """Why a call failed, where the status code alone is ambiguous (twin of pb.ErrorReason).

    Unary calls carry it as the trailing metadata REASON_METADATA (the member's name); a stream
    step carries it in StepError.reason.
    """

    UNSPECIFIED = 0
    STEP_RESULT_EVICTED = 1
    DRAINING = 2


REASON_METADATA = "ferrum-error-reason"


class ExecutorError(Exception):
    """Base class: a request the executor refuses, with the status code it maps to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: ErrorReason = ErrorReason.UNSPECIFIED

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ExecutorError):
    """Malformed regardless of state: bad token id, empty chunk, NaN temperature, ..."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ExecutorError):
    """Unknown or retired cache id, unknown request id."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ExecutorError):
    """An id is already in use with a different meaning."""

    code = grpc.StatusCode.ALREADY_EXISTS


class CapacityExhausted(ExecutorError):
    """A call that has no typed deferral could not get capacity."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class StaleInstance(ExecutorError):
    """The caller believes in an executor instance that is not this one (restart)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StepResultEvicted(ExecutorError):
    """A step id whose stored result the step ledger no longer holds: the step ran (or may have),
    and it is never run again under this id. The caller must re-read the state."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = ErrorReason.STEP_RESULT_EVICTED


class PositionMismatch(ExecutorError):
    """The scheduler's view of a sequence is out of step with the executor's: re-read, retry."""

    code = grpc.StatusCode.ABORTED


class Unavailable(ExecutorError):
    """Warming up or draining: retry on another executor."""

    code = grpc.StatusCode.UNAVAILABLE


# What a draining executor answers to new work (it still runs the requests it holds).
DRAINING_NEW_WORK = (
    "the executor is draining: it finishes the requests it holds and takes no new one; "
    "use another executor"
)


class Draining(Unavailable):
    """New work on a draining executor, which still runs the requests it holds (reason
    DRAINING tells it from an executor that refuses everything)."""

    reason = ErrorReason.DRAINING

    def __init__(self, message: str = DRAINING_NEW_WORK) -> None:
        super().__init__(message)


class ExecutorFaulted(ExecutorError):
    """A forward failed after it may have been submitted (not an out-of-memory): the device's
    state is unknown, so the executor runs nothing more until it is restarted."""

    code = grpc.StatusCode.UNAVAILABLE


class DeviceOutOfMemory(ExecutorError):
    """The device ran out of memory in the forward; nothing was committed. Retry later or with
    a smaller batch (a transactional or single-item call cannot be split by the executor)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Dropped(ExecutorError):
    """The caller went away (or its deadline passed) before the work started; nothing ran."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ExecutionFailed(ExecutorError):
    """A fault after work may have been submitted: never replay automatically."""

    code = grpc.StatusCode.INTERNAL


INTERNAL_MESSAGE = "internal error"
# Status messages travel in HTTP/2 trailers: keep them short (clients may cap headers at 8 KiB).
MAX_MESSAGE_CHARS = 512


def public_message(exc: ExecutorError) -> str:
    """The message a caller sees: bounded, and only ever the domain error's own text."""
    text = exc.message
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."
