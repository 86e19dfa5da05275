"""Where the KV pool puts a cache's blocks, and what it does to the decode attention.

Runs a bench workload's prompts through an in-process engine as the reference scheduler runs
them (prompts chunked across steps of at most --step-tokens tokens, several prompts a step,
each cache declaring its prompt plus --new tokens as its maximum), then --new - 1 decode steps
of every request, and times the decode attention's native calls in those steps. Two block
placements, each on a fresh engine, alternating over --rounds rounds:

- ``runs``: the pool as it serves (``kv/block_pool.py``): a cache grows into the blocks after
  its last one, and a new cache starts at a free run with room for its declared maximum;
- ``free-list``: the same pool with those hints dropped, every block taken off the free list
  (as before the placement: chunked prompts and decode growth interleave the caches' blocks).

For each it prints how many of the caches' blocks do not follow their predecessor in the pool
(``breaks``), and the median decode attention and decode step in ms. Run it alone on a quiet
machine (``--workload w1-long --new 256`` for the decode-heavy case).

    python benchmarks/kv_layout_bench.py [--workload w1] [--new 64] [--dtype bfloat16]
        [--rounds 3] [--step-tokens 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

from ferrum_kernels import native
from ferrum_server.config import EngineConfig
from ferrum_server.domain import ItemKind, Step, StepItem
from ferrum_server.engine import Engine
from ferrum_server.kv.block_pool import BlockPool
from ferrum_server.tools.bench.workloads import WORKLOADS, ensure_model

PLACEMENTS = ("runs", "free-list")


@contextlib.contextmanager
def _placement(name: str) -> Iterator[None]:
    """The pool's placement for engines built inside: as it serves, or the free list alone."""
    if name == "runs":
        yield
        return
    allocate = BlockPool.allocate

    def free_list(
        self: BlockPool, count: int, after: int | None = None, room: int = 0
    ) -> list[int]:
        return allocate(self, count)

    BlockPool.allocate = free_list  # type: ignore[method-assign]
    try:
        yield
    finally:
        BlockPool.allocate = allocate  # type: ignore[method-assign]


@contextlib.contextmanager
def _timed_attention(spent: list[float]) -> Iterator[None]:
    """Adds each native decode-attention call's seconds to spent[0] meanwhile."""
    module: Any = native.load()
    real = module.decode_attention

    def timed(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return real(*args)
        finally:
            spent[0] += time.perf_counter() - started

    module.decode_attention = timed
    try:
        yield
    finally:
        module.decode_attention = real


def _prefill_steps(prompts: list[list[int]], step_tokens: int) -> list[list[tuple[int, int, int]]]:
    """The chunks of each prefill step, as (request, start, end): prompts in order, a step
    taking them until its token budget is spent (the last one cut there)."""
    steps: list[list[tuple[int, int, int]]] = []
    request, done = 0, 0
    while request < len(prompts):
        chunks, budget = [], step_tokens
        while request < len(prompts) and budget > 0:
            n = min(budget, len(prompts[request]) - done)
            chunks.append((request, done, done + n))
            budget -= n
            done += n
            if done == len(prompts[request]):
                request, done = request + 1, 0
        steps.append(chunks)
    return steps


def run_once(
    engine: Engine, prompts: list[list[int]], new: int, step_tokens: int
) -> dict[str, Any]:
    """Prefill then decode every prompt on `engine` (its thread): breaks and timings."""
    caches = [""] * len(prompts)
    last = [0] * len(prompts)
    for chunks in _prefill_steps(prompts, step_tokens):
        items = [
            StepItem(
                ItemKind.PREFILL_CHUNK,
                f"r{request}",
                caches[request],
                prompts[request][start:end],
                start,
                len(prompts[request]),
                len(prompts[request]) + new,
            )
            for request, start, end in chunks
        ]
        results = engine.execute(Step(items), time.perf_counter_ns()).results
        for (request, _, _), result in zip(chunks, results, strict=True):
            caches[request] = result.cache_id
            if result.token_ids:
                last[request] = result.token_ids[0]
    lengths = [len(p) for p in prompts]
    spent, attention_ms, step_ms = [0.0], [], []
    with _timed_attention(spent):
        for _ in range(new - 1):
            items = [
                StepItem(ItemKind.DECODE, f"r{i}", caches[i], [last[i]], lengths[i])
                for i in range(len(prompts))
            ]
            spent[0] = 0.0
            started = time.perf_counter()
            results = engine.execute(Step(items), time.perf_counter_ns()).results
            step_ms.append((time.perf_counter() - started) * 1e3)
            attention_ms.append(spent[0] * 1e3)
            for i, result in enumerate(results):
                last[i] = result.token_ids[0]
                lengths[i] += 1
    blocks = [list(engine.kv.lookup(cache_id).block_ids) for cache_id in caches]
    engine.release_caches(caches)
    return {
        "breaks": sum(1 for ids in blocks for a, b in itertools.pairwise(ids) if b != a + 1),
        "blocks": sum(len(ids) for ids in blocks),
        "attention_ms": statistics.median(attention_ms) if attention_ms else 0.0,
        "step_ms": statistics.median(step_ms) if step_ms else 0.0,
    }


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Prints each placement's rounds and medians; returns every round's figures by placement."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="w1", choices=sorted(WORKLOADS))
    parser.add_argument("--new", type=int, default=64, help="tokens each request generates")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-tokens", type=int, default=1024, help="a prefill step's budget")
    args = parser.parse_args(argv)
    if args.new < 2 or args.rounds < 1 or args.step_tokens < 1:
        parser.error("--new must be at least 2, --rounds and --step-tokens at least 1")
    workload = WORKLOADS[args.workload]
    if workload.shared_prefix:
        parser.error("a workload with a shared prompt shares its blocks: use one without")
    folder = ensure_model(workload)
    prompts = workload.prompts()
    config = EngineConfig(
        model=str(folder),
        dtype=args.dtype,
        kv_cache_bytes=workload.kv_cache_bytes,
        max_batch_tokens=max(args.step_tokens, len(prompts)),
        max_batch_size=max(256, len(prompts)),
    )
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in PLACEMENTS}
    for _ in range(args.rounds):  # alternating, so a slow spell lands on both
        for name in PLACEMENTS:
            with _placement(name):
                engine = Engine(config)
                try:
                    engine.call_sync(engine.warmup, len(prompts))
                    found[name].append(
                        engine.call_sync(run_once, engine, prompts, args.new, args.step_tokens)
                    )
                finally:
                    engine.shutdown()
    lines = [f"{args.workload}, {len(prompts)} requests, {args.new} new tokens, {args.dtype}:"]
    for name, rounds in found.items():
        attention = statistics.median(r["attention_ms"] for r in rounds)
        step = statistics.median(r["step_ms"] for r in rounds)
        per_round = " / ".join(f"{r['attention_ms']:.2f}" for r in rounds)
        lines.append(
            f"{name:9s}: breaks {rounds[0]['breaks']} of {rounds[0]['blocks']} blocks; decode "
            f"attention {attention:.2f} ms a step ({per_round}), decode step {step:.2f} ms"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    return found


if __name__ == "__main__":
    main()
