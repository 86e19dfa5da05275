"""Operations: metrics scraped from a live server, health across warmup -> serving -> drain,
liveness, SIGTERM drain of a subprocess with steps in flight, structured logs, reflection."""

from __future__ import annotations

import asyncio
import json
import pathlib
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from ferrum_client import ExecutorClient, ExecutorDrainingError, ExecutorError, UnavailableError, pb
from ferrum_server.metrics import METRIC_DOCS
from ferrum_server.server_process import start_server_process
from helpers_server import LiveServer, logged_metrics_port, rpcs_started
from prometheus_client.parser import text_string_to_metric_families

SERVING, NOT_SERVING = 1, 2


def _scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def _value(
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str
) -> float:
    series = samples.get(name, {})
    return sum(
        v for key, v in series.items() if all(dict(key).get(k) == w for k, w in labels.items())
    )


def test_every_documented_metric_is_exported_and_moves(
    live_server: LiveServer, client: ExecutorClient
) -> None:
    before = _scrape(live_server.metrics_url)
    admitted = client.try_admit_prefill(
        pb.TryAdmitPrefillRequest(
            request_id="m", input_tokens=list(range(40)), product_prompt_tokens=40
        )
    ).admitted
    cached = admitted.cached_prompt_tokens  # earlier tests may have left prefix blocks
    first = client.prefill(
        pb.PrefillRequest(
            request_id="m",
            input_tokens=list(range(40)),
            cache_id=admitted.cache_id,
            chunk=pb.PrefillChunk(
                tokens_processed=cached, tokens_to_process=40 - cached, total_prompt_tokens=40
            ),
        )
    )
    token = first.completed.output.token.token_id
    for position in range(40, 43):
        token = client.decode(
            pb.DecodeRequest(cache_id=admitted.cache_id, input_token=token, position=position)
        ).completed.output.token.token_id
    during = _scrape(live_server.metrics_url)
    assert _value(during, "ferrum_executor_sequences_running") == 1
    assert _value(during, "ferrum_executor_kv_blocks_used") >= 11
    assert 0 < _value(during, "ferrum_executor_kv_cache_utilization_ratio") < 1
    client.preempt_execution_capacity(
        pb.PreemptExecutionCapacityRequest(request_id="m", cache_id=admitted.cache_id)
    )
    again = client.try_admit_prefill(
        pb.TryAdmitPrefillRequest(
            request_id="m", input_tokens=list(range(40)), product_prompt_tokens=40
        )
    ).admitted
    client.release_cache(pb.ReleaseCacheRequest(cache_id=again.cache_id))
    with pytest.raises(ExecutorError):
        client.decode(pb.DecodeRequest(cache_id="missing", input_token=1))
    # A failed call's handled counter moves when the aborted handler unwinds, which can be just
    # after the client already holds the status: scrape until it shows (bounded).
    not_found = {"grpc_method": "Decode", "grpc_code": "NOT_FOUND"}
    baseline = _value(before, "grpc_server_handled_total", **not_found)
    deadline = time.monotonic() + 5
    after = _scrape(live_server.metrics_url)
    while _value(after, "grpc_server_handled_total", **not_found) <= baseline:
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
        after = _scrape(live_server.metrics_url)
    for name, kind, _, _ in METRIC_DOCS:
        exported = f"{name}_count" if kind == "histogram" else name
        assert exported in after, f"{name} is not exported"

    def moved(name: str, by: float = 1, **labels: str) -> None:
        delta = _value(after, name, **labels) - _value(before, name, **labels)
        assert delta >= by, f"{name}{labels} moved by {delta}"

    moved("ferrum_executor_tokens_total", 40 - cached, kind="prefill")
    moved("ferrum_executor_tokens_total", 3, kind="decode")
    moved("ferrum_executor_steps_total", 4)
    moved("ferrum_executor_step_duration_seconds_count", 3, kind="decode")
    moved("ferrum_executor_batch_size_count", 4)
    moved("ferrum_executor_time_to_first_token_seconds_count")
    moved("ferrum_executor_inter_token_latency_seconds_count", 3)
    moved("ferrum_executor_admissions_total", 2, outcome="admitted")
    moved("ferrum_executor_preemptions_total", 1, mode="recompute")
    moved("ferrum_executor_prefix_cache_queries_total", 80)
    moved("ferrum_executor_prefix_cache_hits_total", 32)  # the re-admission hit 2 full blocks
    moved("grpc_server_started_total", 1, grpc_method="Decode")
    moved("grpc_server_handled_total", 3, grpc_method="Decode", grpc_code="OK")
    moved("grpc_server_handled_total", 1, grpc_method="Decode", grpc_code="NOT_FOUND")
    moved("grpc_server_handling_seconds_count", 1, grpc_method="Prefill")
    assert _value(after, "ferrum_executor_ready") == 1
    assert _value(after, "ferrum_executor_sequences_running") == 0
    info = after["ferrum_executor_cache_config_info"]
    assert dict(next(iter(info))) == {
        "block_size": "4",
        "num_gpu_blocks": str(live_server.engine.kv.pool.num_blocks),
    }  # type: ignore[attr-defined]


def test_memory_plan_in_capabilities_and_metrics(
    live_server: LiveServer, client: ExecutorClient
) -> None:
    """On CPU: a fixed 4 MiB pool beside the weights, no activations measured, no graphs."""
    engine = live_server.engine
    caps = client.get_capabilities().capabilities
    plan = caps.memory_plan
    assert plan.total_bytes > plan.weights_bytes > 0
    assert plan.utilization == 1.0 and plan.explicit_kv_cache_bytes
    assert plan.kv_cache_bytes == 4 * 1024**2
    assert plan.kv_blocks == engine.kv.pool.num_blocks  # type: ignore[attr-defined]
    assert plan.activation_peak_bytes == plan.cuda_graph_bytes == plan.reserved_kv_blocks == 0
    assert list(caps.cuda_graph_batch_sizes) == []
    info = client.get_info()
    assert not info.config.optimization_config.enable_cuda_graphs
    assert client.warmup(pb.WarmupRequest(num_tokens=8)).peak_activation_bytes == 0
    samples = _scrape(live_server.metrics_url)
    assert _value(samples, "ferrum_executor_memory_plan_bytes", part="kv_cache") == 4 * 1024**2
    assert _value(samples, "ferrum_executor_memory_plan_bytes", part="weights") == (
        plan.weights_bytes
    )
    assert _value(samples, "ferrum_executor_memory_plan_bytes", part="total") == plan.total_bytes
    assert _value(samples, "ferrum_executor_cuda_graphs") == 0


def test_health_warmup_serving_drain_and_liveness() -> None:
    from ferrum_server.app import LIVENESS_SERVICE, SERVICE_NAME, bind_server
    from ferrum_server.config import EngineConfig, ServerConfig
    from ferrum_server.domain import WarmupOutcome
    from ferrum_server.engine import Engine

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = Engine(EngineConfig(kv_cache_bytes=1 << 20))
    gate = threading.Event()
    real_warmup = engine.warmup

    def slow_warmup(num_tokens: int = 0) -> WarmupOutcome:
        gate.wait(30)
        return real_warmup(64)

    engine.warmup = slow_warmup  # type: ignore[method-assign]
    config = ServerConfig(port=0, metrics_port=-1, liveness_interval_s=0.05, liveness_timeout_s=0.3)
    running = asyncio.run_coroutine_threadsafe(
        bind_server(EngineConfig(), config, engine), loop
    ).result(timeout=60)
    warming = asyncio.run_coroutine_threadsafe(running.warm_up(), loop)
    with ExecutorClient(f"127.0.0.1:{running.port}", timeout_s=10) as client:
        assert client.health() == NOT_SERVING
        assert client.health(SERVICE_NAME) == NOT_SERVING
        with pytest.raises(UnavailableError):
            client.decode(pb.DecodeRequest(cache_id="x", input_token=1))
        gate.set()
        warming.result(timeout=60)
        assert client.health() == SERVING and client.health(SERVICE_NAME) == SERVING
        assert client.health(LIVENESS_SERVICE) == SERVING
        # A stuck engine thread fails liveness, and recovers when it frees up.
        blocker = asyncio.run_coroutine_threadsafe(engine.call(time.sleep, 1.5), loop)
        assert _eventually(lambda: client.health(LIVENESS_SERVICE) == NOT_SERVING)
        blocker.result(timeout=10)
        assert _eventually(lambda: client.health(LIVENESS_SERVICE) == SERVING)
        # Reflection is off unless asked for.
        reflect = client._channel.stream_stream(  # type: ignore[attr-defined]
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
        )
        with pytest.raises(grpc.RpcError) as caught:
            list(reflect(iter([b""])))
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        draining = asyncio.run_coroutine_threadsafe(running.drain(5.0), loop)
        draining.result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def _eventually(check: object, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_sigterm_drain_finishes_held_requests_takes_no_new_ones_then_exits_zero(
    tmp_path: object,
) -> None:
    """SIGTERM with six prefills in flight: all six complete (they were sent before the drain)
    and hold their caches; while they are held the executor still decodes and releases them
    but takes no new request (reason DRAINING); two never released are cut off at the grace
    deadline, then the process exits 0."""
    grace_s = 6.0
    process, port = start_server_process(
        [
            "--grace-s",
            str(grace_s),
            "--metrics-port",
            "0",
            "--log-format",
            "json",
            "--max-batch-tokens",
            "2048",
        ],
        stdout=open(f"{tmp_path}/log.jsonl", "wb"),  # noqa: SIM115
    )
    target = f"127.0.0.1:{port}"
    metrics_port = logged_metrics_port(pathlib.Path(f"{tmp_path}/log.jsonl"))

    def long_prefill(seed: int) -> pb.PrefillResponse:
        with ExecutorClient(target, timeout_s=60) as client:
            tokens = [(seed * 31 + i) % 512 for i in range(2000)]
            response = client.prefill(pb.PrefillRequest(request_id=f"p{seed}", input_tokens=tokens))
            return response

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(long_prefill, seed) for seed in range(6)]
        # All six on the server before the SIGTERM (a later one would rightly be refused as
        # draining): counted by the server itself, not guessed with a sleep.
        deadline = time.monotonic() + 30
        while rpcs_started(metrics_port, "Prefill") < 6:
            assert time.monotonic() < deadline, "the six prefills never reached the server"
            time.sleep(0.02)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        results = [f.result(timeout=60) for f in futures]
    assert all(r.HasField("completed") for r in results)
    caches = [r.completed.kv_cache.cache_id for r in results]
    with ExecutorClient(target, timeout_s=10) as client:
        assert client.health() == NOT_SERVING
        with pytest.raises(ExecutorDrainingError):
            client.try_admit_prefill(
                pb.TryAdmitPrefillRequest(request_id="new", input_tokens=[1, 2, 3])
            )
        with pytest.raises(ExecutorDrainingError):
            client.prefill(pb.PrefillRequest(request_id="new", input_tokens=[1, 2, 3]))
        # The held requests run on: a decode, then four releases.
        first = results[0].completed
        decoded = client.decode(
            pb.DecodeRequest(
                cache_id=caches[0],
                input_token=first.output.token.token_id,
                position=first.kv_cache.num_tokens,
            )
        )
        assert decoded.completed.kv_cache.num_tokens == 2001
        for cache_id in caches[:4]:
            client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))
    assert process.wait(timeout=30) == 0
    waited = time.monotonic() - sent
    # The two never released hold the drain until the deadline, and only a little past it.
    assert grace_s - 0.5 < waited < grace_s + 5
    events = [
        json.loads(line)
        for line in open(f"{tmp_path}/log.jsonl")  # noqa: SIM115
        if line.startswith("{")
    ]
    lifecycle = [e for e in events if e.get("event") == "lifecycle"]
    assert [e.get("state") for e in lifecycle][-3:] == ["draining", "closing", "stopped"]
    assert lifecycle[-2]["caches_finished"] is False
    assert lifecycle[-1]["caches_released"] == 2
    # Once serving, the process froze what start-up made (process_gc): once, all of it.
    names = [e.get("event") for e in events]
    frozen = [e for e in events if e.get("event") == "gc_frozen"]
    assert len(frozen) == 1 and frozen[0]["objects"] > 10_000
    serving = next(i for i, e in enumerate(events) if e.get("state") == "serving")
    assert names.index("gc_frozen") > serving


def test_sigterm_drain_with_nothing_held_exits_at_once(tmp_path: object) -> None:
    process, port = start_server_process(["--grace-s", "20", "--metrics-port", "-1"])
    with ExecutorClient(f"127.0.0.1:{port}", timeout_s=10) as client:
        result = client.prefill(pb.PrefillRequest(request_id="a", input_tokens=[1, 2, 3, 4]))
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        # Held: the completion still goes through, and ends the drain.
        client.complete_cache(
            pb.CompleteCacheRequest(
                request_id="a", cache_id=result.completed.kv_cache.cache_id, input_tokens=4
            )
        )
    assert process.wait(timeout=30) == 0
    assert time.monotonic() - sent < 10


def test_rpc_failures_are_logged_with_ids_and_no_tokens(tmp_path: object) -> None:
    log = f"{tmp_path}/log.jsonl"
    process, port = start_server_process(
        ["--metrics-port", "-1", "--log-format", "json"],
        stdout=open(log, "wb"),  # noqa: SIM115
    )
    try:
        with ExecutorClient(f"127.0.0.1:{port}") as client:
            with pytest.raises(ExecutorError):
                client.decode(
                    pb.DecodeRequest(request_id="req-7", cache_id="cache-9", input_token=1)
                )
            with pytest.raises(ExecutorError):
                client.prefill(pb.PrefillRequest(request_id="req-8", input_tokens=[499, 498, 9999]))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    events = [json.loads(line) for line in open(log) if line.startswith("{")]  # noqa: SIM115
    failures = [e for e in events if e.get("event") == "rpc_failed"]
    assert {
        "method": "Decode",
        "code": "NOT_FOUND",
        "request_id": "req-7",
        "cache_id": "cache-9",
    }.items() <= failures[0].items()
    assert failures[1]["code"] == "INVALID_ARGUMENT" and failures[1]["request_id"] == "req-8"
    text = open(log).read()  # noqa: SIM115
    assert "9999" not in text and "input_tokens" not in text


def test_debug_reflection_without_its_package_is_refused_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from ferrum_server import app
    from ferrum_server.config import EngineConfig, ServerConfig

    monkeypatch.setitem(sys.modules, "grpc_reflection", None)  # as if not installed

    def load_model(config: EngineConfig) -> None:
        raise AssertionError("the model was loaded before the configuration was checked")

    monkeypatch.setattr(app, "Engine", load_model)
    with pytest.raises(ValueError, match="needs the 'debug' extra"):
        asyncio.run(app.bind_server(EngineConfig(), ServerConfig(port=0, reflection=True)))


def test_standard_health_watch_list_and_client_side_health_checking(
    live_server: LiveServer,
) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    serving = health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(live_server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        # Watch is a streaming handler that writes instead of yielding: the request guard used
        # to fail it with UNKNOWN.
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == serving
        watch.cancel()
        listed = health.List(health_pb2.HealthListRequest(), timeout=10)
        assert {name: s.status for name, s in listed.statuses.items()} == {
            "": serving,
            "ferrum.executor.v1.ExecutorService": serving,
            "ferrum.executor.v1.Liveness": serving,
        }
    # gRPC's client-side health checking (healthCheckConfig) watches "" before it sends a call.
    config = json.dumps(
        {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}}
    )
    options = [("grpc.service_config", config)]
    with grpc.insecure_channel(live_server.target, options=options) as channel:
        get_info = channel.unary_unary(
            "/ferrum.executor.v1.ExecutorService/GetInfo",
            request_serializer=pb.GetInfoRequest.SerializeToString,
            response_deserializer=pb.GetInfoResponse.FromString,
        )
        assert get_info(pb.GetInfoRequest(), timeout=10).model_info.model_id == "tiny"
