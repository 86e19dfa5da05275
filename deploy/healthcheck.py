"""Container health check: exit 0 iff the local executor's gRPC health service says SERVING.

Used by the image's HEALTHCHECK (Kubernetes uses native grpc probes instead). Reads
FERRUM_HEALTH_PORT when set (the plaintext health port used with TLS), else FERRUM_PORT
(default 50051), FERRUM_HEALTH_SERVICE (default "", the whole server) and
FERRUM_HEALTH_TIMEOUT_S (default 3).
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    # With TLS on, the main port refuses plaintext: probe the plaintext health port instead.
    health_port = int(os.environ.get("FERRUM_HEALTH_PORT", "-1"))
    port = health_port if health_port > 0 else int(os.environ.get("FERRUM_PORT", "50051"))
    service = os.environ.get("FERRUM_HEALTH_SERVICE", "")
    timeout = float(os.environ.get("FERRUM_HEALTH_TIMEOUT_S", "3"))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            sys.stderr.write(f"unhealthy: {exc.code().name}\n")
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        sys.stderr.write(f"unhealthy: {status}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
