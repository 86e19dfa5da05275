"""Does this CPU compute while its memory reads are in flight? Measured at the decode attention's
access pattern.

The walk covers twelve layer pools of K/V, as a W1 decode step does. Each pool holds 64 items of
--ctx tokens in shuffled 16-token blocks, 1 KB rows of 4 KV heads x 64 floats. The walk runs
five ways for each thread count:

- read: every row summed, loads and adds only, each row front to back;
- read by head: the same sums in tiles of 8 rows, one KV head at a time across the tile's rows
  (the order the decode kernel read in before the fifteenth session);
- compute: the same loads and FMAs (three per vector, as the three query heads of a KV head
  use it) over four rows that stay in L1;
- both: those FMAs over the scattered rows;
- prefetched: as both, each row prefetched --ahead tokens early.

overlap = (read + compute - both) / min(read, compute). It is 1 when the arithmetic hides under
the reads, and 0 when the two take turns. On the development VM it is at most about a third,
prefetched or not, and reading by head is 15-50% slower than row by row. That sets a floor
under the decode attention's time (docs/benchmarks.md, fifteenth session).
Run it alone on a quiet machine.

    python benchmarks/memory_overlap_bench.py [--ctx 272] [--layers 12] [--rounds 3]
        [--threads 2,1] [--ahead 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from torch.utils.cpp_extension import load_inline

ITEMS, BLOCK, ROW = 64, 16, 256  # a W1 decode step: 64 items, 16-token blocks, 4 x 64 floats

# GCC vector extensions: 8-float vectors (AVX2 registers with -march=native on x86, pairs of
# 4-float registers elsewhere), so the loops need no ISA-specific intrinsics.
_SOURCE = r"""
#include <torch/extension.h>
#include <omp.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));

// mode 0 read, 1 compute (rows 0-3 of the pool, in L1), 2 both, 3 both + prefetch `ahead` rows
// early, 4 read by head (tiles of 8 rows, one KV head of 64 floats at a time across them).
// Returns the sum of everything read, so no pass can be optimised away.
double walk(std::vector<torch::Tensor> pools, torch::Tensor tables, int64_t ctx, int64_t mode,
            int64_t threads, int64_t ahead) {
  const int64_t block = 16, row = 256;
  const int64_t n_items = tables.size(0), width = tables.size(1);
  const int64_t* tab = tables.data_ptr<int64_t>();
  double total = 0;
  for (auto& pool : pools) {
    const float* k_pool = pool.data_ptr<float>();
    const float* v_pool = k_pool + pool.numel() / 2;
    double part = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(+ : part)
    for (int64_t item = 0; item < n_items; ++item) {
      const int64_t* table = tab + item * width;
      auto at = [&](const float* base, int64_t t) {
        return base + (table[t / block] * block + t % block) * row;
      };
      const v8 zero = {};
      v8 acc[8] = {};
      const v8 q0 = zero + 0.1f, q1 = zero + 0.2f, q2 = zero + 0.3f;
      for (int pass = 0; pass < 2; ++pass) {  // all of K, then all of V, as the kernel reads
        const float* base = pass ? v_pool : k_pool;
        if (mode == 4) {
          for (int64_t t0 = 0; t0 < ctx; t0 += 8) {
            const int64_t n = std::min<int64_t>(8, ctx - t0);
            for (int64_t h = 0; h < row; h += 64)
              for (int64_t j = 0; j < n; ++j)
                for (int i = 0; i < 8; ++i)
                  acc[i] += *reinterpret_cast<const v8*>(at(base, t0 + j) + h + 8 * i);
          }
          continue;
        }
        for (int64_t t = 0; t < ctx; ++t) {
          const float* r = mode == 1 ? base + (t % 4) * row : at(base, t);
          if (mode == 3 && t + ahead < ctx) {
            const char* p = reinterpret_cast<const char*>(at(base, t + ahead));
            for (int64_t b = 0; b < row * 4; b += 64) __builtin_prefetch(p + b);
          }
          for (int64_t c = 0; c < row; c += 64) {
            for (int i = 0; i < 8; ++i) {
              const v8 x = *reinterpret_cast<const v8*>(r + c + 8 * i);
              if (mode == 0) {
                acc[i] += x;
              } else {
                acc[i] += x * q0;
                acc[i] += x * q1;
                acc[i] += x * q2;
              }
            }
          }
        }
      }
      for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 8; ++j) part += acc[i][j];
    }
    total += part;
  }
  return total;
}
"""

MODES = ("read", "compute", "both", "prefetched", "read by head")  # in walk's mode order


def _build() -> Any:
    return load_inline(
        name="ferrum_memory_overlap_bench_v2",
        cpp_sources=_SOURCE,
        functions=["walk"],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-std=c++17"],
        extra_ldflags=["-fopenmp"],
    )


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    """Prints and returns, per thread count, each mode's median milliseconds a walk and the
    overlap fraction ("overlap")."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=272, help="tokens of context per item")
    parser.add_argument("--layers", type=int, default=12, help="pools walked per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", default="2,1", help="comma-separated thread counts")
    parser.add_argument("--ahead", type=int, default=16, help="tokens prefetched ahead")
    args = parser.parse_args(argv)
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        parser.error(f"--threads must be comma-separated integers, got {args.threads!r}")
    if min(args.ctx, args.layers, args.rounds, args.ahead, *threads) < 1:
        parser.error("--ctx, --layers, --rounds, --ahead and every thread count must be >= 1")
    module = _build()
    gen = torch.Generator().manual_seed(0)
    blocks = -(-args.ctx // BLOCK)
    n_blocks = ITEMS * blocks
    pools = [torch.randn(2, n_blocks, BLOCK, ROW, generator=gen) for _ in range(args.layers)]
    tables = torch.randperm(n_blocks, generator=gen).view(ITEMS, blocks).contiguous()
    gigabytes = 2 * ITEMS * args.ctx * ROW * 4 * args.layers / 1e9
    out = sys.stdout
    out.write(
        f"{args.layers} pools, {ITEMS} items x {args.ctx} tokens in shuffled {BLOCK}-token "
        f"blocks: {gigabytes * 1e3:.0f} MB of K/V a walk\n"
    )
    results: dict[int, dict[str, float]] = {}
    for n in threads:
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for mode in range(len(MODES)):  # warm-up: page faults and thread start stay out
            module.walk(pools, tables, args.ctx, mode, n, args.ahead)
        for _ in range(args.rounds):  # interleaved, so a slow spell lands on every mode
            for mode, name in enumerate(MODES):
                started = time.perf_counter()
                module.walk(pools, tables, args.ctx, mode, n, args.ahead)
                times[name].append((time.perf_counter() - started) * 1e3)
        ms = {name: statistics.median(t) for name, t in times.items()}
        hidden = ms["read"] + ms["compute"] - ms["both"]
        ms["overlap"] = hidden / min(ms["read"], ms["compute"])
        results[n] = ms
        out.write(
            f"threads {n}: read {ms['read']:.1f} ms ({gigabytes / ms['read'] * 1e3:.1f} GB/s), "
            f"compute {ms['compute']:.1f}, both {ms['both']:.1f}, prefetched "
            f"{ms['prefetched']:.1f}, read by head {ms['read by head']:.1f} ms (medians); "
            f"overlap {ms['overlap']:.2f}\n"
        )
    return results


if __name__ == "__main__":
    main()
