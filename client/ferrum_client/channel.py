"""Channel options shared by the sync and asyncio handles."""

from __future__ import annotations

import json

# Generous message limits (the server enforces its own, derived from its batch limits).
MAX_MESSAGE_BYTES = 256 * 1024**2

# Retry only what is safe: UNAVAILABLE on read-only methods. Execution and release calls are
# never retried by the channel (a retried step could run twice); schedulers decide.
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
