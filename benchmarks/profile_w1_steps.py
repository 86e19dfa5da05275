"""Where a W1 step's time goes: torch.profiler over in-process steps of the W1 model.

Builds (or reuses) the W1 weights, prefills 64 prompts of 256 tokens in steps of two, then
profiles prefill steps (2 x 256 tokens from position 0) and decode steps (64 decodes), and
prints each kind's wall time per step and the ops taking the most self time. Run it alone on a
quiet machine.

    python benchmarks/profile_w1_steps.py [--dtype float32] [--reps 3] [--top 12]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from ferrum_server.config import EngineConfig
from ferrum_server.domain import ItemKind, Step, StepItem
from ferrum_server.engine import Engine
from ferrum_server.tools.bench.workloads import WORKLOADS, ensure_model
from torch.profiler import ProfilerActivity, profile

PROMPTS, PROMPT_TOKENS = 64, 256


def _profile(label: str, fn: Callable[[], None], reps: int, top: int) -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        wall_ms = (time.perf_counter() - started) * 1e3 / reps
    by_op: defaultdict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        by_op[event.key] += event.self_cpu_time_total / 1e3 / reps
    lines = [f"== {label}: {wall_ms:.1f} ms per step"]
    for name, ms in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {ms:8.1f} ms  {name}")
    sys.stdout.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    folder = ensure_model(WORKLOADS["w1"])
    engine = Engine(
        EngineConfig(
            model=str(folder),
            dtype=args.dtype,
            kv_cache_bytes=1 << 30,
            max_batch_tokens=1024,
            max_batch_size=256,
        )
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32000, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(64)]
    caches: list[str] = []
    last: list[int] = []
    position: list[int] = []

    def prefill() -> None:
        first = len(caches)
        items = [
            StepItem(ItemKind.PREFILL_CHUNK, f"r{i}", "", prompts[i], 0, PROMPT_TOKENS)
            for i in (first, first + 1)
        ]
        for result in engine.execute(Step(items), time.perf_counter_ns()).results:
            caches.append(result.cache_id)
            last.append(result.token_ids[0])
            position.append(PROMPT_TOKENS)

    def decode() -> None:
        items = [
            StepItem(ItemKind.DECODE, f"r{i}", caches[i], [last[i]], position[i])
            for i in range(len(caches))
        ]
        for i, result in enumerate(engine.execute(Step(items), time.perf_counter_ns()).results):
            last[i] = result.token_ids[0]
            position[i] += 1

    try:
        engine.warmup(64)
        _profile("prefill step, 2 x 256 tokens from position 0", prefill, args.reps, args.top)
        while len(caches) < PROMPTS:
            prefill()
        _profile(f"decode step, {PROMPTS} decodes at ~256 context", decode, args.reps, args.top)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
