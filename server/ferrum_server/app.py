"""Builds and runs the gRPC server: executor service plus grpc.health.v1."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from ferrum_client.pb import executor_pb2_grpc as pb_grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ferrum_server.config import EngineConfig, ServerConfig
from ferrum_server.engine import Engine
from ferrum_server.service import ExecutorServicer
from ferrum_server.waits import CapacityNotifier

_LOG = logging.getLogger(__name__)
SERVICE_NAME = "ferrum.executor.v1.ExecutorService"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def message_limit_bytes(engine: EngineConfig, server: ServerConfig) -> int:
    """Largest message a valid request or response can need, with headroom.

    A step carries at most max_batch_tokens token ids (<= 5 bytes each) plus per-item columns;
    a response may carry a float32 logits row per item, which the vocabulary bounds, so the
    limit grows with the batch limits rather than being a fixed 4 MiB.
    """
    if server.max_message_bytes:
        return server.max_message_bytes
    per_item = 64 + 2 * 1024  # columns, ids, a token mask for vocabularies up to 16k
    return 16 * 1024**2 + engine.max_batch_tokens * 8 + engine.max_batch_size * per_item


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    engine: Engine
    servicer: ExecutorServicer
    health: health_aio.HealthServicer

    async def mark_serving(self) -> None:
        self.servicer.accepting = True
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _SERVING)

    async def drain(self, grace_s: float) -> None:
        """Flip health, refuse new work, let in-flight calls finish within grace_s."""
        self.servicer.accepting = False
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        self.engine.shutdown()


async def start_server(
    engine_config: EngineConfig, server_config: ServerConfig, engine: Engine | None = None
) -> RunningServer:
    """Load the model, bind the port, warm up, then report SERVING."""
    engine = engine or Engine(engine_config)
    limit = message_limit_bytes(engine_config, server_config)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ]
    )
    servicer = ExecutorServicer(engine, CapacityNotifier(engine.kv, asyncio.get_running_loop()))
    pb_grpc.add_ExecutorServiceServicer_to_server(servicer, server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, _NOT_SERVING)
    address = f"{server_config.host}:{server_config.port}"
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    await server.start()
    running = RunningServer(server, port, engine, servicer, health_servicer)
    num_tokens, forward_ms = await engine.call(engine.warmup, 0)
    _LOG.info("warmup ran %d tokens in %.1f ms", num_tokens, forward_ms)
    await running.mark_serving()
    return running


async def serve(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Serve until SIGTERM/SIGINT; drain within the grace period; a second signal exits now."""
    running = await start_server(engine_config, server_config)
    _LOG.info("serving on %s:%d", server_config.host, running.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            raise SystemExit(1)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    _LOG.info("draining (grace %.1fs)", server_config.grace_s)
    await running.drain(server_config.grace_s)
