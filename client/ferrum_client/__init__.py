"""Thin client for the ferrum executor: generated messages, typed handles, batch helpers.

Imports grpcio and protobuf only (never torch).
"""

from ferrum_client.batch import GREEDY, BatchBuilder, ItemView, SamplingOptions, item_views
from ferrum_client.channel import tls_credentials
from ferrum_client.errors import (
    AlreadyExistsError,
    ClientClosedError,
    DeadlineExceededError,
    ExecutorDrainingError,
    ExecutorError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    PositionMismatchError,
    ResourceExhaustedError,
    StaleExecutorError,
    StepResultEvictedError,
    StreamClosedError,
    UnauthenticatedError,
    UnavailableError,
)
from ferrum_client.handles import AsyncExecutorClient, ExecutorClient, StepStream
from ferrum_client.pb import executor_pb2 as pb

__all__ = [
    "GREEDY",
    "AlreadyExistsError",
    "AsyncExecutorClient",
    "BatchBuilder",
    "ClientClosedError",
    "DeadlineExceededError",
    "ExecutorClient",
    "ExecutorDrainingError",
    "ExecutorError",
    "InternalError",
    "InvalidArgumentError",
    "ItemView",
    "NotFoundError",
    "PermissionDeniedError",
    "PositionMismatchError",
    "ResourceExhaustedError",
    "SamplingOptions",
    "StaleExecutorError",
    "StepResultEvictedError",
    "StepStream",
    "StreamClosedError",
    "UnauthenticatedError",
    "UnavailableError",
    "item_views",
    "pb",
    "tls_credentials",
]
