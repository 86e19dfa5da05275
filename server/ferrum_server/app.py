"""Builds and runs the gRPC server: executor service, grpc.health.v1, metrics, drain."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from ferrum_client.pb import executor_pb2_grpc as pb_grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ferrum_server import logs, security
from ferrum_server.call_limits import CallLimitInterceptor
from ferrum_server.capacity_notifier import CapacityNotifier
from ferrum_server.config import EngineConfig, ServerConfig
from ferrum_server.engine import Engine
from ferrum_server.metrics import Metrics
from ferrum_server.rpc_metrics import RpcMetricsInterceptor
from ferrum_server.service import ExecutorServicer
from ferrum_server.validate import MAX_ID_BYTES

_LOG = logs.get(__name__)
SERVICE_NAME = "ferrum.executor.v1.ExecutorService"
# SERVING while the engine thread answers heartbeats: the liveness probe's service.
LIVENESS_SERVICE = "ferrum.executor.v1.Liveness"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# A drain's closing phase gives the calls in flight at least this long, even when the finishing
# phase used the whole grace period (a step started just before the deadline still answers).
CLOSE_GRACE_MIN_S = 2.0
# A split model's ranks prove each other alive at least this often while idle (and a quarter of
# the collective timeout at most), so a dead follower is found within seconds.
GROUP_PING_MAX_S = 2.0
# After a split model's group failed: how long the calls in flight get to send their answers.
ABORT_GRACE_S = 1.0


_GRPC_MAX_MESSAGE = 2**31 - 1
_BASE_MESSAGE_BYTES = 1024**2  # small calls, headers of every message, slack


def message_limits(engine: Engine, server: ServerConfig) -> tuple[int, int]:
    """(receive, send) limits: the largest message a valid request / response can need.

    A request carries at most max(batch tokens, sequence length) token ids (a prompt travels
    whole in Prefill and TryAdmitPrefill), <= 5 bytes each, plus per-item columns, two ids and
    a token mask of ceil(vocab / 8) bytes. A TryAdmitPrefillBatch's probes carry at most that
    many tokens or 65,536 (capacity.admission_batch_tokens): 320 KiB, within the base. A
    response carries at most one float32 logits row per output position (max(batch tokens,
    batch size) rows) plus top log-probabilities. Both are doubled for encoding overhead; an
    explicit --max-message-bytes replaces both.
    """
    if server.max_message_bytes:
        return server.max_message_bytes, server.max_message_bytes
    config = engine.config
    vocab = engine.model_config.vocab_size
    tokens = max(config.max_batch_tokens, engine.max_sequence_length)
    per_item = 128 + 2 * MAX_ID_BYTES + (vocab + 7) // 8
    receive = 5 * tokens + config.max_batch_size * per_item
    rows = max(config.max_batch_tokens, config.max_batch_size)
    send = rows * (4 * vocab + 16 + 10 * config.max_num_logprobs)
    return (
        min(_GRPC_MAX_MESSAGE, _BASE_MESSAGE_BYTES + 2 * receive),
        min(_GRPC_MAX_MESSAGE, _BASE_MESSAGE_BYTES + 2 * send),
    )


def server_options(engine: Engine, server: ServerConfig) -> list[tuple[str, int]]:
    receive, send = message_limits(engine, server)
    return [
        ("grpc.max_receive_message_length", receive),
        ("grpc.max_send_message_length", send),
        ("grpc.max_concurrent_streams", server.max_concurrent_streams),
        # Soft and hard limit alike: above the soft one gRPC only rejects at random.
        ("grpc.max_metadata_size", server.max_metadata_bytes),
        ("grpc.absolute_max_metadata_size", server.max_metadata_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ]


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    engine: Engine
    servicer: ExecutorServicer
    health: health_aio.HealthServicer
    metrics: Metrics
    metrics_port: int
    server_config: ServerConfig
    health_server: grpc.aio.Server | None = None
    health_port: int = -1
    _watchdog: asyncio.Task[None] | None = None
    _sweeper: asyncio.Task[None] | None = None
    _group_keeper: asyncio.Task[None] | None = None
    # Set when a split model's group failed (a rank died or hung): the process must exit
    # non-zero so the orchestrator restarts every rank (see `abort`).
    group_failed: asyncio.Event = field(default_factory=asyncio.Event)
    _fault_reported: bool = False

    async def warm_up(self) -> None:
        """Run a real forward, start the liveness watchdog and the lease sweep, then report
        SERVING."""
        engine = self.engine
        _LOG.info("lifecycle", state="warming_up")
        warm = await engine.call(engine.warmup, 0)
        if warm.deferral is not None:  # the pool is empty at start: every block is available
            raise RuntimeError("warmup found no KV block available")
        engine.publish_gauges()
        _LOG.info(
            "lifecycle",
            state="warmed_up",
            tokens=warm.num_tokens,
            forward_ms=round(warm.forward_ms, 1),
            kv_blocks=engine.kv.pool.num_blocks,
            block_size=engine.kv.block_size,
        )
        config = self.server_config
        self._watchdog = asyncio.ensure_future(
            self.watch_engine(config.liveness_interval_s, config.liveness_timeout_s)
        )
        self._sweeper = asyncio.ensure_future(self.sweep_leases(engine.config.sweep_interval_s))
        if engine.tp.is_parallel:
            interval = min(GROUP_PING_MAX_S, engine.config.collective_timeout_s / 4)
            self._group_keeper = asyncio.ensure_future(self.keep_group(interval))
        await self.mark_serving()

    async def mark_serving(self) -> None:
        self.servicer.mark_serving()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _SERVING)
        self.metrics.set_ready(True)
        _LOG.info("lifecycle", state="serving", port=self.port, metrics_port=self.metrics_port)

    async def drain(self, grace_s: float) -> bool:
        """Two phases within grace_s. Finishing: health NOT_SERVING and no new request, while
        the requests held run to their end (steps, completion, capacity waits all answered),
        until no cache is held. Closing: refuse all work, end the calls that only wait, let
        the calls in flight finish (at least CLOSE_GRACE_MIN_S), release what is left. Returns
        whether every held request ended before the closing phase (none was cut off)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        self.servicer.begin_finishing()
        self.metrics.set_ready(False)
        for name in ("", SERVICE_NAME):  # liveness stays SERVING: the process is fine
            await self.health.set(name, _NOT_SERVING)
        held = await self.engine.call(lambda: len(self.engine.kv.caches))
        _LOG.info("lifecycle", state="draining", grace_s=grace_s, caches_held=held)
        finished = await self.finish_held(deadline)
        _LOG.info("lifecycle", state="closing", caches_finished=finished)
        await self._close(max(CLOSE_GRACE_MIN_S, deadline - loop.time()))
        released = await self.engine.call(self.engine.release_all)
        self.engine.shutdown()
        self.metrics.stop_http_server()
        _LOG.info("lifecycle", state="stopped", caches_released=released)
        return finished

    async def _close(self, grace_s: float) -> None:
        """Refuse all work, give the calls in flight grace_s to finish, end the calls that
        only wait and the background tasks (a drain's closing phase, and an abort)."""
        self.servicer.begin_drain()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        await self.servicer.dispatch.settle()
        self.servicer.close()
        if self.health_server is not None:
            await self.health_server.stop(0)
        for task in (self._watchdog, self._sweeper, self._group_keeper):
            if task is not None:
                task.cancel()

    async def finish_held(self, deadline: float) -> bool:
        """Wait (no polling: every release moves the capacity state) until the executor holds
        no cache, or the loop's clock passes `deadline`; whether every cache was finished."""
        engine, notifier = self.engine, self.servicer.notifier
        watch = notifier.watch()  # subscribed before the first count: no release is missed
        try:
            while await engine.call(lambda: len(engine.kv.caches)):
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    return False
                try:
                    await asyncio.wait_for(watch.next(), remaining)
                except TimeoutError:
                    return False
            return True
        finally:
            notifier.unwatch(watch)

    async def watch_engine(self, interval_s: float, timeout_s: float) -> None:
        """Liveness: the engine thread must answer a heartbeat within timeout_s, and the
        executor must not have faulted (a fault needs a restart: every service then reports
        NOT_SERVING, for good)."""
        healthy = True
        while True:
            started = time.monotonic()
            try:
                await asyncio.wait_for(self.engine.call(self.engine.heartbeat), timeout_s)
                alive = True
            except TimeoutError:
                alive = False
            faulted = self.engine.fault is not None
            if faulted and healthy:
                healthy = False
                await self.report_fault()
            elif not faulted and alive != healthy:
                healthy = alive
                await self.health.set(LIVENESS_SERVICE, _SERVING if alive else _NOT_SERVING)
                _LOG.warning(
                    "lifecycle",
                    state="engine_stuck" if not alive else "engine_live",
                    waited_s=round(time.monotonic() - started, 3),
                )
            await asyncio.sleep(interval_s)

    async def report_fault(self) -> None:
        """The executor faulted: readiness and liveness NOT_SERVING, so traffic leaves and the
        orchestrator restarts the process. A split model's process also exits (`abort`): its
        group is gone for good, and so are the followers."""
        if self._fault_reported:
            return
        self._fault_reported = True
        for name in ("", SERVICE_NAME, LIVENESS_SERVICE):
            await self.health.set(name, _NOT_SERVING)
        self.metrics.set_ready(False)
        _LOG.error("lifecycle", state="faulted", error=self.engine.fault)
        if self.engine.tp.is_parallel:
            self.group_failed.set()

    async def keep_group(self, interval_s: float) -> None:
        """Every interval_s, a collective with every rank (Engine.ping_group): it keeps idle
        followers within their collective timeout and finds a dead or hung rank while no step
        runs. A failure faults the executor at once."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.engine.call(self.engine.ping_group)
            except Exception:
                if self.engine.fault is not None:
                    await self.report_fault()
                    return

    async def abort(self) -> None:
        """Stop at once after the group failed: the calls in flight get their answers (the
        step that met the failure INTERNAL, later ones UNAVAILABLE), then everything closes;
        the caller exits non-zero."""
        self.servicer.begin_finishing()
        await self._close(ABORT_GRACE_S)
        self.engine.shutdown()
        self.metrics.stop_http_server()
        _LOG.error("lifecycle", state="aborted", error=self.engine.fault)

    async def sweep_leases(self, interval_s: float) -> None:
        """Every interval_s, on the engine thread (which owns the KV state): release caches
        past their lease and expire stale prefix marks (Engine.sweep)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.engine.call(self.engine.sweep)
            except Exception:  # a bug here must not end the sweep for good
                _LOG.exception("lease_sweep_failed")


class HealthServicer(health_aio.HealthServicer):  # type: ignore[misc]  # untyped library
    """The standard health servicer plus `List`, which grpcio-health-checking leaves
    unimplemented (it answered UNIMPLEMENTED with the library's internal text), and a `Watch`
    that ends once a drain has begun (the library's never ends, so every health watcher held
    a drain for its whole grace period)."""

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        """The library's Watch loop (same fields), but after sending the status a drain set
        (NOT_SERVING) it ends with UNAVAILABLE, as the executor's own idle streams do."""
        service = request.service
        condition = self._server_watchers[service]
        self._watcher_count_by_service[service] += 1
        last_status = None
        try:
            async with condition:
                while True:
                    status = self._server_status.get(
                        service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                    )
                    if status != last_status:
                        await context.write(health_pb2.HealthCheckResponse(status=status))
                    last_status = status
                    if self._gracefully_shutting_down:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is draining")
                    await condition.wait()
        finally:
            self._watcher_count_by_service[service] -= 1
            if self._watcher_count_by_service[service] == 0:
                del self._server_watchers[service]
                del self._watcher_count_by_service[service]

    async def List(
        self, request: health_pb2.HealthListRequest, context: Any
    ) -> health_pb2.HealthListResponse:
        statuses = dict(self._server_status)  # service name -> status, "" included
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in sorted(statuses.items())
            }
        )


async def start_server(
    engine_config: EngineConfig, server_config: ServerConfig, engine: Engine | None = None
) -> RunningServer:
    """Load the model, bind the ports, warm up with a real forward, then report SERVING."""
    running = await bind_server(engine_config, server_config, engine)
    await running.warm_up()
    return running


async def bind_server(
    engine_config: EngineConfig, server_config: ServerConfig, engine: Engine | None = None
) -> RunningServer:
    """Load the model and start answering on the ports; NOT_SERVING until `warm_up`."""
    if server_config.reflection and importlib.util.find_spec("grpc_reflection") is None:
        # Checked before the model loads, which can take minutes on a real checkpoint.
        raise ValueError(_REFLECTION_MISSING)
    _LOG.info(
        "lifecycle",
        state="loading",
        model=engine_config.model,
        device=engine_config.device,
        dtype=engine_config.dtype,
    )
    engine = engine or Engine(engine_config)
    metrics = engine.recorder.metrics
    metrics.set_cache_config(engine.kv.block_size, engine.kv.pool.num_blocks)
    metrics.set_memory_plan(engine.memory_plan.parts(), len(engine.graph_batch_sizes))
    metrics.set_rank_memory_plans(engine.rank_plans)
    metrics.set_tensor_parallel_size(engine.tp.world_size)
    _LOG.info(
        "memory_plan",
        **{f"{part}_bytes": value for part, value in engine.memory_plan.parts().items()},
        kv_blocks=engine.memory_plan.num_blocks,
        cuda_graph_batch_sizes=list(engine.graph_batch_sizes),
    )
    engine.limit_responses(message_limits(engine, server_config)[1])
    credentials = security.server_credentials(server_config.security)
    interceptors: list[Any] = [RpcMetricsInterceptor(metrics)]
    if server_config.security.auth_token_file:
        tokens = security.load_tokens(server_config.security.auth_token_file)
        interceptors.append(security.TokenAuthInterceptor(tokens))
    # After auth (a refused call is never counted); grpc's own maximum_concurrent_rpcs would
    # count health probes too.
    interceptors.append(
        CallLimitInterceptor(
            server_config.max_concurrent_rpcs, server_config.max_concurrent_rpcs_per_caller
        )
    )
    interceptors.append(security.MalformedRequestInterceptor())
    server = grpc.aio.server(
        interceptors=interceptors, options=server_options(engine, server_config)
    )
    servicer = ExecutorServicer(
        engine,
        CapacityNotifier(engine.kv, asyncio.get_running_loop()),
        step_ledger_size=server_config.step_ledger_size,
        step_ledger_max_bytes=server_config.step_ledger_max_bytes,
        step_ledger_evicted_ids=server_config.step_ledger_evicted_ids,
        release_on_disconnect=server_config.release_on_disconnect,
        stream_window=server_config.step_stream_window,
    )
    pb_grpc.add_ExecutorServiceServicer_to_server(servicer, server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, _NOT_SERVING)
    await health_servicer.set(LIVENESS_SERVICE, _SERVING)
    if server_config.reflection:
        _enable_reflection(server)
    port = _bind(server, server_config.host, server_config.port, credentials)
    health_server, health_port = None, -1
    if server_config.health_port >= 0:
        # Probes (kubelet's grpc probe) cannot do TLS or tokens: a separate plaintext port
        # that serves nothing but the health service.
        health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_port = _bind(health_server, server_config.host, server_config.health_port, None)
    metrics_port = -1
    if server_config.metrics_port >= 0:
        try:
            metrics_port = metrics.start_http_server(
                server_config.metrics_port, server_config.metrics_bind_host
            )
        except OSError as exc:
            raise OSError(
                f"cannot bind the metrics port {server_config.metrics_port}: {exc.strerror}"
            ) from None
    await server.start()
    if health_server is not None:
        await health_server.start()
    return RunningServer(
        server,
        port,
        engine,
        servicer,
        health_servicer,
        metrics,
        metrics_port,
        server_config,
        health_server,
        health_port,
    )


def _bind(
    server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None
) -> int:
    address = f"{host}:{port}"
    _check_free(host, port)
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise OSError(f"cannot bind {address}: {exc}") from None
    if bound == 0:
        raise OSError(f"cannot bind {address} (port in use?)")
    return bound


def _check_free(host: str, port: int) -> None:
    """Fail with one clear line when the port is taken, before gRPC logs its own complaint.

    gRPC's bind stays the authority; this only turns the common case into a readable error.
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(f"cannot bind {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise OSError(f"cannot bind {host}:{port}: {exc.strerror}") from None


_REFLECTION_MISSING = "--debug-reflection needs the 'debug' extra (grpcio-reflection)"


def _enable_reflection(server: grpc.aio.Server) -> None:
    try:
        from grpc_reflection.v1alpha import reflection
    except ImportError:
        raise ValueError(_REFLECTION_MISSING) from None
    reflection.enable_server_reflection(
        (SERVICE_NAME, reflection.SERVICE_NAME, "grpc.health.v1.Health"), server
    )


def startup_event(engine: EngineConfig, server: ServerConfig) -> dict[str, object]:
    """The configuration, printed once at start (no secrets live in these configs)."""
    return {"engine": dataclasses.asdict(engine), "server": dataclasses.asdict(server)}
