"""Where the KV pool puts a cache's blocks, and what it does to the decode attention.

Runs a bench workload through the reference scheduler over an in-process engine
(``ferrum-executor bench``'s ``ferrum-inproc`` run: the same admission, chunking and decode
steps, no gRPC), once per block placement, each on a fresh engine, alternating over --rounds
rounds:

- ``runs``: the pool as it serves (``kv/block_pool.py``): a cache grows into the blocks after
  its last one, and a new cache starts at a free run with room for its declared maximum;
- ``free-list``: the same pool with those hints dropped, every block taken off the free list
  (as before the placement: chunked prompts and decode growth interleave the caches' blocks).

For each it prints how many blocks of the caches the run releases (its four-prompt warm-up's
included) do not follow their predecessor in the pool (``out of order``), the native decode
attention's time per step that decodes (all of its calls over the run, divided by those
steps), and the median forward of the decode-only steps. Run it alone on a quiet machine
(``--workload w1-long`` for the decode-heavy case).

    python benchmarks/kv_layout_bench.py [--workload w1] [--dtype bfloat16] [--rounds 3]
        [--step-tokens N]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from ferrum_kernels import native
from ferrum_server.kv.block_pool import BlockPool
from ferrum_server.kv.manager import KvManager
from ferrum_server.tools.bench.runners import RunSpec, run_ferrum_inproc
from ferrum_server.tools.bench.workloads import WORKLOADS, ensure_model

PLACEMENTS = ("runs", "free-list")


@contextlib.contextmanager
def _placement(name: str) -> Iterator[None]:
    """The pool's placement meanwhile: as it serves, or the free list alone."""
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
def _observed(found: dict[str, float]) -> Iterator[None]:
    """Meanwhile: the native decode attention's seconds in found["attention_s"], and the
    blocks of every released cache, and how many of them are out of order, in found."""
    module: Any = native.load()
    attention, release = module.decode_attention, KvManager.release

    def timed(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return attention(*args)
        finally:
            found["attention_s"] += time.perf_counter() - started

    def counted(self: KvManager, cache_id: str, **kwargs: Any) -> Any:
        cache = self.caches.get(cache_id)
        if cache is not None:
            ids = cache.block_ids
            found["blocks"] += len(ids)
            found["out_of_order"] += sum(1 for a, b in itertools.pairwise(ids) if b != a + 1)
        return release(self, cache_id, **kwargs)

    module.decode_attention, KvManager.release = timed, counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        module.decode_attention, KvManager.release = attention, release  # type: ignore[method-assign]


def run_once(spec: RunSpec, placement: str) -> dict[str, float]:
    """One scheduler run of `spec` in process with `placement`: its blocks and timings."""
    found = {"attention_s": 0.0, "blocks": 0, "out_of_order": 0}
    with _placement(placement), _observed(found):
        output = run_ferrum_inproc(spec)
    decoding = [s for s in output.steps if s["decodes"] > 0]
    decode_only = [s["forward_ms"] for s in decoding if s["prefill_tokens"] == 0]
    return {
        "blocks": found["blocks"],
        "out_of_order": found["out_of_order"],
        "attention_ms": found["attention_s"] * 1e3 / max(1, len(decoding)),
        "decode_forward_ms": statistics.median(decode_only) if decode_only else 0.0,
    }


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, float]]]:
    """Prints each placement's rounds and medians; returns every round's figures by placement."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="w1", choices=sorted(WORKLOADS))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--step-tokens", type=int, default=0, help="the scheduler's step budgets (0: defaults)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.step_tokens < 0:
        parser.error("--rounds must be at least 1 and --step-tokens not negative")
    workload = WORKLOADS[args.workload]
    spec = RunSpec(
        system="ferrum-inproc",
        workload=args.workload,
        model_dir=str(ensure_model(workload)),
        dtype=args.dtype,
        prompts=workload.prompts(),
        max_new_tokens=workload.max_new_tokens,
        kv_cache_bytes=workload.kv_cache_bytes,
        prefix_caching=workload.prefix_caching,
        progress=False,
    )
    if args.step_tokens:
        spec = replace(
            spec, max_step_tokens=args.step_tokens, max_prefill_step_tokens=args.step_tokens
        )
    found: dict[str, list[dict[str, float]]] = {name: [] for name in PLACEMENTS}
    for _ in range(args.rounds):  # alternating, so a slow spell lands on both
        for name in PLACEMENTS:
            found[name].append(run_once(spec, name))
    lines = [
        f"{args.workload}, {len(spec.prompts)} requests, {spec.max_new_tokens} new tokens, "
        f"{args.dtype}:"
    ]
    for name, rounds in found.items():
        attention = statistics.median(r["attention_ms"] for r in rounds)
        forward = statistics.median(r["decode_forward_ms"] for r in rounds)
        per_round = " / ".join(f"{r['attention_ms']:.2f}" for r in rounds)
        lines.append(
            f"{name:9s}: {rounds[0]['out_of_order']:.0f} of {rounds[0]['blocks']:.0f} blocks "
            f"out of order; decode attention {attention:.2f} ms a step ({per_round}), "
            f"decode forward {forward:.2f} ms"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    return found


if __name__ == "__main__":
    main()
