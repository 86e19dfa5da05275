"""Tests for ferrum_server.metrics (the Prometheus registry) and rpc_metrics (the interceptor)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import promlint
import pytest
from ferrum_client import ExecutorClient, ExecutorError, pb
from ferrum_server.app import start_server
from ferrum_server.config import EngineConfig, ServerConfig
from ferrum_server.metrics import METRIC_DOCS, Metrics, render_markdown_table
from ferrum_server.rpc_metrics import RpcMetricsInterceptor
from helpers_server import LiveServer
from prometheus_client.parser import text_string_to_metric_families


def _samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} from the registry's text exposition."""
    text = metrics.exposition().decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _families(metrics: Metrics) -> dict[str, Any]:
    text = metrics.exposition().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(metrics: Metrics, name: str, **labels: str) -> float:
    return _samples(metrics).get((name, tuple(sorted(labels.items()))), float("nan"))


def _exercise(m: Metrics) -> None:
    """One call of every recording method."""
    m.record_step(
        "mixed",
        num_items=3,
        num_tokens=40,
        prefill_tokens=36,
        decode_tokens=2,
        verify_tokens=2,
        seconds=0.02,
    )
    m.set_kv(total=100, used=25, cached=5)
    m.set_cache_config(block_size=16, num_gpu_blocks=100)
    m.set_rank_memory_plans([{"kv_cache": 1 << 20, "num_blocks": 64}] * 2)
    m.set_tensor_parallel_size(2)
    m.record_collective(0.002)
    m.set_sequences(running=3, waiting=1)
    m.record_deferral("kv_blocks")
    m.record_admission("admitted")
    m.record_preemption("recompute")
    m.record_prefix(queried_tokens=64, hit_tokens=32)
    m.observe_ttft(0.15)
    m.observe_itl(0.012)
    m.set_ready(True)
    m.update_device_memory()
    m.rpc_start("/ferrum.executor.v1.ExecutorService/GetInfo")
    m.observe_rpc("/ferrum.executor.v1.ExecutorService/GetInfo", "OK", 0.003)


def test_observing_many_latencies_at_once_matches_one_observe_each() -> None:
    # A decode step observes its outputs' inter-token latencies together: the exposition
    # (every bucket, count and sum) is what one observe() per latency gives, bucket edges
    # included (a value equal to a bound counts in that bound's bucket).
    values = [0.0, 0.004, 0.005, 0.0051, 0.012, 0.012, 0.25, 0.25, 3.0, 1e6]
    one_by_one, together = Metrics(), Metrics()
    for value in values:
        one_by_one.observe_itl(value)
    together.observe_itls(values)
    together.observe_itls([])
    name = "ferrum_executor_inter_token_latency_seconds"
    expected = {k: v for k, v in _samples(one_by_one).items() if k[0].startswith(name)}
    got = {k: v for k, v in _samples(together).items() if k[0].startswith(name)}
    assert got == pytest.approx(expected)
    assert expected[(name + "_count", ())] == len(values)
    assert expected[(name + "_bucket", (("le", "0.005"),))] == 3  # 0, 0.004, 0.005


def test_every_documented_metric_is_exposed() -> None:
    m = Metrics()
    _exercise(m)
    samples = {name for name, _ in _samples(m)}
    families = _families(m)
    for name, kind, labels, description in METRIC_DOCS:
        assert description
        if kind == "histogram":
            assert {f"{name}_bucket", f"{name}_sum", f"{name}_count"} <= samples, name
        else:
            assert name in samples, name
        family = next(
            f
            for f in families.values()
            if name.startswith(f.name) and name.removeprefix(f.name) in ("", "_total", "_info")
        )
        assert family.type == kind or (kind == "gauge" and family.type == "info"), name
        with_labels = [s for s in family.samples if s.name.startswith(name)]
        for sample in with_labels:
            got = set(sample.labels) - {"le"}
            assert got == set(labels), (name, got, labels)


def test_no_undocumented_ferrum_or_grpc_metric() -> None:
    """Everything we own (not the process/platform collectors) appears in METRIC_DOCS."""
    m = Metrics()
    _exercise(m)
    documented = {name for name, *_ in METRIC_DOCS}
    for name, _ in _samples(m):
        if name.startswith(("ferrum_executor_process_", "python_")):
            continue
        base = name
        for suffix in ("_bucket", "_count", "_sum", "_created"):
            base = base.removesuffix(suffix)
        assert base in documented or f"{base}_total" in documented, name


def test_values_move() -> None:
    m = Metrics(process_collectors=False)
    assert _value(m, "ferrum_executor_tokens_total", kind="prefill") == 0.0  # pre-created
    assert _value(m, "ferrum_executor_preemptions_total", mode="swap") == 0.0
    _exercise(m)
    _exercise(m)
    assert _value(m, "ferrum_executor_steps_total") == 2
    assert _value(m, "ferrum_executor_tokens_total", kind="prefill") == 72
    assert _value(m, "ferrum_executor_tokens_total", kind="decode") == 4
    assert _value(m, "ferrum_executor_tokens_total", kind="verify") == 4
    assert _value(m, "ferrum_executor_batch_size_count") == 2
    assert _value(m, "ferrum_executor_batch_tokens_sum") == 80
    assert _value(m, "ferrum_executor_step_duration_seconds_count", kind="mixed") == 2
    assert _value(m, "ferrum_executor_step_duration_seconds_count", kind="decode") == 0
    assert _value(m, "ferrum_executor_kv_blocks") == 100
    assert _value(m, "ferrum_executor_kv_blocks_used") == 25
    assert _value(m, "ferrum_executor_kv_blocks_cached") == 5
    assert _value(m, "ferrum_executor_kv_cache_utilization_ratio") == pytest.approx(0.25)
    assert (
        _value(m, "ferrum_executor_cache_config_info", block_size="16", num_gpu_blocks="100") == 1
    )
    assert _value(m, "ferrum_executor_sequences_running") == 3
    assert _value(m, "ferrum_executor_requests_waiting") == 1
    assert _value(m, "ferrum_executor_deferrals_total", reason="kv_blocks") == 2
    assert _value(m, "ferrum_executor_admissions_total", outcome="admitted") == 2
    assert _value(m, "ferrum_executor_preemptions_total", mode="recompute") == 2
    assert _value(m, "ferrum_executor_prefix_cache_queries_total") == 128
    assert _value(m, "ferrum_executor_prefix_cache_hits_total") == 64
    assert _value(m, "ferrum_executor_time_to_first_token_seconds_count") == 2
    assert _value(m, "ferrum_executor_inter_token_latency_seconds_sum") == pytest.approx(0.024)
    assert _value(m, "ferrum_executor_ready") == 1
    rpc = {
        "grpc_type": "unary",
        "grpc_service": "ferrum.executor.v1.ExecutorService",
        "grpc_method": "GetInfo",
    }
    assert _value(m, "grpc_server_started_total", **rpc) == 2
    assert _value(m, "grpc_server_handled_total", grpc_code="OK", **rpc) == 2
    assert _value(m, "grpc_server_handling_seconds_count", **rpc) == 2
    m.set_ready(False)
    m.set_kv(total=0, used=0)
    m.set_cache_config(block_size=32, num_gpu_blocks=7)
    assert _value(m, "ferrum_executor_ready") == 0
    assert _value(m, "ferrum_executor_kv_cache_utilization_ratio") == 0
    info = [k for k in _samples(m) if k[0] == "ferrum_executor_cache_config_info"]
    assert info == [
        ("ferrum_executor_cache_config_info", (("block_size", "32"), ("num_gpu_blocks", "7")))
    ]


def test_registries_are_independent_and_labels_are_checked() -> None:
    a, b = Metrics(), Metrics()
    a.record_admission("rejected")
    assert _value(a, "ferrum_executor_admissions_total", outcome="rejected") == 1
    assert _value(b, "ferrum_executor_admissions_total", outcome="rejected") == 0
    with pytest.raises(ValueError):
        a.record_deferral("disk")
    with pytest.raises(ValueError):
        a.record_step("verify", 1, 1, 0, 0, 1, 0.01)


def test_process_collector_is_namespaced() -> None:
    samples = {name for name, _ in _samples(Metrics())}
    assert "ferrum_executor_process_resident_memory_bytes" in samples
    assert "python_info" in samples


def test_markdown_table_lists_every_metric() -> None:
    table = render_markdown_table()
    lines = table.strip().splitlines()
    assert lines[0].startswith("| Metric |")
    assert len(lines) == 2 + len(METRIC_DOCS)
    for name, *_ in METRIC_DOCS:
        assert f"`{name}`" in table


def test_no_gauge_ends_in_total() -> None:
    """OpenMetrics reserves `_total` for counters (promtool: "non-counter metrics should not
    have _total suffix"); ferrum_executor_kv_blocks was once ferrum_executor_kv_blocks_total."""
    for name, kind, _, _ in METRIC_DOCS:
        assert (kind == "counter") == name.endswith("_total"), name
    for family in _families(Metrics()).values():
        if family.type != "counter":
            assert not family.name.endswith("_total"), family.name


def _promtool_findings(body: bytes) -> list[str] | None:
    """promtool's findings on an exposition; None where promtool is not installed."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return None
    out = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=60, check=False
    )
    findings = sorted(line for line in (out.stdout + out.stderr).decode().splitlines() if line)
    assert (out.returncode == 0) == (not findings), findings
    return findings


def _lint(body: bytes) -> list[str]:
    """Lint findings: promtool's where installed (CI installs it: .ci/run), else the same rules
    in Python (tests/promlint.py, checked against promtool below)."""
    findings = _promtool_findings(body)
    return sorted(promlint.lint(body.decode())) if findings is None else findings


def test_live_exposition_passes_the_metrics_lint(
    live_server: LiveServer, client: ExecutorClient
) -> None:
    """Scrape a server that has done real work (every label child populated) and lint it with
    `promtool check metrics` (or, where promtool is missing, its rules in tests/promlint.py)."""
    prompt = list(range(24))
    admitted = client.try_admit_prefill(
        pb.TryAdmitPrefillRequest(request_id="lint", input_tokens=prompt, product_prompt_tokens=24)
    ).admitted
    cached = admitted.cached_prompt_tokens
    first = client.prefill(
        pb.PrefillRequest(
            request_id="lint",
            input_tokens=prompt,
            cache_id=admitted.cache_id,
            chunk=pb.PrefillChunk(
                tokens_processed=cached, tokens_to_process=24 - cached, total_prompt_tokens=24
            ),
        )
    )
    token = first.completed.output.token.token_id
    for position in range(24, 27):
        token = client.decode(
            pb.DecodeRequest(cache_id=admitted.cache_id, input_token=token, position=position)
        ).completed.output.token.token_id
    client.release_cache(pb.ReleaseCacheRequest(cache_id=admitted.cache_id))
    with pytest.raises(ExecutorError):
        client.decode(pb.DecodeRequest(cache_id="missing", input_token=1))
    with urllib.request.urlopen(live_server.metrics_url, timeout=10) as resp:
        body = resp.read()
    assert b"ferrum_executor_steps_total" in body and b'grpc_code="NOT_FOUND"' in body
    findings = _lint(body)
    assert not findings, findings


# Expositions promtool rejects, one rule each, and one it accepts.
LINT_CORPUS = [
    b"# HELP x_blocks_total b\n# TYPE x_blocks_total gauge\nx_blocks_total 1\n",
    b"# TYPE x_requests counter\nx_requests 1\n",
    b"# HELP x_wait_milliseconds h\n# TYPE x_wait_milliseconds gauge\nx_wait_milliseconds 1\n",
    b"# HELP x_lat_ms h\n# TYPE x_lat_ms gauge\nx_lat_ms 1\n",
    b"# HELP x_count h\n# TYPE x_count gauge\nx_count 1\n",
    b"# HELP x_bucket h\n# TYPE x_bucket gauge\nx_bucket 1\n",
    b"# HELP x_gauge_things h\n# TYPE x_gauge_things gauge\nx_gauge_things 1\n",
    b'# HELP xFoo h\n# TYPE xFoo gauge\nxFoo{fooBar="1"} 1\n',
    b"# HELP x:y h\n# TYPE x:y gauge\nx:y 1\n",
    b'# HELP x_y h\n# TYPE x_y gauge\nx_y{le="1"} 1\nx_y{quantile="2"} 1\n',
    b"# HELP x_ok_total h\n# TYPE x_ok_total counter\nx_ok_total 1\n",
]


def test_the_python_lint_catches_a_gauge_named_total() -> None:
    """The fallback lint is not vacuous: it rejects the old name, as promtool does."""
    assert promlint.lint(LINT_CORPUS[0].decode()) == [
        'x_blocks_total non-counter metrics should not have "_total" suffix'
    ]


def test_the_python_lint_agrees_with_promtool() -> None:
    """Where promtool is installed, both lints give the same findings on every rule's sample
    and on a live-like registry exposition. CI requires promtool (FERRUM_REQUIRE_PROMTOOL)."""
    if shutil.which("promtool") is None:
        assert not os.environ.get("FERRUM_REQUIRE_PROMTOOL"), "promtool is not installed"
        pytest.skip("promtool is not installed (apt-get install prometheus); CI runs this")
    for body in [*LINT_CORPUS, Metrics(process_collectors=False).exposition()]:
        assert sorted(promlint.lint(body.decode())) == _promtool_findings(body), body[:80]
    assert all(_promtool_findings(body) for body in LINT_CORPUS[:-1])


async def test_metrics_listen_on_the_grpc_host_by_default() -> None:
    """`--host 127.0.0.1` alone keeps /metrics on loopback too (it used to bind 0.0.0.0)."""
    running = await start_server(
        EngineConfig(kv_cache_bytes=1024**2),
        ServerConfig(host="127.0.0.1", port=0, metrics_port=0),
    )
    try:
        assert running.metrics_port > 0
        assert running.metrics._http.server_address[0] == "127.0.0.1"
    finally:
        await running.drain(0.5)
    assert ServerConfig(host="[::1]").metrics_bind_host == "::1"
    assert ServerConfig(host="127.0.0.1", metrics_host="0.0.0.0").metrics_bind_host == "0.0.0.0"


def test_http_server_on_port_zero() -> None:
    m = Metrics(process_collectors=False)
    port = m.start_http_server(0, "127.0.0.1")
    try:
        assert port > 0
        m.set_ready(True)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            body = resp.read().decode()
        assert "ferrum_executor_ready 1.0" in body
    finally:
        m.stop_http_server()


# -- the gRPC interceptor ------------------------------------------------------------------

_SERVICE = "test.Echo"


async def _unary_ok(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    return request


async def _unary_abort(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    return b""


async def _unary_set_code(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    context.set_code(grpc.StatusCode.NOT_FOUND)
    context.set_details("gone")
    return b""


async def _unary_raise(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    raise RuntimeError("boom")


async def _server_stream(
    request: bytes, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    for i in range(3):
        yield bytes([i])


async def _bidi(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    async for request in requests:
        if request == b"stop":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "stop")
        yield request


async def _client_stream_writer(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
) -> bytes:
    return b"".join([r async for r in requests])


async def _server_stream_writer(
    request: bytes, context: grpc.aio.ServicerContext[Any, Any]
) -> None:
    await context.write(b"a")
    await context.write(b"b")


def _echo_handlers() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        _SERVICE,
        {
            "Ok": grpc.unary_unary_rpc_method_handler(_unary_ok),
            "Abort": grpc.unary_unary_rpc_method_handler(_unary_abort),
            "SetCode": grpc.unary_unary_rpc_method_handler(_unary_set_code),
            "Raise": grpc.unary_unary_rpc_method_handler(_unary_raise),
            "Stream": grpc.unary_stream_rpc_method_handler(_server_stream),
            "Bidi": grpc.stream_stream_rpc_method_handler(_bidi),
            "Collect": grpc.stream_unary_rpc_method_handler(_client_stream_writer),
            "Write": grpc.unary_stream_rpc_method_handler(_server_stream_writer),
        },
    )


async def test_interceptor_counts_codes_for_every_call_shape() -> None:
    metrics = Metrics(process_collectors=False)
    server = grpc.aio.server(interceptors=[RpcMetricsInterceptor(metrics)])
    server.add_generic_rpc_handlers((_echo_handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:

            def path(name: str) -> str:
                return f"/{_SERVICE}/{name}"

            assert await channel.unary_unary(path("Ok"))(b"hi", timeout=5) == b"hi"
            for name, code in (
                ("Abort", grpc.StatusCode.RESOURCE_EXHAUSTED),
                ("SetCode", grpc.StatusCode.NOT_FOUND),
                ("Raise", grpc.StatusCode.UNKNOWN),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await channel.unary_unary(path(name))(b"", timeout=5)
                assert info.value.code() == code
            got = [r async for r in channel.unary_stream(path("Stream"))(b"", timeout=5)]
            assert got == [b"\x00", b"\x01", b"\x02"]
            got = [r async for r in channel.unary_stream(path("Write"))(b"", timeout=5)]
            assert got == [b"a", b"b"]
            got = [
                r async for r in channel.stream_stream(path("Bidi"))(iter([b"x", b"y"]), timeout=5)
            ]
            assert got == [b"x", b"y"]
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in channel.stream_stream(path("Bidi"))(
                    iter([b"x", b"stop"]), timeout=5
                ):
                    pass
            collect = channel.stream_unary(path("Collect"))
            assert await collect(iter([b"a", b"b"]), timeout=5) == b"ab"
    finally:
        await server.stop(None)
    await asyncio.sleep(0)

    def handled(method: str, kind: str, code: str) -> float:
        return _value(
            metrics,
            "grpc_server_handled_total",
            grpc_type=kind,
            grpc_service=_SERVICE,
            grpc_method=method,
            grpc_code=code,
        )

    assert handled("Ok", "unary", "OK") == 1
    assert handled("Abort", "unary", "RESOURCE_EXHAUSTED") == 1
    assert handled("SetCode", "unary", "NOT_FOUND") == 1
    assert handled("Raise", "unary", "UNKNOWN") == 1
    assert handled("Stream", "server_stream", "OK") == 1
    assert handled("Write", "server_stream", "OK") == 1
    assert handled("Bidi", "bidi_stream", "OK") == 1
    assert handled("Bidi", "bidi_stream", "INVALID_ARGUMENT") == 1
    assert handled("Collect", "client_stream", "OK") == 1
    started = _value(
        metrics,
        "grpc_server_started_total",
        grpc_type="bidi_stream",
        grpc_service=_SERVICE,
        grpc_method="Bidi",
    )
    assert started == 2
    assert (
        _value(
            metrics,
            "grpc_server_handling_seconds_count",
            grpc_type="unary",
            grpc_service=_SERVICE,
            grpc_method="Raise",
        )
        == 1
    )


def test_operations_doc_carries_the_rendered_metrics_table() -> None:
    import pathlib

    doc = pathlib.Path(__file__).resolve().parents[2] / "docs" / "operations.md"
    assert render_markdown_table() in doc.read_text()
