"""The native decode attention kernel at W1's decode shapes, against another build of it.

64 items of about CTX tokens (16-token blocks scattered over the pool), 12 query and 4 KV heads
of 64 dims: one layer of a W1 decode step. Builds the kernel from the working tree ("new") and
from a git revision ("old", default HEAD), checks they agree, then times both in interleaved
rounds. Run it alone on a quiet machine.

    python benchmarks/decode_attention_bench.py [--ctx 256] [--dtype float32] [--old REV]
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from ferrum_kernels.native import _FLAGS
from torch.utils.cpp_extension import load_inline

SOURCE = "kernels/ferrum_kernels/csrc/decode_attention.cpp"
ROOT = Path(__file__).resolve().parents[1]
ITEMS, HEADS, KV_HEADS, DIM, BLOCK = 64, 12, 4, 64, 16  # a W1 decode step's layer
CALLS = 20  # per timed round


def _build(tag: str, source: str) -> object:
    # A stable name per source: a rerun reuses the build (str hashes change per process).
    digest = hashlib.sha1(source.encode()).hexdigest()[:10]
    return load_inline(
        name=f"ferrum_decode_bench_{tag}_{digest}",
        cpp_sources=source,
        functions=["decode_attention"],
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--old", default="HEAD", help="git revision of the kernel to compare")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    old = subprocess.run(
        ["git", "show", f"{args.old}:{SOURCE}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    mods: dict[str, Any] = {
        tag: _build(tag, text) for tag, text in (("old", old), ("new", (ROOT / SOURCE).read_text()))
    }
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    blocks = -(-args.ctx // BLOCK) + 1
    pool = ITEMS * blocks + 8
    kv = torch.randn(2, pool, BLOCK, KV_HEADS, DIM).to(dtype)
    tables = torch.randperm(pool - 8)[: ITEMS * blocks].view(ITEMS, blocks).contiguous()
    lens = torch.tensor([args.ctx - (i % 7) for i in range(ITEMS)], dtype=torch.int64)
    q = torch.randn(ITEMS, HEADS, DIM).to(dtype)
    rows = torch.arange(ITEMS, dtype=torch.int64)
    call = (q, kv[0], kv[1], tables, lens, rows, BLOCK, KV_HEADS, DIM**-0.5)
    outs = {tag: mod.decode_attention(*call).float() for tag, mod in mods.items()}
    lines = [f"max |new - old| {(outs['new'] - outs['old']).abs().max().item():.2e}"]
    times: dict[str, list[float]] = {tag: [] for tag in mods}
    for _ in range(args.rounds):  # interleaved, so a slow spell lands on both
        for tag, mod in mods.items():
            started = time.perf_counter()
            for _ in range(CALLS):
                mod.decode_attention(*call)
            times[tag].append((time.perf_counter() - started) / CALLS * 1e3)
    kv_bytes = 2 * int(lens.sum()) * KV_HEADS * DIM * kv.element_size()
    for tag, ms in times.items():
        best = min(ms)
        lines.append(
            f"{tag}: ctx {args.ctx} {args.dtype}: best {best:.3f} ms a layer (median "
            f"{sorted(ms)[len(ms) // 2]:.3f}), K/V read at {kv_bytes / best / 1e6:.1f} GB/s"
        )
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
