"""An LM head's path from hidden states to greedy tokens at W1's shapes, in bfloat16: the GEMM,
its logits in float32, and the argmax and log-normaliser sampling takes from them.

Three paths over the same packed [vocab, hidden] weight and the same rows, interleaved round by
round: "copy" (the bfloat16 GEMM, then ``.float()``, as every LM head ran until the twenty-sixth
session) and "widened" (``packed_gemm_widened``: the GEMM stores float32 itself, streamed past
the cache), each followed by ``argmax_logsumexp``; and "folded" (``packed_gemm_greedy``: the
GEMM folds each row's argmax and log-probability as it stores, writing no logits: a step whose
rows are all plain greedy, since the thirty-eighth session). Every round checks that the paths
chose the same tokens, and that "folded" gave "widened"'s log-probs bit for bit. Before every
path a buffer of
``--flush-mb`` is written, so the weight and logits start outside the caches as in a decode
step, where the layers' weights have passed through them since. Each line prints the median
over ``--rounds`` rounds of every part in milliseconds. Needs the native bfloat16 GEMM (a CPU
with AVX-512F). Run it alone on a quiet machine.

    python benchmarks/lm_head_bench.py [--rows 64] [--vocab 32000] [--hidden 768] [--rounds 25]
        [--flush-mb 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from ferrum_kernels import native
from ferrum_server import host_memory


def _timed(parts: dict[str, list[float]], name: str, fn: Any, *args: Any) -> Any:
    started = time.perf_counter()
    out = fn(*args)
    parts[name].append((time.perf_counter() - started) * 1e3)
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Prints the medians; returns them too, per path, in milliseconds (with "total")."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--flush-mb", type=int, default=64)
    args = parser.parse_args(argv)
    if min(args.rows, args.vocab, args.hidden, args.rounds) < 1 or args.flush_mb < 0:
        parser.error("--rows, --vocab, --hidden and --rounds must be >= 1, --flush-mb >= 0")
    module = native.load()
    if module is None or not module.gemm_bf16_available():
        sys.exit("needs the native bfloat16 GEMM (a CPU with AVX-512F)")
    host_memory.keep_freed_memory()
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).bfloat16()
    packed = module.pack_gemm_weight(weight)
    x = torch.randn(args.rows, args.hidden, generator=gen).bfloat16()
    flush = torch.zeros(args.flush_mb << 20, dtype=torch.uint8)
    n = args.vocab
    copy: dict[str, list[float]] = {"gemm": [], "float": [], "argmax_logsumexp": []}
    widened: dict[str, list[float]] = {"gemm": [], "argmax_logsumexp": []}
    folded: dict[str, list[float]] = {"gemm_greedy": []}
    for _ in range(args.rounds + 1):  # the first round is a warm-up, dropped below
        flush.add_(1)
        rounded = _timed(copy, "gemm", module.packed_gemm, x, packed, None, n)
        logits = _timed(copy, "float", rounded.float)
        want = _timed(copy, "argmax_logsumexp", module.argmax_logsumexp, logits)
        del rounded, logits
        flush.add_(1)
        logits = _timed(widened, "gemm", module.packed_gemm_widened, x, packed, None, n)
        got = _timed(widened, "argmax_logsumexp", module.argmax_logsumexp, logits)
        logprobs = logits.gather(1, got[0][:, None])[:, 0] - got[1]  # as sample() takes them
        del logits
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            raise AssertionError("the two paths chose different tokens or normalisers")
        flush.add_(1)
        ids, folded_logprobs, _ = _timed(
            folded, "gemm_greedy", module.packed_gemm_greedy, x, packed, None, n
        )
        if not (torch.equal(ids, got[0]) and torch.equal(folded_logprobs, logprobs)):
            raise AssertionError("the folded choice differs from the sampled logits'")
    results: dict[str, dict[str, float]] = {}
    out = sys.stdout
    out.write(f"rows {args.rows}, vocab {args.vocab}, hidden {args.hidden}, bfloat16, ms\n")
    for path, parts in (("copy", copy), ("widened", widened), ("folded", folded)):
        medians = {name: statistics.median(times[1:]) for name, times in parts.items()}
        medians["total"] = sum(medians.values())
        results[path] = medians
        line = "  ".join(f"{name} {ms:.3f}" for name, ms in medians.items())
        out.write(f"{path:8s} {line}\n")
    return results


if __name__ == "__main__":
    main()
