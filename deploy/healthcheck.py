"""Container health check: exit 0 iff the local executor's gRPC health service says SERVING.

Used by the image's HEALTHCHECK (Kubernetes uses native grpc probes instead). Where to connect:

1. the probe file the server writes once SERVING (FERRUM_PROBE_FILE, set by the image; format in
   server/ferrum_server/probe_file.py), so `serve --port N` / `--health-port M` / `--host H`
   given as flags are followed: the plaintext health port when one is on, else the gRPC port;
2. without that file (the server is not SERVING yet, or could not write it), the environment the
   flags also read: FERRUM_HEALTH_PORT when set (the plaintext health port used with TLS), else
   FERRUM_PORT (default 50051), on 127.0.0.1.

Also read: FERRUM_HEALTH_SERVICE (default "", the whole server) and FERRUM_HEALTH_TIMEOUT_S
(default 3). Kept to grpc and the standard library: it runs every 15 s.
"""

from __future__ import annotations

import json
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def _from_probe_file(path: str) -> str | None:
    """host:port from the server's probe file, or None when there is none to read."""
    try:
        with open(path) as f:
            target = json.load(f)
        health_port, port = int(target.get("health_port", -1)), int(target["port"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # none yet, or not one the server wrote: use the environment
    if health_port <= 0 and target.get("tls"):
        # The gRPC port wants TLS; this check speaks plaintext only.
        sys.stderr.write("unhealthy: TLS is on without --health-port; nothing plaintext to probe\n")
    host = str(target.get("host", ""))
    if host in _WILDCARDS:
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{health_port if health_port > 0 else port}"


def _from_environment() -> str:
    # With TLS on, the main port refuses plaintext: probe the plaintext health port instead.
    health_port = int(os.environ.get("FERRUM_HEALTH_PORT", "-1"))
    port = health_port if health_port > 0 else int(os.environ.get("FERRUM_PORT", "50051"))
    return f"127.0.0.1:{port}"


def target() -> str:
    probe_file = os.environ.get("FERRUM_PROBE_FILE", "")
    return (probe_file and _from_probe_file(probe_file)) or _from_environment()


def main() -> int:
    service = os.environ.get("FERRUM_HEALTH_SERVICE", "")
    timeout = float(os.environ.get("FERRUM_HEALTH_TIMEOUT_S", "3"))
    address = target()
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            sys.stderr.write(f"unhealthy: {exc.code().name} from {address}\n")
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        sys.stderr.write(f"unhealthy: {status} from {address}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
