// float32 GEMM against a weight packed once at load time, for linears on an AVX2 CPU (see
// cpu_linear.py for when it is used instead of oneDNN's pre-packed GEMM).
//
// out[M, N] = x[M, K] @ W[N, K]^T (+ bias). The weight is packed into panels of 16 output
// columns, each K rows deep ([ceil(N/16), K, 16], zero-padded), so a panel streams front to back.
// Each call packs x into 6-row panels ([ceil(M/6), K, 6], zero-padded). A 6 x 16 register tile
// (12 accumulators, two weight vectors, one broadcast) then walks K in blocks of kKc: the weight
// block of a panel (kKc x 16 floats, 48 KB) stays in L2 while every 6-row panel of a block of
// kMcPanels panels (432 KB, also in L2) passes over it. Threads split the weight panels, so each
// thread reads only its part of the weight, once per block of rows.
//
// Measured on the AVX2 development machine (2 cores, W1's shapes, weights cold as in a real
// step; benchmarks/gemm_bench.py): 99-109 GFLOP/s at M = 64 against oneDNN's 83-95, level with
// it at M = 512 (docs/cpu-kernels.md). oneDNN's AVX2 GEMM is weakest at small M; on an AVX-512
// CPU its wider kernels are used instead (cpu_linear.gemm_kernel).
//
// Rounding: each output is summed in K order within a block and the blocks in order, the same
// for every row whatever M is, so a row's result does not depend on the rows batched with it.
//
// The AVX-512 GEMM (ferrum_gemm512, below), bfloat16 and float32 on a CPU with AVX-512F
// (bfloat16 with vdpbf16ps where it has AVX512_BF16, else emulated: kBf16Emulated): the weight
// in panels of 32 columns ([ceil(N/32), K, 32] float32, or pairs of K, [ceil(N/32), ceil(K/2),
// 32, 2], vdpbf16ps's operand layout, in bfloat16), x read in place
// (each element, or pair, of a row broadcast), an 8 x 32 register tile (16 accumulators) in
// float32, each bfloat16 output rounded once. Each output is summed in K order, whatever M is.
// Measured against oneDNN's pre-packed bfloat16 GEMM on a Zen 4 (2 cores, W1's shapes, twelve
// layers of weights cold): 410-415 against 342-346 GFLOP/s at M = 64, 353 against 229 at M =
// 16, level at M = 512-2048 (docs/cpu-kernels.md). A gate/up weight packed paired (each panel
// the same 16 columns of both halves) gets its SwiGLU applied as the tile stores.
//
// On a CPU with AMX (FERRUM_AMX, common.h) bfloat16 runs the same packs on AMX tiles instead,
// wherever K is a multiple of 32 (gemm_amx, below): 935 against oneDNN's 650 and the register
// tiles' 207 GFLOP/s at M = 64 on a 2-vCPU Xeon, 1,740 against 1,369 and 215 at M = 512
// (docs/cpu-kernels.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common.h"

namespace ferrum_gemm {

constexpr int64_t kMr = 6;   // rows of x per register tile
constexpr int64_t kNr = 16;  // weight columns per panel (two 8-lane vectors)
// K per block: 768 is K whole for most of W1's linears, so each output is written once. 256
// and 384 (the weight block in L1) measured no faster, within the development machine's noise.
constexpr int64_t kKc = 768;
constexpr int64_t kMcPanels = 24;  // 6-row panels per block of rows (144 rows)

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kAvailable = true;

// acc[6 x 16] = a-panel (kc x 6) times b-panel (kc x 16); stored into c (ldc apart) for the
// first `rows` rows and `cols` columns: added to c when `accumulate`, else written (plus bias
// when given).
inline void tile(int64_t kc, const float* __restrict a, const float* __restrict b,
                 float* __restrict c, int64_t ldc, int64_t rows, int64_t cols, bool accumulate,
                 const float* __restrict bias) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  // Unrolled so GCC keeps the twelve accumulators in registers and overlaps the loads.
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    __m256 x = _mm256_broadcast_ss(a);
    c00 = _mm256_fmadd_ps(x, b0, c00);
    c01 = _mm256_fmadd_ps(x, b1, c01);
    x = _mm256_broadcast_ss(a + 1);
    c10 = _mm256_fmadd_ps(x, b0, c10);
    c11 = _mm256_fmadd_ps(x, b1, c11);
    x = _mm256_broadcast_ss(a + 2);
    c20 = _mm256_fmadd_ps(x, b0, c20);
    c21 = _mm256_fmadd_ps(x, b1, c21);
    x = _mm256_broadcast_ss(a + 3);
    c30 = _mm256_fmadd_ps(x, b0, c30);
    c31 = _mm256_fmadd_ps(x, b1, c31);
    x = _mm256_broadcast_ss(a + 4);
    c40 = _mm256_fmadd_ps(x, b0, c40);
    c41 = _mm256_fmadd_ps(x, b1, c41);
    x = _mm256_broadcast_ss(a + 5);
    c50 = _mm256_fmadd_ps(x, b0, c50);
    c51 = _mm256_fmadd_ps(x, b1, c51);
    a += kMr;
    b += kNr;
  }
  const __m256 acc[2 * kMr] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  if (cols == kNr) {
    __m256 bias0 = _mm256_setzero_ps(), bias1 = bias0;
    if (bias != nullptr) {
      bias0 = _mm256_loadu_ps(bias);
      bias1 = _mm256_loadu_ps(bias + 8);
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* cr = c + r * ldc;
      if (accumulate) {
        _mm256_storeu_ps(cr, _mm256_add_ps(_mm256_loadu_ps(cr), acc[2 * r]));
        _mm256_storeu_ps(cr + 8, _mm256_add_ps(_mm256_loadu_ps(cr + 8), acc[2 * r + 1]));
      } else {
        _mm256_storeu_ps(cr, _mm256_add_ps(acc[2 * r], bias0));
        _mm256_storeu_ps(cr + 8, _mm256_add_ps(acc[2 * r + 1], bias1));
      }
    }
    return;
  }
  // The last panel of an N that is not a multiple of 16: only its real columns are stored.
  alignas(32) float part[kNr];
  for (int64_t r = 0; r < rows; ++r) {
    _mm256_store_ps(part, acc[2 * r]);
    _mm256_store_ps(part + 8, acc[2 * r + 1]);
    float* cr = c + r * ldc;
    for (int64_t j = 0; j < cols; ++j) {
      if (accumulate) {
        cr[j] += part[j];
      } else {
        cr[j] = part[j] + (bias != nullptr ? bias[j] : 0.f);
      }
    }
  }
}

// Six whole rows of x (k apart) into one panel, k-major: dst[i * 6 + r] = x[r * k + i]. Eight
// columns at a time: the six rows' vectors (and two of zeros) are transposed 8 x 8 in registers,
// and each column is stored as a whole vector at dst + 6i; its last two lanes spill into the
// next column's first two slots, which that column's store then overwrites. The panel's very
// last column is stored alone, so nothing past the panel is touched (another thread may be
// packing the next one). The scalar loop this replaced stored one float at a time, 6 floats
// apart: 1.7% of a W1 prefill step's samples.
inline void pack_rows6(const float* __restrict x, int64_t k, float* __restrict dst) {
  const float* s0 = x;
  const float* s1 = x + k;
  const float* s2 = x + 2 * k;
  const float* s3 = x + 3 * k;
  const float* s4 = x + 4 * k;
  const float* s5 = x + 5 * k;
  const __m256 zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256 t0 = _mm256_unpacklo_ps(_mm256_loadu_ps(s0 + i), _mm256_loadu_ps(s1 + i));
    const __m256 t1 = _mm256_unpackhi_ps(_mm256_loadu_ps(s0 + i), _mm256_loadu_ps(s1 + i));
    const __m256 t2 = _mm256_unpacklo_ps(_mm256_loadu_ps(s2 + i), _mm256_loadu_ps(s3 + i));
    const __m256 t3 = _mm256_unpackhi_ps(_mm256_loadu_ps(s2 + i), _mm256_loadu_ps(s3 + i));
    const __m256 t4 = _mm256_unpacklo_ps(_mm256_loadu_ps(s4 + i), _mm256_loadu_ps(s5 + i));
    const __m256 t5 = _mm256_unpackhi_ps(_mm256_loadu_ps(s4 + i), _mm256_loadu_ps(s5 + i));
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, zero, 0x44), u5 = _mm256_shuffle_ps(t4, zero, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, zero, 0x44), u7 = _mm256_shuffle_ps(t5, zero, 0xEE);
    // Column j of the eight: rows 0-3 from u(j % 4)'s half j / 4, rows 4-5 from u(4 + j % 4)'s.
    const __m256 col[8] = {
        _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
        _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
        _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
        _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
    float* d = dst + i * kMr;
    for (int j = 0; j < 7; ++j) _mm256_storeu_ps(d + j * kMr, col[j]);
    if (i + 8 < k) {
      _mm256_storeu_ps(d + 7 * kMr, col[7]);
    } else {  // the panel's last column: its six floats only
      alignas(32) float last[8];
      _mm256_store_ps(last, col[7]);
      std::memcpy(d + 7 * kMr, last, kMr * sizeof(float));
    }
  }
  for (; i < k; ++i) {
    float* d = dst + i * kMr;
    d[0] = s0[i];
    d[1] = s1[i];
    d[2] = s2[i];
    d[3] = s3[i];
    d[4] = s4[i];
    d[5] = s5[i];
  }
}

void gemm(const float* __restrict x, const float* __restrict packed, const float* __restrict bias,
          float* __restrict out, float* __restrict xp, int64_t m, int64_t n, int64_t k) {
  const int64_t row_panels = (m + kMr - 1) / kMr;
  const int64_t col_panels = (n + kNr - 1) / kNr;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    // x into 6-row panels, k-major inside a panel: [row_panels, K, 6], rows past M zero.
#pragma omp for schedule(static)
    for (int64_t p = 0; p < row_panels; ++p) {
      float* dst = xp + p * k * kMr;
      const int64_t rows = std::min(kMr, m - p * kMr);
      if (rows == kMr) {
        pack_rows6(x + p * kMr * k, k, dst);
        continue;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = x + (p * kMr + r) * k;
        for (int64_t i = 0; i < k; ++i) dst[i * kMr + r] = src[i];
      }
      for (int64_t r = rows; r < kMr; ++r)
        for (int64_t i = 0; i < k; ++i) dst[i * kMr + r] = 0.f;
    }  // implicit barrier: every thread reads every panel of x
    const int64_t threads = omp_get_num_threads(), self = omp_get_thread_num();
    const int64_t first = col_panels * self / threads, last = col_panels * (self + 1) / threads;
    for (int64_t k0 = 0; k0 < k; k0 += kKc) {
      const int64_t kc = std::min(kKc, k - k0);
      for (int64_t p0 = 0; p0 < row_panels; p0 += kMcPanels) {
        const int64_t p1 = std::min(row_panels, p0 + kMcPanels);
        for (int64_t j = first; j < last; ++j) {
          const float* b = packed + (j * k + k0) * kNr;
          const int64_t cols = std::min(kNr, n - j * kNr);
          const float* panel_bias = (bias != nullptr && k0 == 0) ? bias + j * kNr : nullptr;
          for (int64_t p = p0; p < p1; ++p) {
            tile(kc, xp + p * k * kMr + k0 * kMr, b, out + p * kMr * n + j * kNr, n,
                 std::min(kMr, m - p * kMr), cols, k0 > 0, panel_bias);
          }
        }
      }
    }
  }
}
#else
constexpr bool kAvailable = false;
#endif

}  // namespace ferrum_gemm

namespace ferrum_gemm512 {

constexpr int64_t kCols = 32;  // weight columns per panel: two 16-lane accumulators a row
constexpr int kRows = 8;       // rows of x per register tile: 16 accumulators
// Rows of x per block (bytes of x that stay in L2 while every panel of a thread passes over
// them): at M = 1024-2048 the whole of x per panel came from L3, a few percent slower.
constexpr int64_t kBlockBytes = 256 * 1024;

// Panels of a weight with N columns: plain (half = 0) 32 columns each, paired (half = N / 2)
// 16 columns of each half.
constexpr int64_t panel_count(int64_t n, int64_t half) {
  return half > 0 ? (half + 15) / 16 : (n + kCols - 1) / kCols;
}

// Elements of K per packed step: a float32 panel holds K rows of 32 columns, a bfloat16 one
// ceil(K/2) rows of 32 column pairs (vdpbf16ps's operand layout).
template <typename T>
constexpr int kPerStep = std::is_same<T, float>::value ? 1 : 2;

template <typename T>
constexpr int64_t panel_steps(int64_t k) {
  return (k + kPerStep<T> - 1) / kPerStep<T>;
}

#if defined(__AVX512F__)
constexpr bool kF32Available = true;
#else
constexpr bool kF32Available = false;
#endif
// bfloat16 runs wherever AVX-512F does. With AVX512_BF16 each step of K is one vdpbf16ps. Without
// it (Skylake-X, Cascade Lake, Ice Lake) the step is emulated (kBf16Emulated): a packed pair splits
// into two float32 vectors (a bfloat16 is the high half of a float32: the odd element by a mask,
// the even one by a shift), each multiplied in by an FMA, the odd element first as vdpbf16ps adds
// them (Intel's definition). The products of bfloat16 values are exact in float32, so each output
// is the same float32 sum over K of exact products, to the rounding of each add. x is widened to
// float32 a block of rows at a time, so a row's pair costs two broadcasts and no arithmetic.
// oneDNN's bfloat16 GEMM there ran at 52-64 GFLOP/s against its float32 one's 201-241 (W1's shapes,
// 64 and 1,024 rows, 2-vCPU Ice Lake).
#if defined(__AVX512BF16__)
constexpr bool kBf16Available = true;
constexpr bool kBf16Emulated = false;
#elif defined(__AVX512F__)
constexpr bool kBf16Available = true;
constexpr bool kBf16Emulated = true;
#else
constexpr bool kBf16Available = false;
constexpr bool kBf16Emulated = false;
#endif

// The type of x a register tile reads for a weight of T: T itself, but float32 for an emulated
// bfloat16 weight (x widened a block of rows at a time, see gemm()).
template <typename T>
using XOf = std::conditional_t<!std::is_same<T, float>::value && kBf16Emulated, float, T>;

// Where kGreedy folds an LM head's rows: each row's ferrum::GreedyRow per segment of
// ferrum::kGreedySegmentColumns columns (32 panels), [segments][m]. Threads take runs of whole
// segments, so each GreedyRow has one writer.
struct GreedySegments {
  ferrum::GreedyRow* rows;
  int64_t m;
  static constexpr int64_t kPanels = ferrum::kGreedySegmentColumns / kCols;

  ferrum::GreedyRow* of_panel(int64_t p) const { return rows + (p / kPanels) * m; }
  static int64_t count(int64_t panels) { return (panels + kPanels - 1) / kPanels; }
};

// A GEMM's work, group of x's rows by group: each thread owns a contiguous share of the panels
// (the static split of before), cut into runs it takes from the front, and a thread
// done with its share takes runs from the back of the others', so a thread slowed by anything
// else on its core does less instead of holding the rest at the join. Timing each thread's
// share of every call in a served 4 x 256-token prompt step, the engine thread took 13-20%
// longer through one slow spell of this shared VM (the vCPUs' speeds differ at times) and the
// other then waited 14 ms of a 96 ms step (1 ms in a quiet spell). Each share is read front to
// back, so a thread's weight stream is as before; only the meeting point moves. kGreedy's
// runs are whole fold segments, so each GreedyRow keeps one writer.
class PanelRuns {
 public:
  struct Unit {
    int64_t group, first, last;  // the group, and its panels [first, last)
  };
  PanelRuns(int64_t groups, int64_t panels, int64_t run, int64_t threads)
      : panels_(panels), run_(run), threads_(threads), ends_(groups * threads) {
    const int64_t runs = (panels + run - 1) / run;
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t t = 0; t < threads; ++t)
        ends_[g * threads + t].ends.store(pack(runs * t / threads, runs * (t + 1) / threads),
                                          std::memory_order_relaxed);
  }

  // The next unit of `group` for thread `self`: its own share's next run, else the last run
  // left in another's; false when the group has none left.
  bool claim(int64_t group, int64_t self, Unit& u) {
    for (int64_t i = 0; i < threads_; ++i) {
      const int64_t owner = (self + i) % threads_;
      std::atomic<uint64_t>& share = ends_[group * threads_ + owner].ends;
      uint64_t ends = share.load(std::memory_order_relaxed);
      for (;;) {
        const int64_t lo = static_cast<int64_t>(ends >> 32);
        const int64_t hi = static_cast<int64_t>(ends & kLow);
        if (lo >= hi) break;  // this share is done
        const int64_t run = i == 0 ? lo : hi - 1;
        const uint64_t taken = i == 0 ? pack(lo + 1, hi) : pack(lo, hi - 1);
        if (share.compare_exchange_weak(ends, taken, std::memory_order_relaxed)) {
          u.group = group;
          u.first = run * run_;
          u.last = std::min(panels_, u.first + run_);
          return true;
        }
      }
    }
    return false;
  }

  // Panels a run: about eight a thread's share, two at least, whole fold segments for kGreedy.
  static int64_t run_length(int64_t panels, int64_t threads, bool greedy) {
    if (greedy) return GreedySegments::kPanels;
    constexpr int64_t kRunsPerThread = 8;
    const int64_t runs = threads * kRunsPerThread;
    return std::max<int64_t>(2, (panels + runs - 1) / runs);
  }

 private:
  static constexpr uint64_t kLow = 0xffffffffu;
  static uint64_t pack(int64_t lo, int64_t hi) {
    return (static_cast<uint64_t>(lo) << 32) | static_cast<uint64_t>(hi);
  }
  // A share's (lo, hi) runs left, a cache line each: its owner claims from it without taking
  // the line from the other threads.
  struct alignas(64) Share {
    std::atomic<uint64_t> ends{0};
  };
  const int64_t panels_, run_, threads_;
  std::vector<Share> ends_;  // [group][thread]
};

// Runs thread_body() once on each of `threads` threads (one OpenMP team).
template <typename Body>
inline void on_threads(int64_t threads, const Body& thread_body) {
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { thread_body(); });
}

// Every (group, panel) of `runs` for one thread, in the order it claims them: panel(group, p,
// next) with next the panel the thread takes after p (its run's next, else the first of the
// run it claims while starting p's last), or -1 when it has none: the one to fetch meanwhile.
template <typename Panel>
inline void claimed_panels(PanelRuns& runs, int64_t groups, const Panel& panel) {
  const int64_t self = omp_get_thread_num();
  PanelRuns::Unit unit{}, after{};
  int64_t group = 0;
  // The next unit: this group's, else the next group's (a thread goes on to the next group
  // while another finishes this one).
  auto next_unit = [&](PanelRuns::Unit& u) {
    for (; group < groups; ++group)
      if (runs.claim(group, self, u)) return true;
    return false;
  };
  for (bool have = next_unit(unit); have;) {
    bool more = false;
    for (int64_t p = unit.first; p < unit.last; ++p) {
      int64_t next = p + 1;
      if (next == unit.last) {
        more = next_unit(after);
        next = more ? after.first : -1;
      }
      panel(unit.group, p, next);
    }
    unit = after;
    have = more;
  }
}

#if defined(__AVX512F__)
// What a tile stores: its outputs in T (bfloat16: each rounded once; kPlain); silu(first half)
// * second half of those, exactly as silu_and_mul computes it (kSwiglu); or, bfloat16 only, the
// rounded outputs widened back to float32 (kWidened: what `.float()` of kPlain's output holds,
// written in the same pass; an LM head's logits, which sampling reads as float32). kGreedy
// (a plain pack) writes no output: each row's outputs as kWidened (bfloat16) or kPlain
// (float32) would hold them are folded into the row's greedy choice (GreedySegments).
enum Store : int { kPlain = 0, kSwiglu = 1, kWidened = 2, kGreedy = 3 };

// One row of a tile: its two 16-column halves' sums v0 and v1 (bias added), stored as S says
// into c0 and c1 (`offset` elements of the stored type in), the columns in lanes0 and lanes1
// (plain stores where `whole`). Shared by the register tiles and the AMX tiles. kGreedy: c0 is
// the tile's first row's ferrum::GreedyRow (`offset` rows on is this row's), col0 v0's first
// column.
template <typename T, Store S>
inline void store_row(__m512 v0, __m512 v1, void* __restrict c0, void* __restrict c1,
                      int64_t offset, __mmask16 lanes0, __mmask16 lanes1, bool whole,
                      int64_t col0) {
  if constexpr (S == kGreedy) {
    ferrum::fold_greedy(static_cast<ferrum::GreedyRow*>(c0)[offset],
                        ferrum::round16(v0, static_cast<T*>(nullptr)),
                        ferrum::round16(v1, static_cast<T*>(nullptr)), lanes0, lanes1, col0);
    return;
  }
  if constexpr (S == kPlain) {  // store16 rounds to T (bfloat16) itself, once
    T* p0 = static_cast<T*>(c0) + offset;
    T* p1 = static_cast<T*>(c1) + offset;
    if (whole) {
      ferrum::store16(p0, v0);
      ferrum::store16(p1, v1);
    } else {
      ferrum::store16(p0, v0, lanes0);
      ferrum::store16(p1, v1, lanes1);
    }
    return;
  }
  // The outputs as T holds them (bfloat16: rounded once), in float32.
  const __m512 o0 = ferrum::round16(v0, static_cast<T*>(nullptr));
  const __m512 o1 = ferrum::round16(v1, static_cast<T*>(nullptr));
  if constexpr (S == kSwiglu) {
    T* p0 = static_cast<T*>(c0) + offset;
    const __m512 o = ferrum::silu_mul16<T>(o0, o1);
    if (whole) {
      ferrum::store16(p0, o);
    } else {
      ferrum::store16(p0, o, lanes0);
    }
  } else {  // kWidened
    float* p0 = static_cast<float*>(c0) + offset;
    float* p1 = static_cast<float*>(c1) + offset;
    // Whole cache lines bypass the cache: a vocabulary's float32 rows are megabytes (8 MB at
    // 64 rows of W1), and plain stores would first read in every line they overwrite.
    const uintptr_t aligned = reinterpret_cast<uintptr_t>(p0) | reinterpret_cast<uintptr_t>(p1);
    if (whole && (aligned & 63) == 0) {
      _mm512_stream_ps(p0, o0);
      _mm512_stream_ps(p1, o1);
    } else if (whole) {
      _mm512_storeu_ps(p0, o0);
      _mm512_storeu_ps(p1, o1);
    } else {
      _mm512_mask_storeu_ps(p0, lanes0, o0);
      _mm512_mask_storeu_ps(p1, lanes1, o1);
    }
  }
}

// One register tile: `R` rows of x (lda apart, k long) times a panel (32 columns; bfloat16 in
// pairs of K), its two 16-column halves (plus their bias, in float32, when given) stored as `S`
// says into c0 and c1 (ldc elements of the stored type apart) for the columns in lanes0 and
// lanes1; kSwiglu stores only into c0. Meanwhile it fetches `fetch_lines` cache lines from
// `fetch` into L2, paced over its K loop: part of the next panel, which then comes from L2
// instead of memory when its first tile starts. Without that fetch a bfloat16 panel's first
// tile waited on memory: 389-404 against 410-415 GFLOP/s at M = 64, 275 against 353 at M = 16.
constexpr int64_t kTileUnroll = 4;  // steps of K per group of a register tile's loop

template <typename T, int R, Store S>
void tile(const XOf<T>* __restrict a, int64_t lda, int64_t k, const T* __restrict b,
          void* __restrict c0, void* __restrict c1, int64_t ldc, __mmask16 lanes0,
          __mmask16 lanes1, const float* __restrict bias0, const float* __restrict bias1,
          const char* fetch, int64_t fetch_lines, int64_t col0) {
  constexpr bool kFloat = std::is_same<T, float>::value;
  static_assert(!(kFloat && S == kWidened), "float32 outputs are already float32");
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  // One step of K (a bfloat16 pair): both halves' products added into every row's sums.
  const auto step = [&](int64_t i) {
    if constexpr (kFloat) {
      const __m512 b0 = _mm512_loadu_ps(b + i * kCols);
      const __m512 b1 = _mm512_loadu_ps(b + i * kCols + 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_set1_ps(a[r * lda + i]);
        acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
      }
    } else {
#if defined(__AVX512BF16__)
      const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + i * 2 * kCols));
      const __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + i * 2 * kCols + 32));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, a + r * lda + 2 * i, sizeof pair);
        const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
      }
#else
      // Emulated (kBf16Emulated): each half's pairs as their odd and even elements in float32,
      // split once for all R rows; x is float32 already, so each row takes two broadcasts.
      const __m512i p0 = _mm512_loadu_si512(b + i * 2 * kCols);
      const __m512i p1 = _mm512_loadu_si512(b + i * 2 * kCols + 32);
      const __m512 odd0 = ferrum::bf16_odds(p0), odd1 = ferrum::bf16_odds(p1);
      const __m512 even0 = ferrum::bf16_evens(p0), even1 = ferrum::bf16_evens(p1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 xo = _mm512_set1_ps(a[r * lda + 2 * i + 1]);
        const __m512 xe = _mm512_set1_ps(a[r * lda + 2 * i]);
        acc[r][0] = _mm512_fmadd_ps(xe, even0, _mm512_fmadd_ps(xo, odd0, acc[r][0]));
        acc[r][1] = _mm512_fmadd_ps(xe, even1, _mm512_fmadd_ps(xo, odd1, acc[r][1]));
      }
#endif
    }
  };
  const int64_t steps = k / kPerStep<T>;  // whole steps (a bfloat16 odd K's last element apart)
  // The steps in groups of kTileUnroll, the fetch paced per group: with the pacing's add,
  // compare and branch at every step, the loop's bookkeeping took issue slots from the FMAs
  // (a one-core harness, float32, 8 rows, K = 768, the panels in L2: 175-186 -> 195-214
  // GFLOP/s).
  const int64_t groups = steps / kTileUnroll;
  int64_t credit = 0, line = 0;
  for (int64_t g = 0; g < groups; ++g) {
    credit += fetch_lines;
    while (credit >= groups) {  // fetch_lines spread evenly over the groups
      credit -= groups;
      _mm_prefetch(fetch + 64 * line++, _MM_HINT_T1);
    }
#pragma GCC unroll 4
    for (int u = 0; u < kTileUnroll; ++u) step(g * kTileUnroll + u);
  }
  for (int64_t i = groups * kTileUnroll; i < steps; ++i) step(i);
  // A K too short for one group fetches nothing here; the next panel's tiles then read it
  // from memory, as the last panel of a run does.
#if defined(__AVX512BF16__)
  if constexpr (!kFloat) {
    if (k & 1) {  // an odd K's last element alone: its pair's other half is zero in the panel
      const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + steps * 2 * kCols));
      const __m512bh b1 =
          reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + steps * 2 * kCols + 32));
      for (int r = 0; r < R; ++r) {
        const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(a[r * lda + k - 1]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
      }
    }
  }
#else
  if constexpr (!kFloat) {
    if (k & 1) {  // emulated: the even element alone (the odd one's product is zero)
      const __m512 even0 = ferrum::bf16_evens(_mm512_loadu_si512(b + steps * 2 * kCols));
      const __m512 even1 = ferrum::bf16_evens(_mm512_loadu_si512(b + steps * 2 * kCols + 32));
      for (int r = 0; r < R; ++r) {
        const __m512 xe = _mm512_set1_ps(a[r * lda + k - 1]);
        acc[r][0] = _mm512_fmadd_ps(xe, even0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xe, even1, acc[r][1]);
      }
    }
  }
#endif
  __m512 add0 = _mm512_setzero_ps(), add1 = add0;
  if (bias0 != nullptr) add0 = _mm512_maskz_loadu_ps(lanes0, bias0);
  if (bias1 != nullptr) add1 = _mm512_maskz_loadu_ps(lanes1, bias1);
  // Whole halves get plain stores (masked ones cost more on Zen 4).
  const bool whole = lanes0 == 0xffff && (S == kSwiglu || lanes1 == 0xffff);
  for (int r = 0; r < R; ++r) {
    store_row<T, S>(_mm512_add_ps(acc[r][0], add0), _mm512_add_ps(acc[r][1], add1), c0, c1,
                    r * ldc, lanes0, lanes1, whole, col0);
  }
}

// Panel p's two 16-column halves: their first output columns, and the lanes of each that are
// real columns (none of the second half past a plain weight's N). half = 0: the plain layout;
// half = N / 2: the paired one.
struct PanelColumns {
  int64_t col0, col1;
  __mmask16 lanes0, lanes1;
};
inline PanelColumns panel_columns(int64_t p, int64_t n, int64_t half) {
  if (half > 0) {
    const int64_t col0 = p * 16;
    const __mmask16 lanes = ferrum::first_lanes(std::min<int64_t>(16, half - col0));
    return {col0, half + col0, lanes, lanes};
  }
  const int64_t col0 = p * kCols, col1 = col0 + 16;
  return {col0, col1, ferrum::first_lanes(std::min<int64_t>(16, n - col0)),
          n > col1 ? ferrum::first_lanes(n - col1) : __mmask16(0)};
}

template <typename T>
using Tile = void (*)(const XOf<T>*, int64_t, int64_t, const T*, void*, void*, int64_t,
                      __mmask16, __mmask16, const float*, const float*, const char*, int64_t,
                      int64_t);
// By row count (a tile of M's last rows has only those rows' accumulators), for each Store.
template <typename T, Store S>
constexpr Tile<T> kTilesOf[kRows + 1] = {
    nullptr,          tile<T, 1, S>, tile<T, 2, S>, tile<T, 3, S>, tile<T, 4, S>,
    tile<T, 5, S>,    tile<T, 6, S>, tile<T, 7, S>, tile<T, 8, S>};

template <typename T>
const Tile<T>* tiles_for(Store store) {
  if (store == kSwiglu) return kTilesOf<T, kSwiglu>;
  if (store == kGreedy) return kTilesOf<T, kGreedy>;
  if constexpr (!std::is_same<T, float>::value) {
    if (store == kWidened) return kTilesOf<T, kWidened>;
  }
  return kTilesOf<T, kPlain>;
}

// out[M, N] = x[M, K] @ W^T (+ bias). Threads take contiguous runs of panels; each goes over x a
// block of rows at a time, and within a block panel by panel, every tile of the block on the
// panel, which stays in L2 meanwhile. half = 0: the plain layout (panel p holds columns 32p ..
// 32p + 31). half = N / 2: the paired layout (panel p holds columns 16p .. 16p + 15 of each
// half, pack_gemm_weight_halves). out: [M, N] in T (kPlain), [M, half] in T = silu(first half)
// * second (kSwiglu, paired only), or [M, N] float32 (kWidened, bfloat16 only).
//
// An emulated bfloat16 weight's tiles read x in float32 (XOf): each thread widens a block of rows
// into a buffer of its own when it first takes a panel of that block, and its tiles read the
// block there (in L2, as x itself would be). The block is sized in float32, so it takes the
// same kBlockBytes of L2 as any other; a thread's buffer holds one block (kBlockBytes, or one
// tile's kRows rows where K is wider than that).
template <typename T>
void gemm(const T* __restrict x, const T* __restrict packed, const float* __restrict bias,
          void* __restrict out, int64_t m, int64_t n, int64_t k, int64_t half, Store store,
          const GreedySegments* greedy = nullptr) {
  using X = XOf<T>;
  constexpr bool kWiden = !std::is_same<X, T>::value;
  const bool swiglu = store == kSwiglu;
  const int64_t out_bytes = store == kWidened ? sizeof(float) : sizeof(T);
  const int64_t panels = panel_count(n, half);
  const int64_t panel_elems = panel_steps<T>(k) * kPerStep<T> * kCols;
  const int64_t panel_lines = panel_elems * static_cast<int64_t>(sizeof(T)) / 64;
  const int64_t tiles = (m + kRows - 1) / kRows;
  const int64_t block_tiles =
      std::max<int64_t>(1, kBlockBytes / (static_cast<int64_t>(sizeof(X)) * k) / kRows);
  const int64_t ldc = swiglu ? half : n;
  const Tile<T>* by_rows = tiles_for<T>(store);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), panels));
  const int64_t groups = (tiles + block_tiles - 1) / block_tiles;
  PanelRuns runs(groups, panels, PanelRuns::run_length(panels, threads, greedy != nullptr),
                 threads);
  on_threads(threads, [&] {
    // kWiden: this thread's float32 copy of one block's rows, and which block it holds.
    thread_local std::vector<float> widened;
    int64_t widened_group = -1;
    claimed_panels(runs, groups, [&](int64_t group, int64_t p, int64_t next_panel) {
      const int64_t t0 = group * block_tiles, t1 = std::min(tiles, t0 + block_tiles);
      const X* rows_of_block;  // the block's first row, as the tiles read it
      if constexpr (kWiden) {
        const int64_t first = t0 * kRows, count = std::min(m, t1 * kRows) - first;
        if (group != widened_group) {
          if (widened.size() < static_cast<size_t>(count * k)) widened.resize(count * k);
          ferrum::widen_bf16(x + first * k, widened.data(), count * k);
          widened_group = group;
        }
        rows_of_block = widened.data() - first * k;  // indexed by the row's place in x
      } else {
        rows_of_block = x;
      }
      const T* b = packed + p * panel_elems;
      const auto [col0, col1, lanes0, lanes1] = panel_columns(p, n, half);
      const float* bias0 = bias != nullptr ? bias + col0 : nullptr;
      const float* bias1 = bias != nullptr && lanes1 != 0 ? bias + col1 : nullptr;
      // The thread's next panel, fetched over this block's tiles (none after its last).
      const int64_t per_tile = next_panel >= 0 ? (panel_lines + (t1 - t0) - 1) / (t1 - t0) : 0;
      const char* next =
          reinterpret_cast<const char*>(packed + std::max<int64_t>(next_panel, 0) * panel_elems);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r0 = t * kRows, rows = std::min<int64_t>(kRows, m - r0);
        const int64_t done = std::min((t - t0) * per_tile, panel_lines);
        const int64_t fetch_lines = std::min(per_tile, panel_lines - done);
        if (greedy != nullptr) {  // kGreedy: the rows' GreedyRows, one apart
          by_rows[rows](rows_of_block + r0 * k, k, k, b, greedy->of_panel(p) + r0, nullptr, 1,
                        lanes0, lanes1, bias0, bias1, next + 64 * done, fetch_lines, col0);
          continue;
        }
        char* c = static_cast<char*>(out) + r0 * ldc * out_bytes;
        by_rows[rows](rows_of_block + r0 * k, k, k, b, c + col0 * out_bytes,
                      swiglu ? nullptr : c + col1 * out_bytes, ldc, lanes0, lanes1, bias0,
                      bias1, next + 64 * done, fetch_lines, col0);
      }
    });
    if (store == kWidened) _mm_sfence();  // this thread's streamed stores, before the join
  });
}

// The bfloat16 GEMM on AMX tiles, where the CPU has them (Sapphire Rapids and later Xeons): the
// same packed panels (a panel's step of 32 column pairs is two tile rows of 16 pairs, 64 bytes
// each, 128 bytes apart), x loaded as tiles in place, each tile multiply-add (TDPBF16PS) summing
// 16 rows x 16 columns over 32 elements of K in float32. Two 16-row blocks of x times a panel's
// two halves keep all eight tiles busy: four of sums, two of x, two of the panel. The sums then
// go through the register tiles' stores (bias, one rounding, SwiGLU or widening). Each output is
// a float32 sum over K of exact bfloat16 products, as the register tiles', but in the tiles'
// order, so the two kernels' outputs differ in the last bits; each row's outputs still do not
// depend on the rows beside it. Only for K a multiple of 32 (a tile row); others, and a CPU or
// kernel without AMX, keep the register tiles.
#if defined(FERRUM_AMX)
constexpr int64_t kAmxK = 32;     // K per tile multiply: one 64-byte row of an x tile
constexpr int64_t kAmxRows = 16;  // rows of x per tile
constexpr int64_t kAmxBlockRows = 2 * kAmxRows;
constexpr int64_t kAmxTileFloats = kAmxRows * 16;  // one tile of float32 sums, 16 x 16
// Bytes of x per group of blocks that every panel of a thread passes over. The AMX tiles read
// a weight faster than the register tiles, so the same weight read once per 256 KB of x (as
// kBlockBytes) left more of a prefill step waiting on it: on a 2-vCPU Xeon with AMX (2 MB of L2
// a core), twelve layers of W1's linears ran 1,435-1,525 GFLOP/s at 512 rows with 256 KB
// groups, 1,602-1,688 with 1 MB, 1,486-1,621 with 2 MB (1,586-1,659, 1,653-1,722 and 1,486-1,550
// at 1,024 rows).
constexpr int64_t kAmxGroupBytes = 1024 * 1024;

// The tiles' shapes: 0-3 the float32 sums (row block r, half h in tile 2r + h; 16 rows x 16
// columns), 4-5 x (16 rows x 32 bfloat16), 6-7 the panel's two halves (16 steps of K x 16
// column pairs). All are 16 rows of 64 bytes.
inline void load_tile_config() {
  constexpr uint8_t kRowsOf[8] = {16, 16, 16, 16, 16, 16, 16, 16};
  constexpr uint16_t kBytesOf[8] = {64, 64, 64, 64, 64, 64, 64, 64};
  ferrum::load_tile_shapes(kRowsOf, kBytesOf);
}

// One block's stores (its rows' sums, bias added, stored as S says), left pending while the
// next block's tiles multiply: amx_tile stores a few rows a step, so the AVX-512 work of the
// stores (a SwiGLU's exp and division most of all) runs beside the tile unit instead of between
// two blocks' multiplies. Twelve layers of W1's linears and the LM head, in one process against
// the stores after each block: 1,477-1,564 -> 1,723-1,807 GFLOP/s at 512 rows, 1,560-1,667 ->
// 1,841-1,896 at 1,024, 781-792 -> 801-837 at 64 (where the weight's memory reads dominate).
template <Store S>
struct PendingRows {
  const float* sums = nullptr;  // [2][2][16][16]: row block, half, row, column
  char* c0 = nullptr;           // the block's first row, first column of each half
  char* c1 = nullptr;
  int64_t ldc = 0, rows = 0, done = 0;
  __mmask16 lanes0 = 0, lanes1 = 0;
  __m512 add0, add1;
  bool whole = false;
  int64_t col0 = 0;  // (kGreedy's column numbers)

  inline void store_until(int64_t until) {
    for (; done < until; ++done) {
      const float* s = sums + (done / kAmxRows) * 2 * kAmxTileFloats + (done % kAmxRows) * 16;
      store_row<uint16_t, S>(_mm512_add_ps(_mm512_load_ps(s), add0),
                             _mm512_add_ps(_mm512_load_ps(s + kAmxTileFloats), add1), c0, c1,
                             done * ldc, lanes0, lanes1, whole, col0);
    }
  }
  inline void finish() { store_until(rows); }
};

// RB blocks of 16 rows of x (lda apart, k a multiple of 32) times one bfloat16 panel, summed
// into sums ([RB][2][16][16] float32: row block, half, row, column). Meanwhile it fetches
// `fetch_lines` lines from `fetch` into L2, paced over K, as the register tiles do, and
// finishes the previous block's stores (`pending`, from another sums buffer), paced likewise.
template <int RB, Store S>
inline void amx_tile(const uint16_t* __restrict a, int64_t lda, int64_t k,
                     const uint16_t* __restrict b, float* __restrict sums, const char* fetch,
                     int64_t fetch_lines, PendingRows<S>& pending) {
  constexpr int64_t kStepBytes = 2 * kCols * sizeof(uint16_t);  // one packed step: 32 pairs
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (RB == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t steps = k / kAmxK, x_stride = lda * sizeof(uint16_t);
  int64_t credit = 0, line = 0, rows_credit = 0;
  for (int64_t i = 0; i < steps; ++i) {
    credit += fetch_lines;
    while (credit >= steps) {
      credit -= steps;
      _mm_prefetch(fetch + 64 * line++, _MM_HINT_T1);
    }
    const uint16_t* panel = b + i * kAmxK * kCols;  // 16 steps of 32 pairs
    _tile_loadd(6, panel, kStepBytes);
    _tile_loadd(7, panel + kCols, kStepBytes);
    _tile_loadd(4, a + i * kAmxK, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (RB == 2) {
      _tile_loadd(5, a + kAmxRows * lda + i * kAmxK, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    rows_credit += pending.rows;  // the pending rows spread evenly over the steps
    pending.store_until(rows_credit / steps);
  }
  pending.finish();
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + kAmxTileFloats, 64);
  if constexpr (RB == 2) {
    _tile_stored(2, sums + 2 * kAmxTileFloats, 64);
    _tile_stored(3, sums + 3 * kAmxTileFloats, 64);
  }
}

// out = x @ W^T on the tiles, as gemm() computes it (the same split of panels over threads; x
// in groups of kAmxGroupBytes that stay in L2), k a multiple of 32. x's rows past its last
// whole 32-row block come from `tail` ([32, k], zero past M) instead: a tile always loads 16
// rows.
template <Store S>
void gemm_amx(const uint16_t* __restrict x, const uint16_t* __restrict packed,
              const float* __restrict bias, void* __restrict out, int64_t m, int64_t n,
              int64_t k, int64_t half, const uint16_t* __restrict tail,
              const GreedySegments* greedy = nullptr) {
  using T = uint16_t;
  constexpr bool kSwiglu_ = S == kSwiglu;
  constexpr int64_t out_bytes = S == kWidened ? sizeof(float) : sizeof(T);
  const int64_t panels = panel_count(n, half);
  const int64_t panel_elems = panel_steps<T>(k) * kPerStep<T> * kCols;
  const int64_t panel_lines = panel_elems * static_cast<int64_t>(sizeof(T)) / 64;
  const int64_t blocks = (m + kAmxBlockRows - 1) / kAmxBlockRows;
  const int64_t whole_blocks = m / kAmxBlockRows;
  const int64_t group = std::max<int64_t>(
      1, kAmxGroupBytes / (static_cast<int64_t>(sizeof(T)) * k) / kAmxBlockRows);
  const int64_t ldc = kSwiglu_ ? half : n;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), panels));
  const int64_t groups = (blocks + group - 1) / group;
  PanelRuns runs(groups, panels, PanelRuns::run_length(panels, threads, S == kGreedy), threads);
  on_threads(threads, [&] {
    load_tile_config();  // per thread: the tile registers and their shapes are thread state
    // A block's sums and the previous block's (one array: GCC 12 fails on a 2-D one here).
    alignas(64) float sums[8 * kAmxTileFloats];
    int64_t flip = 0;
    PendingRows<S> pending;
    claimed_panels(runs, groups, [&](int64_t group_index, int64_t p, int64_t next_panel) {
      const int64_t g0 = group_index * group, g1 = std::min(blocks, g0 + group);
      const T* b = packed + p * panel_elems;
      const auto [col0, col1, lanes0, lanes1] = panel_columns(p, n, half);
      __m512 add0 = _mm512_setzero_ps(), add1 = add0;
      if (bias != nullptr) add0 = _mm512_maskz_loadu_ps(lanes0, bias + col0);
      if (bias != nullptr && lanes1 != 0) add1 = _mm512_maskz_loadu_ps(lanes1, bias + col1);
      const bool whole = lanes0 == 0xffff && (kSwiglu_ || lanes1 == 0xffff);
      // The thread's next panel, fetched over this group's blocks (none after its last).
      const int64_t per_block =
          next_panel >= 0 ? (panel_lines + (g1 - g0) - 1) / (g1 - g0) : 0;
      const char* next =
          reinterpret_cast<const char*>(packed + std::max<int64_t>(next_panel, 0) * panel_elems);
      for (int64_t blk = g0; blk < g1; ++blk) {
        const int64_t r0 = blk * kAmxBlockRows;
        const int64_t rows = std::min<int64_t>(kAmxBlockRows, m - r0);
        const T* a = blk < whole_blocks ? x + r0 * k : tail;
        const int64_t done = std::min((blk - g0) * per_block, panel_lines);
        const int64_t fetch_lines = std::min(per_block, panel_lines - done);
        float* block_sums = sums + flip * 4 * kAmxTileFloats;
        const char* fetch = next + 64 * done;
        if (rows > kAmxRows) {
          amx_tile<2, S>(a, k, k, b, block_sums, fetch, fetch_lines, pending);
        } else {
          amx_tile<1, S>(a, k, k, b, block_sums, fetch, fetch_lines, pending);
        }
        // This block's stores wait for the next block's multiplies (or the end).
        if constexpr (S == kGreedy) {  // the rows' GreedyRows, one apart
          pending = {block_sums, reinterpret_cast<char*>(greedy->of_panel(p) + r0), nullptr, 1,
                     rows, /*done=*/0, lanes0, lanes1, add0, add1, whole, col0};
        } else {
          char* c = static_cast<char*>(out) + r0 * ldc * out_bytes;
          char* c1 = kSwiglu_ ? nullptr : c + col1 * out_bytes;
          pending = {block_sums, c + col0 * out_bytes, c1, ldc, rows, /*done=*/0, lanes0, lanes1,
                     add0, add1, whole, col0};
        }
        flip ^= 1;
      }
    });
    pending.finish();
    _tile_release();  // the tiles' state back to its initial one: nothing left to save
    if constexpr (S == kWidened) _mm_sfence();
  });
}
#endif
#endif

}  // namespace ferrum_gemm512

// True where this build has the bfloat16 GEMM (a CPU with AVX-512F: vdpbf16ps where it has
// AVX512_BF16, emulated with FMAs elsewhere; kBf16Emulated).
bool gemm_bf16_available() { return ferrum_gemm512::kBf16Available; }

// True where that GEMM emulates vdpbf16ps (AVX-512F without AVX512_BF16): for the startup log
// and the tests that check its sums bit for bit.
bool gemm_bf16_emulated() { return ferrum_gemm512::kBf16Emulated; }

// True where bfloat16 GEMMs and prefill attention can run on AMX tiles: built for a CPU with
// AMX-BF16, and granted the tiles by the kernel (Linux 5.16 and later).
bool amx_available() {
#if defined(FERRUM_AMX)
  return ferrum::amx_permitted();
#else
  return false;
#endif
}

// Whether bfloat16 GEMMs (K a multiple of 32) and prefill attention (head_dim a multiple of 32)
// run on AMX tiles where amx_available (the default) or on the register tiles; returns the
// previous setting. For benchmarks and tests that compare the two; a server leaves it on.
bool set_amx(bool on) { return ferrum::amx_wanted.exchange(on); }

// True where this build has a float32 GEMM, and whether it is the AVX-512 one (the bfloat16
// GEMM's panels and tiles, with FMAs; it pairs a gate/up weight for a fused SwiGLU) rather than
// the AVX2 + FMA one: (available, avx512f).
std::tuple<bool, bool> gemm_isa() {
  return {ferrum_gemm::kAvailable || ferrum_gemm512::kF32Available,
          ferrum_gemm512::kF32Available};
}

namespace {

// Whether the AVX-512 GEMM runs this dtype here.
bool wide_gemm(torch::ScalarType dtype) {
  return dtype == torch::kBFloat16 ? ferrum_gemm512::kBf16Available
                                   : dtype == torch::kFloat && ferrum_gemm512::kF32Available;
}

// w [N, K] float32 or bfloat16 -> the AVX-512 GEMM's panels: float32 [panels, K, 32], bfloat16
// [panels, ceil(K/2), 32, 2] (pair i of a panel column holding its K elements 2i and 2i + 1),
// past N or K zero. Plain (half = 0): ceil(N/32) panels, panel j holding columns 32j .. 32j +
// 31. Paired (half = N/2): ceil(half/16) panels, panel j holding columns 16j .. 16j + 15 of
// each half (gate and up side by side, for the fused SwiGLU).
template <typename T>
torch::Tensor pack_panels(torch::Tensor w, int64_t half) {
  using ferrum_gemm512::kCols;
  constexpr int64_t per = ferrum_gemm512::kPerStep<T>;
  w = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1), steps = ferrum_gemm512::panel_steps<T>(k);
  const int64_t panels = ferrum_gemm512::panel_count(n, half);
  auto packed = per == 1 ? torch::zeros({panels, steps, kCols}, w.options())
                         : torch::zeros({panels, steps, kCols, per}, w.options());
  const T* src = reinterpret_cast<const T*>(w.data_ptr());
  T* dst = reinterpret_cast<T*>(packed.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t c = 0; c < kCols; ++c) {
        int64_t column = j * kCols + c;  // the weight row (output column) panel column c holds
        if (half > 0) {
          const int64_t within = j * 16 + c % 16;
          column = within < half ? (c < 16 ? within : half + within) : n;
        }
        if (column >= n) continue;
        const T* row = src + column * k;
        T* col = dst + j * steps * kCols * per + c * per;
        for (int64_t i = 0; i < k; ++i) col[(i / per) * kCols * per + i % per] = row[i];
      }
    }
  });
  return packed;
}

torch::Tensor pack_wide(const torch::Tensor& w, int64_t half) {
  return w.scalar_type() == torch::kFloat ? pack_panels<float>(w, half)
                                          : pack_panels<uint16_t>(w, half);
}

// The AVX-512 GEMM over a plain (half = 0) or paired (half = N / 2) pack: x [M, K] and packed
// in the same dtype (float32 or bfloat16), bias [N] in x's dtype or float32 (added in float32,
// before a bfloat16 output's one rounding), n = N. -> [M, N] in x's dtype; with swiglu (paired
// only) [M, half] = silu(first half) * second half; with widened (bfloat16 only) [M, N]
// float32 holding the bfloat16-rounded outputs.
torch::Tensor gemm_wide(torch::Tensor x, const torch::Tensor& packed,
                        const c10::optional<torch::Tensor>& bias, int64_t n, bool paired,
                        bool swiglu, bool widened = false,
                        const ferrum_gemm512::GreedySegments* greedy = nullptr) {
  using ferrum_gemm512::kCols;
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kBFloat16 ||
                               x.scalar_type() == torch::kFloat),
              "x must be [M, K] float32 or bfloat16");
  const bool is_float = x.scalar_type() == torch::kFloat;
  TORCH_CHECK(wide_gemm(x.scalar_type()),
              is_float ? "the AVX-512 float32 GEMM needs a CPU with AVX-512F"
                       : "the bfloat16 GEMM needs a CPU with AVX-512F");
  TORCH_CHECK(!(is_float && widened), "a widened output is for bfloat16 x");
  const int64_t per = is_float ? 1 : 2;
  TORCH_CHECK(packed.scalar_type() == x.scalar_type() && packed.is_contiguous() &&
                  packed.dim() == (is_float ? 3 : 4) && packed.size(2) == kCols &&
                  (is_float || packed.size(3) == 2),
              "packed weight must come from pack_gemm_weight (in x's dtype)");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.size(1) == (k + per - 1) / per, "packed weight is for K=",
              per * packed.size(1), is_float ? "" : " or one less", ", x has K=", k);
  const int64_t half = paired ? n / 2 : 0;
  TORCH_CHECK(!paired || (n > 0 && n % 2 == 0), "a paired weight has an even N, got ", n);
  const int64_t panels = ferrum_gemm512::panel_count(n, half);
  TORCH_CHECK(n > 0 && panels == packed.size(0), "N does not match the packed weight");
  TORCH_CHECK(k > 0 || !swiglu, "the fused SwiGLU needs K > 0");
  x = x.contiguous();
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && (bias->scalar_type() == x.scalar_type() ||
                                       bias->scalar_type() == torch::kFloat),
                "bias must be [N] in x's dtype or float32");
    b = bias->to(torch::kFloat).contiguous();
  }
  if (k == 0) {  // an empty sum: the bias alone
    auto zero = torch::zeros({m, n}, x.options().dtype(torch::kFloat));
    auto rounded = (b.defined() ? zero + b : zero).to(x.scalar_type());
    return widened ? rounded.to(torch::kFloat) : rounded;
  }
  TORCH_CHECK(greedy == nullptr || (!paired && k > 0), "a greedy head is a plain pack, K > 0");
  // kGreedy writes no output, only the GreedyRows.
  auto out = greedy != nullptr ? torch::Tensor()
                               : torch::empty({m, swiglu ? half : n},
                                              widened ? x.options().dtype(torch::kFloat)
                                                      : x.options());
  if (m == 0) return out;
  [[maybe_unused]] void* out_ptr = greedy != nullptr ? nullptr : out.data_ptr();
#if defined(__AVX512F__)
  using ferrum_gemm512::Store;
  const Store store = greedy != nullptr ? Store::kGreedy
                      : swiglu          ? Store::kSwiglu
                      : widened         ? Store::kWidened
                                        : Store::kPlain;
  const float* bias_ptr = b.defined() ? b.data_ptr<float>() : nullptr;
  if (is_float) {
    ferrum_gemm512::gemm(x.data_ptr<float>(), packed.data_ptr<float>(), bias_ptr, out_ptr, m, n,
                         k, half, store, greedy);
  }
#if defined(FERRUM_AMX)
  if (!is_float && k % ferrum_gemm512::kAmxK == 0 && ferrum::amx_wanted.load() &&
      ferrum::amx_permitted()) {
    const int64_t tail_rows = m % ferrum_gemm512::kAmxBlockRows;
    const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
    // The last rows, zero-padded to a whole block of tiles, in a buffer kept per calling thread
    // (grow-only: 64 bytes times the widest K it has served; a server's engine thread holds one
    // of 128 KB at K = 2048). A fresh zeroed tensor each call cost 9-12 us, about a tenth of a
    // decode step's small linears whenever its rows are not a multiple of 32.
    const uint16_t* ts = nullptr;
    if (tail_rows > 0) {
      thread_local std::vector<uint16_t> tail;
      const size_t block = static_cast<size_t>(ferrum_gemm512::kAmxBlockRows * k);
      if (tail.size() < block) tail.resize(block);
      std::memcpy(tail.data(), xs + (m - tail_rows) * k, sizeof(uint16_t) * tail_rows * k);
      std::memset(tail.data() + tail_rows * k, 0,
                  sizeof(uint16_t) * (ferrum_gemm512::kAmxBlockRows - tail_rows) * k);
      ts = tail.data();
    }
    if (store == Store::kSwiglu) {
      ferrum_gemm512::gemm_amx<Store::kSwiglu>(xs, ws, bias_ptr, out_ptr, m, n, k, half, ts);
    } else if (store == Store::kWidened) {
      ferrum_gemm512::gemm_amx<Store::kWidened>(xs, ws, bias_ptr, out_ptr, m, n, k, half, ts);
    } else if (store == Store::kGreedy) {
      ferrum_gemm512::gemm_amx<Store::kGreedy>(xs, ws, bias_ptr, out_ptr, m, n, k, half, ts,
                                               greedy);
    } else {
      ferrum_gemm512::gemm_amx<Store::kPlain>(xs, ws, bias_ptr, out_ptr, m, n, k, half, ts);
    }
    return out;
  }
#endif
#if defined(__AVX512F__)  // (bfloat16 with vdpbf16ps or emulated, see kBf16Emulated)
  if (!is_float) {
    ferrum_gemm512::gemm(reinterpret_cast<const uint16_t*>(x.data_ptr()),
                         reinterpret_cast<const uint16_t*>(packed.data_ptr()), bias_ptr, out_ptr,
                         m, n, k, half, store, greedy);
  }
#endif
#endif
  return out;
}

}  // namespace

// w [N, K] (N even: the gate rows, then the up rows), bfloat16 (where gemm_bf16_available) or
// float32 (where gemm_isa()[1]) -> the paired layout, for packed_gemm_halves.
torch::Tensor pack_gemm_weight_halves(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == torch::kBFloat16 ||
                               w.scalar_type() == torch::kFloat),
              "weight must be [N, K] float32 or bfloat16");
  TORCH_CHECK(wide_gemm(w.scalar_type()),
              w.scalar_type() == torch::kFloat
                  ? "a paired float32 weight needs the AVX-512 GEMM (a CPU with AVX-512F)"
                  : "the bfloat16 GEMM needs a CPU with AVX-512F");
  TORCH_CHECK(w.size(0) > 0 && w.size(0) % 2 == 0, "N must be even (two halves), got ",
              w.size(0));
  return pack_wide(w, w.size(0) / 2);
}

// w [N, K] float32 -> on an AVX-512 build the AVX-512 GEMM's plain panels ([ceil(N/32), K,
// 32]), else the AVX2 GEMM's ([ceil(N/16), K, 16]: panel j holds columns 16j .. 16j + 15 of
// W^T row by row); columns past N zero. bfloat16 (where gemm_bf16_available): the AVX-512
// GEMM's plain panels.
torch::Tensor pack_gemm_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "weight must be [N, K]");
  if (w.scalar_type() == torch::kBFloat16) {
    TORCH_CHECK(wide_gemm(torch::kBFloat16), "the bfloat16 GEMM needs a CPU with AVX-512F");
    return pack_wide(w, 0);
  }
  TORCH_CHECK(w.scalar_type() == torch::kFloat, "weight must be [N, K] float32 or bfloat16");
  if (wide_gemm(torch::kFloat)) return pack_wide(w, 0);
  w = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t panels = (n + ferrum_gemm::kNr - 1) / ferrum_gemm::kNr;
  auto packed = torch::zeros({panels, k, ferrum_gemm::kNr}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t cols = std::min(ferrum_gemm::kNr, n - j * ferrum_gemm::kNr);
      for (int64_t c = 0; c < cols; ++c) {
        const float* row = src + (j * ferrum_gemm::kNr + c) * k;
        float* out = dst + j * k * ferrum_gemm::kNr + c;
        for (int64_t i = 0; i < k; ++i) out[i * ferrum_gemm::kNr] = row[i];
      }
    }
  });
  return packed;
}

// x [M, K] times a pack_gemm_weight_halves weight [N, K] (bias [N] or None), in its dtype: with
// swiglu [M, N/2] = silu(x W_gate^T) * (x W_up^T), each product as the plain GEMM stores it
// (bfloat16: rounded) first, as silu_and_mul does; without, the plain [M, N] product.
torch::Tensor packed_gemm_halves(torch::Tensor x, torch::Tensor packed,
                                 c10::optional<torch::Tensor> bias, int64_t n, bool swiglu) {
  return gemm_wide(x, packed, bias, n, true, swiglu);
}

// x [M, K] bfloat16 times a plain bfloat16 pack_gemm_weight weight (bias [N] or None), n = N
// -> [M, N] float32: exactly packed_gemm(...).float(), in one pass. A vocabulary-wide output
// (an LM head's logits) then is not written in bfloat16 and read back to be widened: 0.2-0.8 ms
// of a W1 decode step, whose 8 MB of float32 logits missed the cache.
torch::Tensor packed_gemm_widened(torch::Tensor x, torch::Tensor packed,
                                  c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be [M, K] bfloat16");
  return gemm_wide(x, packed, bias, n, false, false, true);
}

// x [M, K] float32 or bfloat16 times a plain pack_gemm_weight weight of its dtype on the AVX-512
// GEMM (bias [N] or None), n = N -> (argmax [M] int64, its log-probability [M] float32, finite
// [M] bool) of the float32 logits that packed_gemm_widened (bfloat16) or packed_gemm (float32)
// returns, folded as the tiles store them (kGreedy): no [M, N] logits are written or read back
// (8 MB of a W1 decode step's LM head). The argmax is theirs exactly (the first column holding
// the row's maximum); the log-probability, -log(sum(exp(logit - max))), agrees with
// argmax_logsumexp's to float32 rounding (an online sum, in another order). finite is False
// where the row's logits hold a NaN or an infinity: its other two results are then meaningless,
// and the caller samples that row's logits instead.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> packed_gemm_greedy(
    torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(wide_gemm(x.scalar_type()),
              "packed_gemm_greedy needs the AVX-512 GEMM of x's dtype (float32 or bfloat16)");
  TORCH_CHECK(x.size(1) > 0, "packed_gemm_greedy needs K > 0");
  const int64_t m = x.size(0);
  const int64_t panels = ferrum_gemm512::panel_count(n, 0);
  const int64_t segments = ferrum_gemm512::GreedySegments::count(panels);
  std::vector<ferrum::GreedyRow> rows(static_cast<size_t>(segments * m));
  const ferrum_gemm512::GreedySegments greedy{rows.data(), m};
  gemm_wide(x, packed, bias, n, false, false, false, &greedy);
  auto ids = torch::empty({m}, x.options().dtype(torch::kLong));
  auto logprobs = torch::empty({m}, x.options().dtype(torch::kFloat));
  auto finite = torch::empty({m}, x.options().dtype(torch::kBool));
#if defined(__AVX512F__)  // (refused above elsewhere: the fold is AVX-512 code)
  int64_t* id = ids.data_ptr<int64_t>();
  float* logprob = logprobs.data_ptr<float>();
  bool* ok = finite.data_ptr<bool>();
  for (int64_t r = 0; r < m; ++r) {
    const ferrum::GreedyChoice c = ferrum::combine_greedy(rows.data() + r, segments, m);
    id[r] = c.column;
    // As sample() computes it from argmax_logsumexp: the chosen logit less the log-normaliser,
    // in float32 (kept from being simplified to -log(sum)).
    float lse = c.lse;
    asm("" : "+v"(lse));
    logprob[r] = c.max - lse;
    ok[r] = c.finite;
  }
#endif
  return {ids, logprobs, finite};
}

// x [M, K] float32 or bfloat16 times its dtype's pack_gemm_weight (bias [N] or None), n = N ->
// [M, N] in x's dtype: the AVX-512 GEMM where it runs that dtype, else (float32) the AVX2 one.
torch::Tensor packed_gemm(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          int64_t n) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  if (x.scalar_type() == torch::kBFloat16 || wide_gemm(x.scalar_type()))
    return gemm_wide(x, packed, bias, n, false, false);
  TORCH_CHECK(ferrum_gemm::kAvailable, "packed_gemm needs a build with AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kFloat && packed.is_contiguous(),
              "packed weight must come from pack_gemm_weight");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.size(1) == k && packed.size(2) == ferrum_gemm::kNr, "packed weight is for K=",
              packed.size(1), ", x has K=", k);
  TORCH_CHECK(n > 0 && (n + ferrum_gemm::kNr - 1) / ferrum_gemm::kNr == packed.size(0),
              "N does not match the packed weight");
  x = x.contiguous();
  const float* bias_ptr = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kFloat && b.numel() == n, "bias must be [N] float32");
    bias_ptr = b.data_ptr<float>();
  }
  if (k == 0) {  // an empty sum: the bias alone
    auto zero = torch::zeros({m, n}, x.options());
    return bias_ptr != nullptr ? zero + b : zero;
  }
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t row_panels = (m + ferrum_gemm::kMr - 1) / ferrum_gemm::kMr;
  auto xp = torch::empty({row_panels * ferrum_gemm::kMr * k}, x.options());
  ferrum_gemm::gemm(x.data_ptr<float>(), packed.data_ptr<float>(), bias_ptr, out.data_ptr<float>(),
                    xp.data_ptr<float>(), m, n, k);
#endif
  return out;
}
