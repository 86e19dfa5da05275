"""Microbenchmark: CPU prefill-chunk attention, the torch path against the native kernel.

Times ``cpu_paged_attention`` on single prefill chunks of the W1 model's attention shape
(12 heads, 4 KV heads, head_dim 64, block size 16) with the native prefill kernel switched off
(the old path: gather, bmm, softmax, bmm per 64 queries) and on, in float32 and bfloat16. With
``--against registers`` (a CPU with AMX) the old column is the native kernel on its register
tiles instead of AMX's (bfloat16). With ``--old REV`` the old column is the native kernel as
``prefill_attention.cpp`` is at git revision REV, built alone into a second module, and the new
one the working tree's; the two alternate call by call in one process.

    python benchmarks/prefill_attention_bench.py [--repeats 41] [--threads 2] [--json out.json]
        [--shapes 512x512,64x400] [--against torch|registers] [--old REV]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from ferrum_kernels import cpu_attention
from ferrum_kernels import native as native_kernels
from ferrum_kernels.attention import AttentionMetadata
from ferrum_kernels.cpu_attention import CpuAttentionPlan, Workspace, cpu_paged_attention

# (query rows n, context length ctx): the chunk is the last n of ctx positions.
SHAPES = [(512, 512), (256, 256), (448, 448), (256, 512), (64, 400)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _case(
    n: int, ctx: int, heads: int, kv_heads: int, head_dim: int, block: int, dtype: torch.dtype
) -> Callable[[], torch.Tensor]:
    """A closure running one chunk's attention, on a pool with shuffled blocks."""
    gen = torch.Generator().manual_seed(n * 1000 + ctx)
    num_blocks = math.ceil(ctx / block) + 8
    kv = torch.randn(2, num_blocks, block, kv_heads, head_dim, generator=gen).to(dtype)
    ids = list(range(num_blocks))
    random.Random(ctx).shuffle(ids)
    table = torch.tensor([ids[: math.ceil(ctx / block)]], dtype=torch.int64)
    slots = torch.tensor(
        [ids[p // block] * block + p % block for p in range(ctx - n, ctx)], dtype=torch.int64
    )
    meta = AttentionMetadata.build([0, n], [ctx], table, slots)
    plan = CpuAttentionPlan.build(meta, block)
    # q as a row-strided view of a fused qkv projection, as the model passes it.
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)  # [n, H, D]
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(n, kv_heads, head_dim)
    flat = kv.view(2, num_blocks * block, kv_heads, head_dim)
    flat[0].index_copy_(0, slots, k)  # the chunk's own keys sit in the pool, as after write_kv
    flat[1].index_copy_(0, slots, v)
    workspace = Workspace()
    scale = head_dim**-0.5
    return lambda: cpu_paged_attention(q, k, v, kv, plan, scale, workspace)


def _time_pair(
    old: Callable[[], torch.Tensor], new: Callable[[], torch.Tensor], repeats: int
) -> tuple[float, float]:
    """Median milliseconds per call of each, after warm-up; calls alternate so that drift in the
    machine's load (it may be shared) hits both alike."""
    for _ in range(3):
        old()
        new()
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, times in ((old, samples[0]), (new, samples[1])):
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples[0]), statistics.median(samples[1])


def _run(
    fn: Callable[[], torch.Tensor], native: bool, amx: bool = True
) -> Callable[[], torch.Tensor]:
    module = native_kernels.load()

    def call() -> torch.Tensor:
        cpu_attention.NATIVE_PREFILL = native
        if not amx:
            module.set_amx(False)
        try:
            return fn()
        finally:
            cpu_attention.NATIVE_PREFILL = True
            if not amx:
                module.set_amx(True)

    return call


def _revision_module(rev: str) -> Any:
    """The prefill kernel as it is at git revision `rev`, built alone (with that revision's
    shared header) into its own module (a rerun reuses the build); the package's own module
    where the revision's kernel and header are the working tree's."""
    source = native_kernels.kernel_at_revision(rev, "prefill_attention.cpp")
    if source is None:
        return native_kernels.load()
    return native_kernels.build_alone("prefill_bench", source, ["prefill_attention"])


def _with_module(fn: Callable[[], torch.Tensor], module: Any) -> Callable[[], torch.Tensor]:
    """`fn` with the native prefill kernel taken from `module` instead of the package's."""
    chosen = cpu_attention.native_prefill_module

    def call() -> torch.Tensor:
        def pick(*args: Any) -> Any:
            return module if chosen(*args) is not None else None

        cpu_attention.native_prefill_module = pick
        try:
            return fn()
        finally:
            cpu_attention.native_prefill_module = chosen

    return call


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--against",
        choices=("torch", "registers"),
        default="torch",
        help="the old column: the torch path, or the native kernel without AMX",
    )
    parser.add_argument(
        "--old", help="a git revision: its native prefill kernel is the old column instead"
    )
    parser.add_argument(
        "--shapes",
        default=",".join(f"{n}x{ctx}" for n, ctx in SHAPES),
        help="chunks as NxCTX (the last N of CTX positions), comma-separated",
    )
    args = parser.parse_args(argv)
    module = native_kernels.load()
    if args.against == "registers" and (module is None or not module.amx_available()):
        sys.exit("--against registers needs AMX tiles (a CPU with AMX-BF16)")
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    torch.set_num_threads(args.threads)
    old_module = _revision_module(args.old) if args.old else None
    results = []
    out = sys.stdout
    out.write(f"{'dtype':<9} {'n':>4} {'ctx':>4} {'old ms':>8} {'new ms':>8} {'speedup':>8}")
    out.write(f" {'maxdiff':>8}\n")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        for n, ctx in shapes:
            fn = _case(n, ctx, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype)
            if old_module is not None:
                old = _with_module(_run(fn, native=True), old_module)
            elif args.against == "registers":
                old = _run(fn, native=True, amx=False)
            else:
                old = _run(fn, native=False)
            new = _run(fn, native=True)
            err = (old().float() - new().float()).abs().max().item()
            old_ms, new_ms = _time_pair(old, new, args.repeats)
            # Attention FLOPs: QK^T and PV over the causally visible keys of each query row.
            visible = sum(ctx - n + i + 1 for i in range(n))
            gflops = 4 * args.heads * args.head_dim * visible / (new_ms * 1e6)
            results.append(
                {
                    "dtype": name,
                    "n": n,
                    "ctx": ctx,
                    "old_ms": round(old_ms, 4),
                    "new_ms": round(new_ms, 4),
                    "speedup": round(old_ms / new_ms, 2),
                    "new_gflops": round(gflops, 1),
                    "max_abs_diff": err,
                }
            )
            out.write(
                f"{name:<9} {n:>4} {ctx:>4} {old_ms:>8.3f} {new_ms:>8.3f} "
                f"{old_ms / new_ms:>7.2f}x {err:>8.2g}   ({gflops:.0f} GFLOP/s)\n"
            )
            out.flush()
    text = json.dumps({"threads": args.threads, "results": results}, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    out.write(text + "\n")


if __name__ == "__main__":
    main()
