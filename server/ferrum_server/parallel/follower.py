"""A follower rank (1..N-1) of a split model: it loads its shard, then repeats what rank 0
sends (``plan``) on its own heads until told to stop or the group fails.

It has no RPCs of its own: in the one-process-per-rank launch mode it serves only gRPC health
(SERVING while it follows; NOT_SERVING once the group failed) and Prometheus metrics, so the
orchestrator can probe every container; a spawned follower serves neither (its rank 0 watches
it through the group). Whenever the group fails (rank 0 gone, a collective timed out) the
process exits non-zero, so the pod is restarted as a whole.

Run as ``python -m ferrum_server.parallel.follower CONFIG_JSON`` by a spawning rank 0.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ferrum_server import logs
from ferrum_server.config import EngineConfig, ServerConfig
from ferrum_server.kv.storage import HostKv, KvStorage
from ferrum_server.metrics import Metrics
from ferrum_server.parallel.launch import config_from_json, join_group, leave_group
from ferrum_server.parallel.plan import Op, PlanReceiver, Received, forward_plan
from ferrum_server.process_gc import freeze_startup_objects
from ferrum_server.runner import ModelRunner
from ferrum_server.startup import BuiltParts, build_parts

_LOG = logs.get(__name__)

EXIT_STOPPED = 0  # rank 0 stopped cleanly
EXIT_GROUP_FAILED = 1  # a collective failed: rank 0 or another rank died or hung


@dataclass
class Follower:
    """The state a follower keeps between operations: its runner and pool, and the host
    copies of swapped-out blocks (bounded by rank 0's swap space: it drops every copy it
    drops)."""

    runner: ModelRunner
    storage: KvStorage
    swapped: dict[int, HostKv] = field(default_factory=dict)
    operations: int = 0

    @classmethod
    def of(cls, parts: BuiltParts) -> Follower:
        return cls(parts.runner, KvStorage(parts.kv_cache))

    @torch.inference_mode()
    def apply(self, received: Received) -> bool:
        """Repeat one operation; False once rank 0 said stop."""
        op, header, payload = received.op, received.header, received.payload
        self.operations += 1
        if op == Op.FORWARD:
            self.runner.run_plan(forward_plan(received))
            self.runner.model.tp.clock.take()
        elif op == Op.COPY_BLOCKS:
            assert payload is not None
            values = payload.tolist()
            count = header[1]
            self.storage.copy_blocks(list(zip(values[:count], values[count:], strict=True)))
        elif op == Op.SWAP_OUT:
            assert payload is not None
            self.swapped[header[1]] = self.storage.swap_out(payload.tolist(), key=header[1])
        elif op == Op.SWAP_IN:
            assert payload is not None
            self.storage.swap_in(self.swapped.pop(header[1]), payload.tolist())
        elif op == Op.SWAP_DROP:
            assert payload is not None
            for key in payload.tolist():
                self.swapped.pop(key, None)
        elif op == Op.STOP:
            return False
        return True


def follow(config: EngineConfig, server: ServerConfig | None = None) -> int:
    """Join the group, build this rank's parts, then follow rank 0; the exit code."""
    health_server: grpc.Server | None = None
    status: health.HealthServicer | None = None
    metrics: Metrics | None = None
    if server is not None:  # one process per rank: the orchestrator probes this container
        status = health.HealthServicer()
        for name in ("", "ferrum.executor.v1.ExecutorService"):
            status.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(status, health_server)
        health_server.add_insecure_port(f"{server.host}:{server.port}")
        health_server.start()
        metrics = Metrics()
        if server.metrics_port >= 0:
            metrics.start_http_server(server.metrics_port, server.metrics_bind_host)
    _keep_following_on_signals()
    code = EXIT_GROUP_FAILED
    try:
        tp = join_group(config)
        parts = build_parts(config, instance_id=0, tp=tp)
        freeze_startup_objects()  # follow() runs as a rank's own process (the CLI's, launch's)
        if metrics is not None:
            metrics.set_memory_plan(parts.memory_plan.parts(), 0)
            metrics.set_rank_memory_plans(parts.rank_plans[tp.rank : tp.rank + 1], tp.rank)
            metrics.set_ready(True)
        if status is not None:
            status.set("", health_pb2.HealthCheckResponse.SERVING)
        _LOG.info("follower_ready", rank=tp.rank, kv_blocks=parts.memory_plan.num_blocks)
        code = _follow(Follower.of(parts), PlanReceiver(tp, parts.device))
    except Exception as exc:  # the group is gone or never formed: the pod restarts
        _LOG.error("follower_failed", error=type(exc).__name__, detail=str(exc)[:300])
    finally:
        if status is not None:
            status.enter_graceful_shutdown()
        if metrics is not None:
            metrics.set_ready(False)
        if health_server is not None:
            health_server.stop(0)
        if code == EXIT_STOPPED:
            leave_group()
    return code


def _keep_following_on_signals() -> None:
    """SIGTERM and SIGINT reach every rank of a pod (or of a terminal's process group) at once.
    A follower that exited then would fail rank 0's last steps while it drains: it keeps
    following until rank 0 says stop, or the group fails (rank 0 gone, a timeout)."""

    def note(signum: int, frame: object) -> None:
        _LOG.info("follower_signal", signal=signal.Signals(signum).name, action="follow_until_stop")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, note)


def _follow(follower: Follower, receiver: PlanReceiver) -> int:
    started = time.monotonic()
    while follower.apply(receiver.next()):
        pass
    _LOG.info(
        "follower_stopped",
        operations=follower.operations,
        seconds=round(time.monotonic() - started, 1),
    )
    return EXIT_STOPPED


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m ferrum_server.parallel.follower CONFIG_JSON\n")
        return 2
    logs.configure("info", "auto")
    return follow(config_from_json(argv[0]))


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # A spawned follower holds nothing the OS does not free: skip the interpreter's teardown
    # (about a second with torch loaded), which rank 0's stop waits for.
    os._exit(code)
