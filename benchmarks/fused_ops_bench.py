"""The fused elementwise kernels at W1's shapes: RMSNorm with the residual add, and rotary.

``add_rms_norm_`` runs on [rows, 768] (W1's hidden size) and ``rotary_`` on the q and k heads of
a [rows, 1280] qkv projection (12 query and 4 KV heads of 64, rotated in one call, as
``cpu_fused.rotary_cpu`` does when k follows q). For each dtype and row count (64: a decode
step; 1024: a prefill step) each kernel runs ``--calls`` times in a row, in cache, and each line
prints the median over ``--rounds`` rounds in microseconds a call. The same allocator settings
as a served engine (``host_memory``) are applied first, so an output buffer is not a fresh
mapping each call. To compare two builds, run it in a worktree of each, alternating; run it
alone on a quiet machine.

The rotary then also runs with the K/V write that follows it in a step, into random slots of a
KV pool of ``--pool-mb`` (split into twelve layers, so the slots' lines are cold, as a step
finds them): ``rotary_`` then ``store_kv_`` (two calls, "rotary+store") against the native
layers' ``rotary_store_kv_`` (one pass, "fused"), alternating call by call.

    python benchmarks/fused_ops_bench.py [--rows 64,1024] [--rounds 5] [--calls 2000]
        [--dtype float32,bfloat16] [--pool-mb 1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from ferrum_kernels import native
from ferrum_server import host_memory

HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM = 768, 12, 4, 64
ROTATED_HEADS = Q_HEADS + KV_HEADS  # q and k, rotated in one call
QKV = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
BLOCK_SIZE, LAYERS = 16, 12  # the K/V write's pool


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
    parser.add_argument("--pool-mb", type=int, default=1024, help="the K/V write's pool")
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    dtypes = args.dtype.split(",")
    if any(r < 1 for r in rows_list) or args.rounds < 1 or args.calls < 0 or args.pool_mb < 1:
        parser.error("--rows, --rounds and --pool-mb must be >= 1, --calls >= 0")
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
            split, fused = _kv_write_us(module, qkv, cos, sin, args.pool_mb, calls, args.rounds)
            out.write(f"{name:9s} rows {rows:5d}: add_rms_norm_ {norm:8.1f} us, ")
            out.write(f"rotary_ {rotary:8.1f} us, rotary+store {split:8.1f} us, ")
            out.write(f"fused {fused:8.1f} us\n")
            results[f"{name} rows={rows}"] = {
                "add_rms_norm_us": norm,
                "rotary_us": rotary,
                "rotary_store_us": split,
                "fused_us": fused,
            }
    return results


def _kv_write_us(
    module: Any,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pool_mb: int,
    calls: int,
    rounds: int,
) -> tuple[float, float]:
    """Microseconds a call of the rotary and K/V write, two calls against one, each call
    writing into the next layer's pool at fresh random slots (median over rounds)."""
    rows, dtype = qkv.shape[0], qkv.dtype
    row_bytes = KV_HEADS * HEAD_DIM * qkv.element_size()
    blocks = max(
        1, -(-rows // BLOCK_SIZE), (pool_mb << 20) // (LAYERS * 2 * BLOCK_SIZE * row_bytes)
    )
    pools = [
        torch.zeros(2, blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS)
    ]
    # Each call takes the next `rows` slots of one random order of the layer's slots, so a slot
    # comes round again only after the whole pool has been written: its lines are cold.
    order = torch.randperm(blocks * BLOCK_SIZE, generator=torch.Generator().manual_seed(1))
    turns = max(1, order.numel() // rows)

    def slots(call: int) -> torch.Tensor:
        start = (call // LAYERS % turns) * rows
        return order[start : start + rows]

    k0, v0 = Q_HEADS * HEAD_DIM, (Q_HEADS + KV_HEADS) * HEAD_DIM
    key, value = (
        qkv[:, k0:v0].view(rows, KV_HEADS, HEAD_DIM),
        qkv[:, v0:].view(rows, KV_HEADS, HEAD_DIM),
    )
    times: dict[str, list[float]] = {"split": [], "fused": []}
    for round_ in range(rounds):
        spent = {"split": 0.0, "fused": 0.0}
        # Numbered on across rounds, so a round does not rewrite the slots the last one wrote.
        for call in range(2 * calls * round_, 2 * calls * (round_ + 1), 2):
            pool, where = pools[call % LAYERS], slots(call)
            started = time.perf_counter()
            module.rotary_(qkv[:, :v0], cos, sin, ROTATED_HEADS, HEAD_DIM)
            module.store_kv_(pool, key, value, where)
            spent["split"] += time.perf_counter() - started
            pool, where = pools[(call + 1) % LAYERS], slots(call + 1)
            started = time.perf_counter()
            module.rotary_store_kv_(qkv, cos, sin, Q_HEADS, KV_HEADS, HEAD_DIM, pool, where)
            spent["fused"] += time.perf_counter() - started
        for way, seconds in spent.items():
            times[way].append(seconds / calls * 1e6)
    return statistics.median(times["split"]), statistics.median(times["fused"])


if __name__ == "__main__":
    main()
