"""The packed linears' GEMMs at W1's shapes: the native GEMM against oneDNN's.

Each kernel packs twelve layers' worth of W1's four linear weights (qkv, o, gate_up, down: 300
MB in float32, ten times the L3 of the development machine), so every call reads its weight
from memory as a real step does; the LM head (32000 x 768) is timed on its own. For each row
count (64: a decode step; 512: a prefill step) the two kernels run in interleaved rounds over
all twelve layers, and each line prints the median and best round in GFLOP/s. Run it alone on a
quiet machine: a second busy process halves every figure. ``--dtype bfloat16`` compares the
native bfloat16 GEMM (a CPU with AVX-512F) with oneDNN's instead of the float32 ones; on a
CPU with AMX the native GEMM runs on its tiles, and a third line (``avx512``) times the same
native packs on the register tiles.

``--old REV`` instead times the native GEMM as it is in the working tree ("new") against
``gemm.cpp`` (and ``common.h``) at git revision REV ("old"), built alone into a second module,
in the same process: the four linears (the gate/up paired, its SwiGLU fused) of each layer, and
the LM head of the first 64 rows (widened to float32 in bfloat16). Each line prints both
builds' median and best rounds, and the largest difference between their gate/up outputs.
Where the two sources are the same, the package's own build serves as both.

    python benchmarks/gemm_bench.py [--rows 64,512] [--rounds 9] [--threads 2] [--layers 12]
        [--dtype float32] [--old REV]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from ferrum_kernels import native
from ferrum_kernels.cpu_linear import PackedWeight, mkldnn_linear_available

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 768, 2048, 12, 4, 64, 32000
SHAPES = {  # name -> (N, K) of W1's linears
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
}


_GEMM_FUNCTIONS = [
    "gemm_bf16_available",
    "pack_gemm_weight",
    "packed_gemm",
    "pack_gemm_weight_halves",
    "packed_gemm_halves",
    "packed_gemm_widened",
]


def _revision_module(rev: str) -> Any:
    """The native GEMM as `rev` had it: its gemm.cpp after its common.h, built alone; the
    package's module where both files are as in the working tree."""
    source = native.kernel_at_revision(rev, "gemm.cpp")
    if source is None:
        return native.load()
    return native.build_alone("gemm_bench_old", source, _GEMM_FUNCTIONS)


def _against_revision(
    args: argparse.Namespace, dtype: torch.dtype, gen: torch.Generator
) -> dict[str, dict[str, float]]:
    builds = {"old": _revision_module(args.old), "new": native.load()}
    if dtype == torch.bfloat16 and not builds["old"].gemm_bf16_available():
        # (before the emulated bfloat16 GEMM, a CPU without AVX512_BF16 had none)
        sys.exit(f"{args.old}'s native GEMM has no bfloat16 kernel for this CPU")
    packs: dict[str, list[dict[str, torch.Tensor]]] = {tag: [] for tag in builds}
    for _ in range(args.layers):
        weights = {
            name: (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
            for name, (n, k) in SHAPES.items()
        }
        for tag, module in builds.items():
            packs[tag].append(
                {
                    name: module.pack_gemm_weight_halves(w)
                    if name == "gate_up"
                    else module.pack_gemm_weight(w)
                    for name, w in weights.items()
                }
            )
    head_weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).to(dtype)
    heads = {tag: module.pack_gemm_weight(head_weight) for tag, module in builds.items()}

    def step(tag: str, inputs: dict[int, torch.Tensor]) -> float:
        module, started = builds[tag], time.perf_counter()
        for layer in packs[tag]:
            module.packed_gemm(inputs[HIDDEN], layer["qkv"], None, SHAPES["qkv"][0])
            module.packed_gemm(inputs[HIDDEN], layer["o"], None, HIDDEN)
            module.packed_gemm_halves(
                inputs[HIDDEN], layer["gate_up"], None, 2 * INTERMEDIATE, True
            )
            module.packed_gemm(inputs[INTERMEDIATE], layer["down"], None, HIDDEN)
        rows = inputs[HIDDEN][:64].contiguous()
        if dtype == torch.bfloat16:
            module.packed_gemm_widened(rows, heads[tag], None, VOCAB)
        else:
            module.packed_gemm(rows, heads[tag], None, VOCAB)
        return time.perf_counter() - started

    per_token = 2 * sum(n * k for n, k in SHAPES.values()) * args.layers
    out = sys.stdout
    out.write(f"threads {torch.get_num_threads()}, {args.layers} layers, {args.dtype}, ")
    out.write(f"working tree against {args.old}\n")
    results: dict[str, dict[str, float]] = {}
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (HIDDEN, INTERMEDIATE)}
        fused = [
            builds[tag].packed_gemm_halves(
                inputs[HIDDEN], packs[tag][0]["gate_up"], None, 2 * INTERMEDIATE, True
            )
            for tag in builds
        ]
        diff = float((fused[0].float() - fused[1].float()).abs().max())
        times: dict[str, list[float]] = {tag: [] for tag in builds}
        for tag in builds:  # warm-up
            step(tag, inputs)
        for i in range(args.rounds):  # alternating which build goes first
            for tag in ("old", "new") if i % 2 == 0 else ("new", "old"):
                times[tag].append(step(tag, inputs))
        flops = per_token * rows + 2 * VOCAB * HIDDEN * min(rows, 64)
        line = [f"M={rows:4d}"]
        for tag in builds:
            median = flops / statistics.median(times[tag]) / 1e9
            best = flops / min(times[tag]) / 1e9
            line.append(f"{tag} {median:7.1f} GFLOP/s median ({best:7.1f} best)")
            results[f"M={rows} {tag}"] = {"gflops": median, "best_gflops": best, "diff": diff}
        out.write(", ".join(line) + f", max |new - old| {diff:.2e}\n")
    return results


@contextmanager
def _tiles_of(module: Any, kernel: str) -> Iterator[None]:
    """The native bfloat16 GEMM on the register tiles for "avx512" (else as it is)."""
    if kernel != "avx512":
        yield
        return
    module.set_amx(False)
    try:
        yield
    finally:
        module.set_amx(True)


def _round(packs: list[dict[str, PackedWeight]], inputs: dict[int, torch.Tensor]) -> float:
    started = time.perf_counter()
    for layer in packs:
        for name, (_, k) in SHAPES.items():
            layer[name](inputs[k])
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Prints the rates; returns them too, per "M=<rows> <kernel>", with the largest difference
    between the two kernels' outputs (one layer's gate_up) under "diff"."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,512")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="0 = torch's default")
    parser.add_argument("--layers", type=int, default=12, help="fewer for a smoke run")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--old", help="a git revision: its native GEMM against the working tree's")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    module = native.load()
    if dtype == torch.bfloat16:
        if module is None or not module.gemm_bf16_available():
            sys.exit("needs the native bfloat16 GEMM (a CPU with AVX-512F)")
        if not mkldnn_linear_available(dtype):
            sys.exit("needs oneDNN's bfloat16 linears")
    elif module is None or not module.gemm_isa()[0] or not mkldnn_linear_available():
        sys.exit("needs the native GEMM (an AVX2 build) and oneDNN")
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    if args.old:
        if dtype == torch.float32 and not module.gemm_isa()[1]:
            sys.exit("--old times the AVX-512 GEMM (a paired gate/up); this CPU has AVX2 only")
        return _against_revision(args, dtype, gen)
    kernels: tuple[str, ...] = ("native", "onednn")
    amx = dtype == torch.bfloat16 and bool(module.amx_available())
    if amx:
        kernels += ("avx512",)
    packs: dict[str, list[dict[str, PackedWeight]]] = {kernel: [] for kernel in kernels}
    for _ in range(args.layers):
        weights = {
            name: (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
            for name, (n, k) in SHAPES.items()
        }
        for kernel in kernels:
            if kernel == "avx512":  # the native packs, run on the register tiles
                packs[kernel] = packs["native"]
                continue
            # A copy each: releasing the plain weight frees its storage.
            layer = {n: PackedWeight(w.clone(), None, kernel=kernel) for n, w in weights.items()}
            for pack in layer.values():
                pack.release_plain()  # as served: only the packed copy
            packs[kernel].append(layer)
    head_weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).to(dtype)
    heads = {kernel: PackedWeight(head_weight, None, kernel=kernel) for kernel in kernels[:2]}
    if amx:
        heads["avx512"] = heads["native"]

    per_token = 2 * sum(n * k for n, k in SHAPES.values()) * args.layers
    out = sys.stdout
    out.write(
        f"threads {torch.get_num_threads()}, {args.layers} layers of W1's linears, {args.dtype}\n"
    )
    results: dict[str, dict[str, float]] = {}
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (HIDDEN, INTERMEDIATE)}
        # The two kernels compute the same linear, to float32 (or bfloat16) rounding.
        pair = [packs[kernel][0]["gate_up"](inputs[HIDDEN]) for kernel in kernels[:2]]
        diff = float((pair[0].float() - pair[1].float()).abs().max())
        times: dict[str, list[float]] = {kernel: [] for kernel in kernels}
        head_times: dict[str, list[float]] = {kernel: [] for kernel in kernels}
        for kernel in kernels:  # warm-up: first-call costs stay out of the rounds
            with _tiles_of(module, kernel):
                _round(packs[kernel], inputs)
        for _ in range(args.rounds):
            for kernel in kernels:
                with _tiles_of(module, kernel):
                    times[kernel].append(_round(packs[kernel], inputs))
                    started = time.perf_counter()
                    heads[kernel](inputs[HIDDEN])
                    head_times[kernel].append(time.perf_counter() - started)
        flops, head_flops = per_token * rows, 2 * VOCAB * HIDDEN * rows
        for kernel in kernels:
            layers_rate = flops / statistics.median(times[kernel]) / 1e9
            best = flops / min(times[kernel]) / 1e9
            head_rate = head_flops / statistics.median(head_times[kernel]) / 1e9
            out.write(
                f"M={rows:4d} {kernel:6s}: layers {layers_rate:6.1f} GFLOP/s median "
                f"({best:6.1f} best), LM head {head_rate:6.1f} median\n"
            )
            results[f"M={rows} {kernel}"] = {
                "layers_gflops": layers_rate,
                "best_gflops": best,
                "lm_head_gflops": head_rate,
                "diff": diff,
            }
    return results


if __name__ == "__main__":
    main()
