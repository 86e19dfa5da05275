"""Thin client for the ferrum executor: generated messages, typed handles, batch helpers.

Imports grpcio and protobuf only (never torch).
"""

from ferrum_client.batch import GREEDY, BatchBuilder, ItemView, SamplingOptions, item_views
from ferrum_client.errors import (
    ExecutorError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PositionMismatchError,
    ResourceExhaustedError,
    StaleExecutorError,
    UnavailableError,
)
from ferrum_client.handles import AsyncExecutorClient, ExecutorClient, StepStream
from ferrum_client.pb import executor_pb2 as pb

__all__ = [
    "GREEDY",
    "AsyncExecutorClient",
    "BatchBuilder",
    "ExecutorClient",
    "ExecutorError",
    "InternalError",
    "InvalidArgumentError",
    "ItemView",
    "NotFoundError",
    "PositionMismatchError",
    "ResourceExhaustedError",
    "SamplingOptions",
    "StaleExecutorError",
    "StepStream",
    "UnavailableError",
    "item_views",
    "pb",
]
