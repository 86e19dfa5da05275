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
    "GetResourceSnapshot",
    "GetCacheMetrics",
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


# A caller-chosen session id, sent on every call when set: the executor keeps step ids (and
# other per-caller state) per session, so two schedulers never see each other's stored results.
# Under token auth it refines the token's scope for step ids.
SESSION_HEADER = "ferrum-session"
MAX_SESSION_BYTES = 256
Metadata = tuple[tuple[str, str], ...]


def call_metadata(token: str | None = None, session_id: str | None = None) -> Metadata | None:
    """The metadata every call of a handle carries: the bearer token and the session id."""
    if session_id is not None and not 0 < len(session_id.encode()) <= MAX_SESSION_BYTES:
        raise ValueError(f"session_id must be 1 to {MAX_SESSION_BYTES} bytes")
    metadata: Metadata = ()
    if token:
        metadata += (("authorization", f"Bearer {token}"),)
    if session_id:
        metadata += ((SESSION_HEADER, session_id),)
    return metadata or None


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
