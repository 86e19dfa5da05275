"""Prometheus metrics for one executor process.

`Metrics` owns its own `CollectorRegistry` (never the process-global one), so tests and
several in-process servers can each build one. The engine and servicer call its small
`record_*` / `set_*` / `observe_*` methods; `start_http_server` serves `/metrics`.

`METRIC_DOCS` is the single source of truth for what is exported: the metrics table in
docs/operations.md is rendered from it (`render_markdown_table`) and the tests check the
registry against it.
Names carry their unit; counters are listed with the `_total` suffix they are exposed with.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Iterable, Sequence
from typing import Any

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from ferrum_server.memory_plan import MEMORY_PLAN_PARTS

PREFIX = "ferrum_executor"
TOKEN_KINDS = ("prefill", "decode", "verify")
STEP_KINDS = ("prefill", "decode", "mixed")
ADMISSION_OUTCOMES = ("admitted", "deferred", "maintenance_deferred", "rejected")
DEFERRAL_REASONS = ("kv_blocks", "sequence_slots", "request_state")
PREEMPTION_MODES = ("recompute", "swap")
REQUEST_ORIGINS = ("product", "startup", "diagnostic", "unspecified")
COMPLETION_CALLS = ("complete", "cancel")
COMPLETION_WORK = ("none", "additional_or_unproven")
# CompleteCache outcomes (proto CompletionOutcome, lower case).
COMPLETION_OUTCOMES = (
    "completed",
    "already_completed",
    "already_released",
    "cancelled",
    "preempted",
    "expired",
)
COMPLETED_TOKEN_KINDS = ("input", "output")
MEMORY_PARTS = MEMORY_PLAN_PARTS
GRPC_LABELS = ("grpc_type", "grpc_service", "grpc_method")

# Buckets, in seconds or counts: from one fast decode step to a long prefill or a slow RPC.
# fmt: off
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
                        2.5, 5.0, 10.0, 30.0)
TTFT_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                        40.0, 80.0)
ITL_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
                       2.5, 10.0)
RPC_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                       5.0, 10.0, 30.0, 60.0)
# fmt: on
BATCH_SIZE_BUCKETS = tuple(float(2**i) for i in range(10))  # 1 .. 512 items
BATCH_TOKEN_BUCKETS = tuple(float(2**i) for i in range(16))  # 1 .. 32768 tokens

# (exposed name, type, labels, description); counters carry the `_total` they are exposed with.
# fmt: off
METRIC_DOCS: list[tuple[str, str, tuple[str, ...], str]] = [
    (f"{PREFIX}_sequences_running", "gauge", (),
     "Sequences holding KV state on this executor."),
    (f"{PREFIX}_requests_waiting", "gauge", (),
     "Requests admitted but not yet started (no forward pass run for them)."),
    # Was ferrum_executor_kv_blocks_total: a gauge must not end in _total (promtool, issue #17).
    (f"{PREFIX}_kv_blocks", "gauge", (), "KV cache blocks in the pool."),
    (f"{PREFIX}_kv_blocks_used", "gauge", (), "KV cache blocks held by sequences."),
    (f"{PREFIX}_kv_blocks_cached", "gauge", (),
     "KV cache blocks kept only for prefix reuse (evictable)."),
    (f"{PREFIX}_kv_cache_utilization_ratio", "gauge", (),
     "Used KV blocks divided by total KV blocks (0-1)."),
    (f"{PREFIX}_cache_config_info", "gauge", ("block_size", "num_gpu_blocks"),
     "KV cache configuration; the value is always 1."),
    (f"{PREFIX}_process_resident_memory_bytes", "gauge", (),
     "Resident memory of the executor process (process collector; also CPU seconds, fds)."),
    (f"{PREFIX}_device_memory_allocated_bytes", "gauge", (),
     "Device memory allocated by torch tensors (0 on CPU)."),
    (f"{PREFIX}_device_memory_reserved_bytes", "gauge", (),
     "Device memory reserved by torch's caching allocator (0 on CPU)."),
    (f"{PREFIX}_memory_plan_bytes", "gauge", ("part",),
     "Start-up memory plan: total, budget (total x utilisation), weights, activation_peak, "
     "cuda_graphs_reserved, cuda_graphs (measured), kv_cache. On CPU total is host memory, "
     "and weights are what the served model holds: its packed copies (float32 for "
     "bfloat16 on an AVX2 CPU) and the parameters left."),
    (f"{PREFIX}_rank_memory_plan_bytes", "gauge", ("rank", "part"),
     "Each tensor-parallel rank's start-up memory plan (parts as memory_plan_bytes, plus "
     "num_blocks, a count): rank 0 exports every rank's, a follower its own."),
    (f"{PREFIX}_tensor_parallel_size", "gauge", (),
     "Ranks the model is split over (1: not split)."),
    (f"{PREFIX}_collective_seconds_total", "counter", (),
     "Time the steps spent in tensor-parallel collectives on rank 0 (all-reduces, gathers)."),
    (f"{PREFIX}_cuda_graphs", "gauge", (),
     "Decode batch sizes captured as CUDA graphs (0 = every step runs eagerly)."),
    (f"{PREFIX}_ready", "gauge", (), "1 while the executor reports SERVING, else 0."),
    (f"{PREFIX}_faulted", "gauge", (),
     "1 once a forward failed after it may have been submitted (not an out-of-memory): the "
     "executor reports ERROR, refuses new work and must be restarted; else 0."),
    (f"{PREFIX}_step_ledger_bytes", "gauge", (),
     "Bytes of stored responses the step ledger holds for exactly-once retries (serialized "
     "size; at most --step-ledger-max-bytes)."),
    (f"{PREFIX}_tokens_total", "counter", ("kind",),
     "Tokens run through the model, by kind (prefill, decode, verify)."),
    (f"{PREFIX}_steps_total", "counter", (), "Batched forward steps executed."),
    (f"{PREFIX}_cuda_graph_replays_total", "counter", (),
     "Decode steps run by replaying a CUDA graph."),
    (f"{PREFIX}_steps_launched_ahead_total", "counter", (),
     "Steps launched while the step before them was still in flight (--launch-ahead): their "
     "host work overlapped that step's device time."),
    (f"{PREFIX}_admissions_total", "counter", ("outcome",),
     "Admission decisions (admitted, deferred, maintenance_deferred, rejected)."),
    (f"{PREFIX}_admission_probes_total", "counter", ("origin",),
     "Admission probes decided (TryAdmitPrefill calls and TryAdmitPrefillBatch probes that "
     "passed validation), by request origin (product, startup, diagnostic, unspecified)."),
    (f"{PREFIX}_completion_work_total", "counter", ("call", "work"),
     "CompleteCache (complete) and CancelPrefillAdmission (cancel) calls by the work they leave "
     "behind: none, or additional_or_unproven (after a fault)."),
    (f"{PREFIX}_deferrals_total", "counter", ("reason",),
     "Items deferred for lack of a resource (kv_blocks, sequence_slots, request_state)."),
    (f"{PREFIX}_preemptions_total", "counter", ("mode",),
     "Sequences preempted (recompute, swap)."),
    (f"{PREFIX}_completions_total", "counter", ("outcome",),
     "CompleteCache calls by outcome: completed (this call released the live cache), or how the "
     "cache had already ended (already_completed, already_released, cancelled, preempted, "
     "expired)."),
    (f"{PREFIX}_completed_tokens_total", "counter", ("kind",),
     "Tokens of successfully completed sequences as CompleteCache reported them (input, "
     "output), after they were checked against the cache's committed length."),
    (f"{PREFIX}_caches_expired_total", "counter", (),
     "Caches released because no call named them for the cache lease (--cache-lease-s)."),
    (f"{PREFIX}_prefix_cache_queries_total", "counter", (),
     "Prompt tokens looked up in the prefix cache."),
    (f"{PREFIX}_prefix_cache_hits_total", "counter", (),
     "Prompt tokens found in the prefix cache."),
    (f"{PREFIX}_kv_blocks_evicted_total", "counter", (),
     "Prefix-cache blocks evicted to make room for new allocations."),
    (f"{PREFIX}_execution_events_dropped_total", "counter", (),
     "Execution events a WatchExecutionEvents reader missed because it fell more than 1024 "
     "events behind (it got an events_dropped marker instead)."),
    ("grpc_server_started_total", "counter", GRPC_LABELS, "RPCs started on the server."),
    ("grpc_server_handled_total", "counter", (*GRPC_LABELS, "grpc_code"),
     "RPCs completed on the server, by status code."),
    (f"{PREFIX}_batch_size", "histogram", (), "Items per executed step."),
    (f"{PREFIX}_batch_tokens", "histogram", (), "Tokens per executed step."),
    (f"{PREFIX}_step_duration_seconds", "histogram", ("kind",),
     "Wall time of one step (prefill, decode, mixed)."),
    (f"{PREFIX}_completion_output_tokens", "histogram", (),
     "Output tokens per successfully completed sequence (CompleteCache)."),
    (f"{PREFIX}_time_to_first_token_seconds", "histogram", (),
     "Time from a request's admission to its first sampled token."),
    (f"{PREFIX}_inter_token_latency_seconds", "histogram", (),
     "Time between consecutive decode tokens of one sequence."),
    ("grpc_server_handling_seconds", "histogram", GRPC_LABELS,
     "Time to handle an RPC, until its last response was sent."),
]
# fmt: on


def render_markdown_table(
    docs: Iterable[tuple[str, str, tuple[str, ...], str]] = METRIC_DOCS,
) -> str:
    """The metrics table of docs/operations.md, rendered from METRIC_DOCS."""
    lines = ["| Metric | Type | Labels | Description |", "| --- | --- | --- | --- |"]
    for name, kind, labels, description in docs:
        label_text = ", ".join(f"`{label}`" for label in labels) or "—"
        lines.append(f"| `{name}` | {kind} | {label_text} | {description} |")
    return "\n".join(lines) + "\n"


_HELP = {name: text for name, _, _, text in METRIC_DOCS}


def _help(name: str) -> str:
    """HELP text from METRIC_DOCS, so the exposition and docs/operations.md say the same thing."""
    return _HELP.get(name) or _HELP.get(f"{name}_total") or _HELP[f"{name}_info"]


def _check(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {allowed}")
    return value


class Metrics:
    """All metrics of one executor, on a private registry."""

    def __init__(
        self, registry: CollectorRegistry | None = None, process_collectors: bool = True
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._http: Any = None
        if process_collectors:
            ProcessCollector(namespace=PREFIX, registry=self.registry)
            PlatformCollector(registry=self.registry)
        p = PREFIX
        self.sequences_running = self._gauge(f"{p}_sequences_running")
        self.requests_waiting = self._gauge(f"{p}_requests_waiting")
        self.kv_blocks = self._gauge(f"{p}_kv_blocks")
        self.kv_blocks_used = self._gauge(f"{p}_kv_blocks_used")
        self.kv_blocks_cached = self._gauge(f"{p}_kv_blocks_cached")
        self.kv_utilization = self._gauge(f"{p}_kv_cache_utilization_ratio")
        # Info appends `_info` and exposes one series with value 1 (a gauge in text format).
        self.cache_config = Info(
            f"{p}_cache_config", _help(f"{p}_cache_config"), registry=self.registry
        )
        self.device_allocated = self._gauge(f"{p}_device_memory_allocated_bytes")
        self.device_reserved = self._gauge(f"{p}_device_memory_reserved_bytes")
        self.memory_plan = Gauge(
            f"{p}_memory_plan_bytes",
            _help(f"{p}_memory_plan_bytes"),
            ("part",),
            registry=self.registry,
        )
        self.rank_memory_plan = Gauge(
            f"{p}_rank_memory_plan_bytes",
            _help(f"{p}_rank_memory_plan_bytes"),
            ("rank", "part"),
            registry=self.registry,
        )
        self.tensor_parallel_size = self._gauge(f"{p}_tensor_parallel_size")
        self.tensor_parallel_size.set(1)
        self.collective_seconds = self._counter(f"{p}_collective_seconds")
        self.cuda_graphs = self._gauge(f"{p}_cuda_graphs")
        self.ready = self._gauge(f"{p}_ready")
        self.faulted = self._gauge(f"{p}_faulted")
        self.step_ledger_bytes = self._gauge(f"{p}_step_ledger_bytes")
        self.tokens = self._counter(f"{p}_tokens", "kind")
        self.steps = self._counter(f"{p}_steps")
        self.cuda_graph_replays = self._counter(f"{p}_cuda_graph_replays")
        self.steps_launched_ahead = self._counter(f"{p}_steps_launched_ahead")
        self.admissions = self._counter(f"{p}_admissions", "outcome")
        self.admission_probes = self._counter(f"{p}_admission_probes", "origin")
        self.completion_work = self._counter(f"{p}_completion_work", "call", "work")
        self.deferrals = self._counter(f"{p}_deferrals", "reason")
        self.preemptions = self._counter(f"{p}_preemptions", "mode")
        self.completions = self._counter(f"{p}_completions", "outcome")
        self.completed_tokens = self._counter(f"{p}_completed_tokens", "kind")
        self.completion_output_tokens = self._histogram(
            f"{p}_completion_output_tokens", BATCH_TOKEN_BUCKETS
        )
        self.caches_expired = self._counter(f"{p}_caches_expired")
        self.prefix_queries = self._counter(f"{p}_prefix_cache_queries")
        self.prefix_hits = self._counter(f"{p}_prefix_cache_hits")
        self.kv_evictions = self._counter(f"{p}_kv_blocks_evicted")
        self.events_dropped = self._counter(f"{p}_execution_events_dropped")
        self.rpc_started = self._counter("grpc_server_started", *GRPC_LABELS)
        self.rpc_handled = self._counter("grpc_server_handled", *GRPC_LABELS, "grpc_code")
        self.batch_size = self._histogram(f"{p}_batch_size", BATCH_SIZE_BUCKETS)
        self.batch_tokens = self._histogram(f"{p}_batch_tokens", BATCH_TOKEN_BUCKETS)
        self.step_duration = self._histogram(
            f"{p}_step_duration_seconds", STEP_SECONDS_BUCKETS, "kind"
        )
        self.ttft = self._histogram(f"{p}_time_to_first_token_seconds", TTFT_SECONDS_BUCKETS)
        self.itl = self._histogram(f"{p}_inter_token_latency_seconds", ITL_SECONDS_BUCKETS)
        self.rpc_seconds = self._histogram(
            "grpc_server_handling_seconds", RPC_SECONDS_BUCKETS, *GRPC_LABELS
        )
        # Create every bounded label child now, so dashboards see zeros rather than gaps.
        for kind in TOKEN_KINDS:
            self.tokens.labels(kind)
        for kind in STEP_KINDS:
            self.step_duration.labels(kind)
        for outcome in ADMISSION_OUTCOMES:
            self.admissions.labels(outcome)
        for reason in DEFERRAL_REASONS:
            self.deferrals.labels(reason)
        for mode in PREEMPTION_MODES:
            self.preemptions.labels(mode)
        for origin in REQUEST_ORIGINS:
            self.admission_probes.labels(origin)
        for call in COMPLETION_CALLS:
            for work in COMPLETION_WORK:
                self.completion_work.labels(call, work)
        for part in MEMORY_PARTS:
            self.memory_plan.labels(part)
        for outcome in COMPLETION_OUTCOMES:
            self.completions.labels(outcome)
        for token_kind in COMPLETED_TOKEN_KINDS:
            self.completed_tokens.labels(token_kind)

    def _gauge(self, name: str) -> Gauge:
        return Gauge(name, _help(name), registry=self.registry)

    def _counter(self, name: str, *labels: str) -> Counter:
        return Counter(name, _help(name), labels, registry=self.registry)

    def _histogram(self, name: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
        return Histogram(name, _help(name), labels, buckets=buckets, registry=self.registry)

    # -- engine-side ----------------------------------------------------------------------

    def record_step(
        self,
        kind: str,
        num_items: int,
        num_tokens: int,
        prefill_tokens: int,
        decode_tokens: int,
        verify_tokens: int,
        seconds: float,
    ) -> None:
        """One executed step: kind is prefill, decode or mixed."""
        self.step_duration.labels(_check(kind, STEP_KINDS, "step kind")).observe(seconds)
        self.steps.inc()
        self.batch_size.observe(num_items)
        self.batch_tokens.observe(num_tokens)
        for token_kind, count in zip(
            TOKEN_KINDS, (prefill_tokens, decode_tokens, verify_tokens), strict=True
        ):
            if count:
                self.tokens.labels(token_kind).inc(count)

    def set_kv(self, total: int, used: int, cached: int = 0) -> None:
        self.kv_blocks.set(total)
        self.kv_blocks_used.set(used)
        self.kv_blocks_cached.set(cached)
        self.kv_utilization.set(used / total if total > 0 else 0.0)

    def set_cache_config(self, block_size: int, num_gpu_blocks: int) -> None:
        self.cache_config.info(
            {"block_size": str(block_size), "num_gpu_blocks": str(num_gpu_blocks)}
        )

    def set_memory_plan(self, parts: dict[str, int], num_cuda_graphs: int) -> None:
        """The start-up memory plan (MemoryPlan.parts()) and how many graphs were captured."""
        for part, value in parts.items():
            self.memory_plan.labels(_check(part, MEMORY_PARTS, "memory part")).set(value)
        self.cuda_graphs.set(num_cuda_graphs)

    def set_rank_memory_plans(self, plans: Sequence[dict[str, int]], first_rank: int = 0) -> None:
        """Ranks' plans (parts and num_blocks), ``plans[i]`` being rank first_rank + i's."""
        for index, plan in enumerate(plans):
            for part, value in plan.items():
                self.rank_memory_plan.labels(str(first_rank + index), part).set(value)

    def set_tensor_parallel_size(self, size: int) -> None:
        self.tensor_parallel_size.set(size)

    def record_collective(self, seconds: float) -> None:
        self.collective_seconds.inc(seconds)

    def record_cuda_graph_replay(self) -> None:
        self.cuda_graph_replays.inc()

    def record_launched_ahead(self) -> None:
        self.steps_launched_ahead.inc()

    def set_sequences(self, running: int, waiting: int) -> None:
        self.sequences_running.set(running)
        self.requests_waiting.set(waiting)

    def record_deferral(self, reason: str, count: int = 1) -> None:
        self.deferrals.labels(_check(reason, DEFERRAL_REASONS, "deferral reason")).inc(count)

    def record_admission(self, outcome: str) -> None:
        self.admissions.labels(_check(outcome, ADMISSION_OUTCOMES, "admission outcome")).inc()

    def record_preemption(self, mode: str, count: int = 1) -> None:
        self.preemptions.labels(_check(mode, PREEMPTION_MODES, "preemption mode")).inc(count)

    def record_admission_probe(self, origin: str) -> None:
        self.admission_probes.labels(_check(origin, REQUEST_ORIGINS, "request origin")).inc()

    def record_completion_work(self, call: str, work: str) -> None:
        self.completion_work.labels(
            _check(call, COMPLETION_CALLS, "completion call"),
            _check(work, COMPLETION_WORK, "completion work"),
        ).inc()

    def record_evictions(self, count: int) -> None:
        self.kv_evictions.inc(count)

    def record_events_dropped(self, count: int) -> None:
        self.events_dropped.inc(count)

    def set_faulted(self, faulted: bool) -> None:
        self.faulted.set(1 if faulted else 0)

    def record_completion(self, outcome: str, input_tokens: int, output_tokens: int) -> None:
        """One CompleteCache: its outcome; the token counts only when it completed the cache (a
        repeat, or a completion of an already ended cache, counts no tokens)."""
        self.completions.labels(_check(outcome, COMPLETION_OUTCOMES, "completion outcome")).inc()
        if outcome != "completed":
            return
        self.completed_tokens.labels("input").inc(input_tokens)
        self.completed_tokens.labels("output").inc(output_tokens)
        self.completion_output_tokens.observe(output_tokens)

    def record_caches_expired(self, count: int) -> None:
        self.caches_expired.inc(count)

    def record_prefix(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries.inc(queried_tokens)
        self.prefix_hits.inc(hit_tokens)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_itls(self, seconds: Sequence[float]) -> None:
        """Many inter-token latencies at once (a decode step's outputs): see observe_many."""
        observe_many(self.itl, seconds)

    def set_ready(self, ready: bool) -> None:
        self.ready.set(1 if ready else 0)

    def update_device_memory(self, device: str | int | None = None) -> None:
        """Read torch.cuda's allocator counters; leaves zeros without CUDA or torch."""
        try:
            import torch
        except ImportError:
            return
        if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return
        self.device_allocated.set(torch.cuda.memory_allocated(device))
        self.device_reserved.set(torch.cuda.memory_reserved(device))

    # -- server-side ----------------------------------------------------------------------

    def set_step_ledger_bytes(self, num_bytes: int) -> None:
        self.step_ledger_bytes.set(num_bytes)

    def observe_rpc(self, method: str, code: str, seconds: float, grpc_type: str = "unary") -> None:
        """A finished RPC; method is the full '/package.Service/Method' path or 'Method'."""
        service, _, name = method.lstrip("/").rpartition("/")
        labels = (grpc_type, service, name)
        self.rpc_handled.labels(*labels, code).inc()
        self.rpc_seconds.labels(*labels).observe(seconds)

    def rpc_start(self, method: str, grpc_type: str = "unary") -> None:
        service, _, name = method.lstrip("/").rpartition("/")
        self.rpc_started.labels(grpc_type, service, name).inc()

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)

    def start_http_server(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve /metrics from a daemon thread; port 0 picks one. Returns the bound port."""
        started = prometheus_client.start_http_server(port, addr=host, registry=self.registry)
        if isinstance(started, tuple):  # prometheus-client >= 0.19 returns (server, thread)
            self._http = started[0]
            return int(started[0].server_port)
        if port == 0:
            raise RuntimeError("this prometheus-client cannot report the port it bound")
        return port

    def stop_http_server(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
    """Observe every value of `values` (finite numbers) in an unlabelled histogram, with the
    counts and sum that one observe() each would give. The values are bucketed here and each
    touched bucket is incremented once: a decode step of hundreds of outputs then takes a few
    locked increments instead of a locked bucket walk per output. This reads prometheus_client's
    bucket layout; a layout without those attributes takes the plain observe() path."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None:
        for value in values:
            histogram.observe(value)
        return
    # observe() counts a value in the first bucket whose upper bound is >= the value.
    for index, count in Tally(bisect_left(bounds, value) for value in values).items():
        buckets[index].inc(count)
    total.inc(sum(values))
