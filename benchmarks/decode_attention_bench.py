"""The native decode attention kernel at W1's decode shapes, against another build of it.

64 items of about CTX tokens (16-token blocks scattered over the pool), 12 query and 4 KV heads
of 64 dims: one layer of a W1 decode step. Builds the kernel from the working tree ("new") and
from a git revision ("old", default HEAD), checks they agree, then times both in interleaved
rounds. Before each round it measures the machine's memory read rate (the bench tool's probe),
printed with every round's time: on a shared machine that rate drifts, and so does the kernel.
After the probe one untimed pass runs, and the builds' order alternates from round to round:
the build timed first after the probe ran up to 10% slower, whichever it was. Run it alone on a
quiet machine.

With ``--layers 12`` each round walks twelve pools, one per layer, as a real step does: about
420 MB of K/V at W1's shapes, so every layer reads its blocks from memory instead of the L3
that one repeated ~35 MB pool partly stays in (and reads faster). ``--in-order`` gives each
item consecutive blocks, as a fresh pool hands them out, instead of shuffled ones.
``--shared-prefix N`` gives every item the same first N tokens' blocks, as prefix caching does
for a shared system prompt (``w2-prefix``: 1,024 of about 1,100 tokens).

    python benchmarks/decode_attention_bench.py [--ctx 256] [--dtype float32] [--old REV]
        [--rounds 5] [--layers 1] [--in-order] [--shared-prefix 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from ferrum_kernels import native
from ferrum_server.tools.bench.harness import measure_memory_read

KERNEL = "decode_attention.cpp"  # in kernels/ferrum_kernels/csrc/
ROOT = Path(__file__).resolve().parents[1]
ITEMS, HEADS, KV_HEADS, DIM, BLOCK = 64, 12, 4, 64, 16  # a W1 decode step's layer
CALLS = 20  # per timed round


def _builds(rev: str) -> dict[str, Any]:
    """The kernel as git revision `rev` had it ("old") and as the working tree has it ("new"),
    each built alone after its own revision's shared header; the package's own build for both
    where the revision's kernel and header are the working tree's."""
    old = native.kernel_at_revision(rev, KERNEL)
    if old is None:
        module = native.load()
        return {"old": module, "new": module}
    new = native.with_common_header((ROOT / "kernels/ferrum_kernels/csrc" / KERNEL).read_text())
    return {
        tag: native.build_alone(f"decode_bench_{tag}", source, ["decode_attention"])
        for tag, source in (("old", old), ("new", new))
    }


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Prints the timings; returns every round's milliseconds per layer, per build, and the
    largest difference between the two builds' outputs under "diff"."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--old", default="HEAD", help="git revision of the kernel to compare")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=1, help="pools walked per call round")
    parser.add_argument("--in-order", action="store_true", help="consecutive blocks per item")
    parser.add_argument(
        "--shared-prefix", type=int, default=0, help="tokens whose blocks every item shares"
    )
    args = parser.parse_args(argv)
    if args.ctx < 1 or args.rounds < 1 or args.layers < 1:
        parser.error("--ctx, --rounds and --layers must be at least 1")
    if not 0 <= args.shared_prefix <= args.ctx - 7:
        parser.error("--shared-prefix must be within every item's context (ctx - 7 at most)")
    mods = _builds(args.old)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    blocks = -(-args.ctx // BLOCK) + 1
    pool = ITEMS * blocks + 8
    pools = [torch.randn(2, pool, BLOCK, KV_HEADS, DIM).to(dtype) for _ in range(args.layers)]
    order = torch.arange(pool - 8) if args.in_order else torch.randperm(pool - 8)
    tables = order[: ITEMS * blocks].view(ITEMS, blocks).contiguous()
    shared = args.shared_prefix // BLOCK  # whole blocks: a partial one is never shared
    tables[:, :shared] = tables[0, :shared]
    lens = torch.tensor([max(1, args.ctx - (i % 7)) for i in range(ITEMS)], dtype=torch.int64)
    q = torch.randn(ITEMS, HEADS, DIM).to(dtype)
    rows = torch.arange(ITEMS, dtype=torch.int64)
    calls = [(q, kv[0], kv[1], tables, lens, rows, BLOCK, KV_HEADS, DIM**-0.5) for kv in pools]
    outs = {tag: mod.decode_attention(*calls[0]).float() for tag, mod in mods.items()}
    diff = (outs["new"] - outs["old"]).abs().max().item()
    layout = ("consecutive" if args.in_order else "shuffled") + " blocks"
    if shared:
        layout += f", the first {shared} shared"
    lines = [f"{args.layers} pool(s), {layout}; max |new - old| {diff:.2e}"]
    times: dict[str, list[float]] = {tag: [] for tag in mods}
    # The machine's read rate before each round: on a shared machine it drifts (42-90 GB/s
    # within an hour on the development machine), and the kernel's time moves with it, so
    # builds compare only within rounds of a similar rate.
    memory_gbs: list[float] = []
    # Whole passes over the pools, at least CALLS layer calls a round.
    passes = -(-CALLS // args.layers)
    tags = list(mods)
    for round_index in range(args.rounds):  # interleaved, so a slow spell lands on both
        memory_gbs.append(measure_memory_read())
        # An untimed pass first: the build timed right after the probe (which streams 256 MB)
        # ran up to 10% slower than the other, whichever it was. And the order alternates.
        for call in calls:
            mods[tags[0]].decode_attention(*call)
        for tag in tags if round_index % 2 == 0 else tags[::-1]:
            mod = mods[tag]
            started = time.perf_counter()
            for _ in range(passes):
                for call in calls:
                    mod.decode_attention(*call)
            elapsed = time.perf_counter() - started
            times[tag].append(elapsed / (passes * args.layers) * 1e3)
    kv_bytes = 2 * int(lens.sum()) * KV_HEADS * DIM * pools[0].element_size()
    lines.append(f"memory read GB/s by round: {memory_gbs}")
    for tag, ms in times.items():
        by_round = " / ".join(f"{t:.3f}" for t in ms)
        best = min(ms)
        lines.append(
            f"{tag}: ctx {args.ctx} {args.dtype}: best {best:.3f} ms a layer (median "
            f"{sorted(ms)[len(ms) // 2]:.3f}), K/V read at {kv_bytes / best / 1e6:.1f} GB/s; "
            f"by round {by_round}"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    return {**times, "diff": [diff], "memory_gbs": memory_gbs}


if __name__ == "__main__":
    main()
