"""Channel options shared by the sync and asyncio handles."""

from __future__ import annotations

import json
import pathlib

import grpc

# Generous message limits (the server enforces its own, derived from its batch limits).
MAX_MESSAGE_BYTES = 256 * 1024**2

# Retry only what is safe: UNAVAILABLE on read-only methods. Execution and release calls are
# never retried by the channel, whose policy cannot look at the request: a retried step without a
# step id could run twice. Mutating calls that carry a step id are retried by the handles
# instead (see `retry_step_call` in handles.py); the executor deduplicates them.
_READ_ONLY = (
    "GetInfo",
    "GetCapabilities",
    "GetStatus",
    "GetMetrics",
    "GetKvSlotCapacity",
    "GetCapacitySnapshot",
    "ListReleaseSources",
)
SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [
                    {"service": "ferrum.executor.v1.ExecutorService", "method": m}
                    for m in _READ_ONLY
                ],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.service_config", SERVICE_CONFIG),
    ("grpc.enable_retries", 1),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]

# Handle-level retries of mutating calls that carry a step id (exactly-once on the executor).
STEP_RETRY_ATTEMPTS = 4
STEP_RETRY_INITIAL_BACKOFF_S = 0.05
STEP_RETRY_MAX_BACKOFF_S = 1.0
# Only "not processed, or processed and stored": UNAVAILABLE (connection lost, draining).
STEP_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


def tls_credentials(
    root_ca: bytes | str | pathlib.Path | None = None,
    client_cert: bytes | str | pathlib.Path | None = None,
    client_key: bytes | str | pathlib.Path | None = None,
) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM bytes or file paths; a client cert and key for mTLS.

    root_ca None trusts the system roots.
    """

    def pem(value: bytes | str | pathlib.Path | None) -> bytes | None:
        if value is None or isinstance(value, bytes):
            return value
        return pathlib.Path(value).read_bytes()

    return grpc.ssl_channel_credentials(pem(root_ca), pem(client_key), pem(client_cert))
