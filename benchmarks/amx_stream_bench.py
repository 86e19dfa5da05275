"""Does one core multiply on its AMX tiles while its weight stream is in flight? Measured at a
W1 decode step's GEMM shape.

A decode step's linears multiply 64 rows by weights that come from memory once a step. The
native GEMM (``gemm.cpp``'s ``gemm_amx``) runs them on AMX tiles, panel by panel (32 columns,
two blocks of 32 rows), fetching each next panel into L2 while the current one is multiplied.
This bench times that tile loop on one thread, over --mb of packed weight (K = 768, as W1's
qkv, o and gate/up; read from memory: every round first overwrites a larger buffer), four ways:

- read: the same bytes read with 512-bit loads only, front to back;
- compute: the tile loop over --cached-panels panels that stay in L2, scaled to the same bytes;
- stream: the tile loop over the whole weight, with no software fetch;
- fetched: the same with the next panel fetched into L2 over the current one's steps, as the
  native GEMM does.

overlap = (read + compute - fetched) / min(read, compute): 1 when the tile arithmetic hides
under the reads, 0 when the two take turns. On the 2-vCPU Xeon with AMX of the fortieth session
(201 MB): read 13.6 ms, compute 10.8, stream 24.8, fetched 21.1, overlap 0.31. So a decode step's
GEMMs there take about their reads plus most of their arithmetic, and fetching further ahead,
in bursts or into L1 did not change that (docs/benchmarks.md, fortieth session). On a CPU or
kernel without AMX it says so and times nothing.
Run it alone on a quiet machine.

    python benchmarks/amx_stream_bench.py [--mb 192] [--rounds 3] [--cached-panels 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from ferrum_kernels import native
from ferrum_kernels.native import _FLAGS
from torch.utils.cpp_extension import load_inline

ROWS, K, COLS = 64, 768, 32  # a decode step's rows; W1's hidden size; columns per panel
PANEL_BYTES = K * COLS * 2  # bfloat16

_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
constexpr bool kAmx = true;
#else
constexpr bool kAmx = false;
#endif

bool amx_ready() {
  if (!kAmx) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes[16] = {};
  uint8_t rows[16] = {};
};

// Panels [P][K/2][32][2] times x [64][K] (both bfloat16 bits), gemm_amx's loop: per panel, two
// blocks of 32 rows, each over K in steps of 32: two panel tiles, two x tiles, four multiplies.
// fetch: the next panel's lines into L2, paced over the steps (half during each block).
// sums: where each block's float32 sums go ([2][4][16][16] per panel) when not null.
void tiles(const uint16_t* w, int64_t panels, const uint16_t* x, int64_t k, bool fetch,
           float* sums) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes[t] = 64;
  }
  _tile_loadconfig(&config);
  const int64_t steps = k / 32, panel = k * 32, lines = panel * 2 / 64;
  alignas(64) float scratch[4 * 256];
  for (int64_t p = 0; p < panels; ++p) {
    const uint16_t* b = w + p * panel;
    const char* next = reinterpret_cast<const char*>(b + panel);
    const bool fetching = fetch && p + 1 < panels;
    int64_t line = 0;
    for (int blk = 0; blk < 2; ++blk) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint16_t* a = x + blk * 32 * k;
      int64_t credit = 0;
      for (int64_t i = 0; i < steps; ++i) {
        if (fetching) {
          credit += lines / 2;
          for (; credit >= steps; credit -= steps) _mm_prefetch(next + 64 * line++, _MM_HINT_T1);
        }
        const uint16_t* step = b + i * 32 * 32;
        _tile_loadd(6, step, 128);
        _tile_loadd(7, step + 32, 128);
        _tile_loadd(4, a + i * 32, k * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a + 16 * k + i * 32, k * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* out = sums != nullptr ? sums + (p * 2 + blk) * 4 * 256 : scratch;
      _tile_stored(0, out, 64);
      _tile_stored(1, out + 256, 64);
      _tile_stored(2, out + 512, 64);
      _tile_stored(3, out + 768, 64);
    }
  }
  _tile_release();
}
#endif

void check(const torch::Tensor& packed, const torch::Tensor& x) {
  TORCH_CHECK(amx_ready(), "no AMX tiles on this CPU, build or kernel");
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && x.scalar_type() == torch::kBFloat16,
              "bfloat16 operands");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 32 && packed.size(3) == 2 &&
                  packed.is_contiguous(), "packed must be a contiguous [P, K/2, 32, 2]");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 64 && x.size(1) == 2 * packed.size(1) &&
                  x.size(1) % 32 == 0 && x.is_contiguous(), "x must be a contiguous [64, K]");
}

// Seconds for one pass: mode 0 read with 512-bit loads, 1 the tile loop, 2 it with the fetch.
double stream(torch::Tensor packed, torch::Tensor x, int64_t mode) {
  check(packed, x);
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* a = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto started = std::chrono::steady_clock::now();
  if (mode == 0) {
    const auto* v = reinterpret_cast<const __m512i*>(w);
    __m512i acc = _mm512_setzero_si512();
    for (int64_t i = 0, n = packed.numel() * 2 / 64; i < n; ++i)
      acc = _mm512_xor_si512(acc, _mm512_loadu_si512(v + i));
    volatile int sink = _mm512_reduce_add_epi32(acc);
    (void)sink;
  } else {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    tiles(w, packed.size(0), a, x.size(1), mode == 2, nullptr);
#endif
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
}

// The tile loop's sums, [P][64][32] float32: x @ W^T of each panel's columns.
torch::Tensor products(torch::Tensor packed, torch::Tensor x) {
  check(packed, x);
  const int64_t panels = packed.size(0);
  auto sums = torch::empty({panels, 2, 4, 16, 16}, torch::kFloat32);
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  tiles(reinterpret_cast<const uint16_t*>(packed.data_ptr()), panels,
        reinterpret_cast<const uint16_t*>(x.data_ptr()), x.size(1), true,
        sums.data_ptr<float>());
#endif
  // [P, block, tile (row half r, column half h: 2r + h), 16, 16] -> [P, 64, 32]
  return sums.view({panels, 2, 2, 2, 16, 16}).permute({0, 1, 2, 4, 3, 5}).reshape(
      {panels, 64, 32});
}
"""

MODES = ("read", "compute", "stream", "fetched")


def _build() -> Any:
    return load_inline(
        name="ferrum_amx_stream_bench",
        cpp_sources=_SOURCE,
        functions=["amx_ready", "stream", "products"],
        extra_cflags=_FLAGS,
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Prints the timings; returns each mode's median milliseconds and the overlap (empty
    where this CPU has no AMX tiles)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=192, help="packed weight streamed, MB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cached-panels", type=int, default=20, help="panels kept in L2")
    args = parser.parse_args(argv)
    if args.mb < 1 or args.rounds < 1 or args.cached_panels < 1:
        parser.error("--mb, --rounds and --cached-panels must be at least 1")
    if not native.available():
        sys.stdout.write("no C++ toolchain: nothing to time\n")
        return {}
    module = _build()
    if not module.amx_ready():
        sys.stdout.write("no AMX tiles on this CPU, build or kernel: nothing to time\n")
        return {}
    panels = max(args.cached_panels + 1, args.mb * 2**20 // PANEL_BYTES)
    packed = torch.randn(panels, K // 2, COLS, 2).bfloat16()
    cached = packed[: args.cached_panels].clone()
    x = torch.randn(ROWS, K).bfloat16()
    flush = torch.empty(max(256 * 2**20, 2 * packed.numel() * 2), dtype=torch.uint8)
    scale = panels / args.cached_panels
    repeats = 50
    ms: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        for mode, code in (("read", 0), ("stream", 1), ("fetched", 2)):
            flush.fill_(round_index)  # the weight out of every cache
            ms[mode].append(module.stream(packed, x, code) * 1e3)
        module.stream(cached, x, 1)  # into L2
        started = time.perf_counter()
        for _ in range(repeats):
            module.stream(cached, x, 1)
        ms["compute"].append((time.perf_counter() - started) / repeats * scale * 1e3)
    medians = {mode: statistics.median(values) for mode, values in ms.items()}
    read, compute, fetched = medians["read"], medians["compute"], medians["fetched"]
    overlap = (read + compute - fetched) / min(read, compute)
    gb = packed.numel() * 2 / 1e9
    sys.stdout.write(
        f"one thread, {ROWS} rows x K {K}, {gb * 1e3:.0f} MB of panels: "
        + ", ".join(f"{mode} {medians[mode]:.2f} ms" for mode in MODES)
        + f" (medians of {args.rounds}); read {gb / read * 1e3:.1f} GB/s, fetched "
        f"{gb / fetched * 1e3:.1f} GB/s; overlap {overlap:.2f}\n"
    )
    return {**medians, "overlap": overlap}


if __name__ == "__main__":
    main()
