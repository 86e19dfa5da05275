"""The fused elementwise kernels at W1's shapes: RMSNorm with the residual add, and rotary.

``add_rms_norm_`` runs on [rows, 768] (W1's hidden size) and ``rotary_`` on the q and k heads of
a [rows, 1280] qkv projection (12 query and 4 KV heads of 64, rotated in one call, as
``cpu_fused.rotary_cpu`` does when k follows q). For each dtype and row count (64: a decode
step; 1024: a prefill step) each kernel runs ``--calls`` times in a row, in cache, and each line
prints the median over ``--rounds`` rounds in microseconds a call. The same allocator settings
as a served engine (``host_memory``) are applied first, so an output buffer is not a fresh
mapping each call. To compare two builds, run it in a worktree of each, alternating; run it
alone on a quiet machine.

    python benchmarks/fused_ops_bench.py [--rows 64,1024] [--rounds 5] [--calls 2000]
        [--dtype float32,bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from ferrum_kernels import native
from ferrum_server import host_memory

HIDDEN, QKV, ROTATED_HEADS, HEAD_DIM = 768, 1280, 16, 64


def _per_call_us(fn: Callable[[], object], calls: int, rounds: int) -> float:
    for _ in range(min(calls, 20)):  # warm-up: first-call costs stay out of the rounds
        fn()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Prints the times; returns them too, per "<dtype> rows=<rows>", in microseconds a call."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,1024")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=0, help="0: 2000 at 64 rows, fewer above")
    parser.add_argument("--dtype", default="float32,bfloat16")
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    dtypes = args.dtype.split(",")
    if any(r < 1 for r in rows_list) or args.rounds < 1 or args.calls < 0:
        parser.error("--rows and --rounds must be >= 1, --calls >= 0")
    if any(d not in ("float32", "bfloat16") for d in dtypes):
        parser.error("--dtype takes float32 and/or bfloat16")
    module = native.load()
    if module is None:
        sys.exit("needs the native kernels (a C++ compiler and ninja)")
    host_memory.keep_freed_memory()
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    out = sys.stdout
    out.write(f"threads {torch.get_num_threads()}, microseconds a call (median of rounds)\n")
    for name in dtypes:
        dtype = getattr(torch, name)
        for rows in rows_list:
            calls = args.calls or max(20, 2000 * 64 // max(rows, 64))
            residual = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
            delta = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
            weight = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)
            qkv = torch.randn(rows, QKV, generator=gen).to(dtype)
            # Real rotations, so that q and k keep their size over thousands of calls in place.
            angle = torch.rand(rows, HEAD_DIM // 2, generator=gen) * 6.3
            cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
            norm = _per_call_us(
                lambda r=residual, d=delta, w=weight: module.add_rms_norm_(r, d, w, 1e-5),
                calls,
                args.rounds,
            )
            rotary = _per_call_us(
                lambda x=qkv, c=cos, s=sin: module.rotary_(x, c, s, ROTATED_HEADS, HEAD_DIM),
                calls,
                args.rounds,
            )
            out.write(f"{name:9s} rows {rows:5d}: add_rms_norm_ {norm:8.1f} us, ")
            out.write(f"rotary_ {rotary:8.1f} us\n")
            results[f"{name} rows={rows}"] = {"add_rms_norm_us": norm, "rotary_us": rotary}
    return results


if __name__ == "__main__":
    main()
