"""Accounting of what the engine did: step counters for GetStatus/GetMetrics, and the Prometheus
metrics. The engine and the capacity manager report to one Recorder given at construction.

Engine thread only, like everything it is told about; GetMetrics and GetStatus read the counters
and the latency windows from the event loop (single writes of ints and floats, which the loop
sees whole).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ferrum_server.domain import CapacityDeferral, CapacityUnit, ItemKind, StepItem
from ferrum_server.kv.manager import Cache, KvManager
from ferrum_server.metrics import Metrics

# Steps of each kind the p95 latencies of GetMetrics are taken over (the most recent ones).
LATENCY_WINDOW_STEPS = 1024


class LatencyWindow:
    """The latencies (ms) of the last `size` steps of one kind, in a fixed ring: adding is one
    store, and a percentile sorts at most `size` floats when GetMetrics asks."""

    def __init__(self, size: int = LATENCY_WINDOW_STEPS) -> None:
        self.size = size
        self._values = [0.0] * size
        self._count = 0
        self._next = 0

    def add(self, ms: float) -> None:
        self._values[self._next] = ms
        self._next = (self._next + 1) % self.size
        self._count = min(self._count + 1, self.size)

    def __len__(self) -> int:
        return self._count

    def percentile(self, fraction: float) -> float:
        """Nearest-rank percentile (fraction in (0, 1]) of the window; 0.0 when empty."""
        values = sorted(self._values[: self._count])  # one slice: a consistent copy
        if not values:
            return 0.0
        return values[max(0, math.ceil(fraction * len(values)) - 1)]


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_time_ns: int = 0
    decode_time_ns: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    items: int = 0
    # Items of the last step that ran (of the running one once it ends).
    current_batch_size: int = 0
    # Items of the steps running now (two when one was launched ahead); 0 when idle (read by
    # GetStatus on the event loop).
    running_items: int = 0
    graph_steps: int = 0  # decode steps replayed from a CUDA graph
    # Steps launched while another was still in flight (Engine.launch).
    launched_ahead_steps: int = 0
    # Latest prefill-carrying and decode-only step latencies, for GetMetrics' p95.
    prefill_window: LatencyWindow = field(default_factory=LatencyWindow, compare=False)
    decode_window: LatencyWindow = field(default_factory=LatencyWindow, compare=False)


class Recorder:
    def __init__(self, metrics: Metrics | None = None) -> None:
        self.stats = EngineStats()
        # Its own registry (never the process-global one), so engines in one process never clash.
        self.metrics = metrics if metrics is not None else Metrics()
        self._evictions_seen = 0

    def begin(self, num_items: int) -> None:
        """A step (or warmup forward) of num_items items starts: GetStatus reports BUSY."""
        self.stats.running_items += num_items

    def launched_ahead(self) -> None:
        """A step launched while another was still in flight (Engine.launch)."""
        self.stats.launched_ahead_steps += 1
        self.metrics.record_launched_ahead()

    def end(self, num_items: int) -> None:
        """It ended (ran, deferred or failed): its size stays the current batch size."""
        self.stats.current_batch_size = num_items
        self.stats.running_items = max(0, self.stats.running_items - num_items)

    def forward(self, items: Sequence[StepItem], elapsed_ns: int, graphed: bool) -> None:
        """Count one forward: elapsed_ns covers forward plus sampling; graphed when it replayed
        a CUDA graph. A step bisected after a device OOM counts each part that ran."""
        stats = self.stats
        stats.steps += 1
        stats.items += len(items)
        prefill = sum(len(i.token_ids) for i in items if i.kind != ItemKind.DECODE)
        stats.prefill_tokens += prefill
        stats.decode_tokens += sum(1 for i in items if i.kind == ItemKind.DECODE)
        if prefill:
            stats.prefill_steps += 1
            stats.prefill_time_ns += elapsed_ns
            stats.prefill_window.add(elapsed_ns / 1e6)
        else:
            stats.decode_steps += 1
            stats.decode_time_ns += elapsed_ns
            stats.decode_window.add(elapsed_ns / 1e6)
        stats.graph_steps += int(graphed)

    def step(
        self,
        deferrals: Iterable[CapacityDeferral],
        ran: Sequence[tuple[StepItem, Cache]],
        elapsed_ns: int,
        graphed: bool,
    ) -> None:
        """Observe a whole step: its deferrals, what ran, and each output's token latency."""
        metrics = self.metrics
        for deferral in deferrals:
            unit = deferral.shortfall.unit
            metrics.record_deferral(
                "sequence_slots" if unit == CapacityUnit.SEQUENCES else "kv_blocks"
            )
        if not ran:
            return
        prefill = decode = verify = 0
        for item, _ in ran:
            if item.kind == ItemKind.PREFILL_CHUNK:
                prefill += len(item.token_ids)
            elif item.kind == ItemKind.DECODE:
                decode += 1
            else:
                verify += len(item.token_ids)
        kind = "mixed" if prefill and (decode or verify) else "prefill" if prefill else "decode"
        metrics.record_step(
            kind, len(ran), prefill + decode + verify, prefill, decode, verify, elapsed_ns / 1e9
        )
        if graphed:
            metrics.record_cuda_graph_replay()
        now = time.monotonic()
        itls: list[float] = []
        for item, cache in ran:
            if not item.num_outputs:
                continue
            if cache.last_token_s:
                itls.append(now - cache.last_token_s)
            else:
                metrics.observe_ttft(now - cache.opened_s)
            cache.last_token_s = now
        if itls:
            metrics.observe_itls(itls)

    def gauges(self, kv: KvManager) -> None:
        """Refresh the KV and cache gauges from the pool as it is now."""
        pool = kv.pool
        self.metrics.set_kv(pool.num_blocks, pool.num_used, pool.num_cached)
        if pool.num_evictions > self._evictions_seen:
            self.metrics.record_evictions(pool.num_evictions - self._evictions_seen)
            self._evictions_seen = pool.num_evictions
        waiting = sum(1 for c in kv.caches.values() if c.pending_admission)
        self.metrics.set_sequences(len(kv.caches) - waiting, waiting)
        self.metrics.update_device_memory()
