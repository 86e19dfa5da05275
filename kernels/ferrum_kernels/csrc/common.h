// Shared helpers of the native CPU kernels: bfloat16 <-> float32 conversions written so the
// compiler can vectorise them (plain bit arithmetic, no calls, no branches), and their AVX-512
// forms for 16 lanes.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define FERRUM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
// A cached prompt's keys taken once for every decode item reading them (prompt_partials): in
// bfloat16 on AMX tiles where there are some, else on vdpbf16ps register tiles; in float32 on
// register tiles with FMAs. Prompt chunks take them once on AMX only (on register tiles that
// measured level with each chunk scoring them itself).
#if defined(__AVX512F__)
#define FERRUM_SHARED_PROMPT 1
#endif

namespace ferrum {

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as torch does; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(nan ? 0x7fc0u : rounded);
}

// Element access that reads and writes float32 or bfloat16 storage as float.
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static inline float load(const float* p, int64_t i) { return p[i]; }
  static inline void store(float* p, int64_t i, float v) { p[i] = v; }
  // Rounding to the storage type (the identity for float32).
  static inline float round(float v) { return v; }
};

template <>
struct Elem<uint16_t> {
  static inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
  static inline void store(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16(v); }
  static inline float round(float v) { return bf16_to_float(float_to_bf16(v)); }
};

// A logits row's greedy choice (argmax) and log-normaliser (logsumexp), folded 32 columns at a
// time in column order: the AVX-512 GEMM's kGreedy store folds an LM head's outputs as its
// tiles store them, without writing the logits, and argmax_logsumexp folds a row of written
// logits the same way, so a row gets the same bits either way. The columns are folded in
// segments of kGreedySegmentColumns (the GEMM's threads take whole segments), then the
// segments combined in order (combine_greedy).
constexpr int64_t kGreedySegmentColumns = 1024;

// One segment's fold so far: its largest value, the first column holding it (argmax's tie
// rule: columns arrive in increasing order), and the sums of exp(value - max) over its columns
// (one per lane, column % 16; added up by combine_greedy), rescaled whenever the maximum grows.
// special: a NaN or an infinity was among them (the row's results are then meaningless:
// argmax_logsumexp's callers recompute it). column < 0: none yet.
struct GreedyRow {
  alignas(64) float sums[16] = {};
  float max = 0.f;
  int64_t column = -1;
  bool special = false;
};

#if defined(__AVX512F__)
// 16 floats rounded to nearest-even bfloat16 (as torch rounds). vcvtneps2bf16 where the CPU has
// it (it also flushes denormals, below 1.2e-38, to zero), else float_to_bf16's arithmetic
// without its NaN case.
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  __m256bh b = _mm512_cvtneps_pbh(v);
  return reinterpret_cast<__m256i&>(b);
#else
  __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
#endif
}

// 16 pairs of bfloat16 values (32 bits each, as vdpbf16ps takes them) as float32 (exact): each
// pair's even (low) element, and its odd (high) one. Where there is no vdpbf16ps, a pair's two
// products are these, multiplied in by two FMAs.
inline __m512 bf16_evens(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
}
inline __m512 bf16_odds(__m512i pairs) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 16 bfloat16 values widened to float32 (exact).
inline __m512 from_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 16 float32 or bfloat16 (uint16_t bits) elements as float32, and back. The masked forms take
// the first lanes only (the rest load as zero); on Zen 4 a masked store costs more than a plain
// one, so loops use them for a tail only.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return from_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline __m512 load16(const uint16_t* p, __mmask16 lanes) {
  return from_bf16(_mm256_maskz_loadu_epi16(lanes, p));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// n bfloat16 values widened to float32 (exact), into dst.
inline void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
  if (i < n) {
    const __mmask16 lanes = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(dst + i, lanes, load16(src + i, lanes));
  }
}
inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}
inline void store16(float* p, __m512 v, __mmask16 lanes) { _mm512_mask_storeu_ps(p, lanes, v); }
inline void store16(uint16_t* p, __m512 v, __mmask16 lanes) {
  _mm256_mask_storeu_epi16(p, lanes, to_bf16(v));
}
// The first lanes (first_lanes), stored plainly when they are all 16: for loops that take
// every vector, the last one partial, through the same code.
template <typename T>
inline void store16_first(T* p, __m512 v, __mmask16 lanes) {
  if (lanes == 0xffff) store16(p, v); else store16(p, v, lanes);
}

// exp(t) for 16 lanes, -88 <= t <= 87 (callers clamp). Cody-Waite reduction t = n ln2 + r with
// |r| <= ln2/2 (ln2 in two parts, so n ln2 is exact for every n reached here), e^r by its
// Taylor series to degree 7 (truncation under 5e-9 relative), scaled by 2^n: within about an
// ulp of float32 exp. Inline, where glibc's vectorised expf (what GCC calls for std::exp in a
// vectorised loop) is a call per 16 lanes with the loop's registers spilled around it: SwiGLU
// and the logits' log-normaliser ran 1.2-1.6x slower with it.
inline __m512 exp_ps(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), t);  // ln2's high 16 bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);        // and the rest
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 2^t for t <= 0 (softmax scores less their row max, times log2(e)), zero outside `lanes`:
// t = n + f with f in [-1/2, 1/2], 2^f by a Chebyshev-fitted polynomial, scaled by 2^n. Degree
// 5 is within 2e-7 relative (float32 probabilities); degree 4, 4e-6, is plenty for
// probabilities rounded to bfloat16 (4e-3). Far below 2^-126 the scaling by 2^n flushes to
// zero, as exp does.
template <int Degree>
inline __m512 exp2_nonpositive(__m512 t, __mmask16 lanes) {
  static_assert(Degree == 4 || Degree == 5, "fitted degrees");
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p;
  if constexpr (Degree == 5) {
    p = _mm512_set1_ps(1.34004327e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.67603736e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55032715e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40221068e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147182e-1f));
  } else {
    p = _mm512_set1_ps(9.67603736e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.59220351e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40221068e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93121016e-1f));
  }
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.00000012f));
  return _mm512_maskz_scalef_ps(lanes, p, n);  // lanes outside `lanes` are zero
}

// exp(t) for one float, t clamped to at least -88 (exp_ps's range).
inline float expf_clamped(float t) {
  return _mm512_cvtss_f32(exp_ps(_mm512_set1_ps(t < -88.f ? -88.f : t)));
}

// The first n lanes (all 16 from n = 16 on).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}

// The largest of s[0, n) (n >= 1), in four accumulators: one is a chain of max's latency (4
// cycles) per vector, a quarter of a cycle a value; four run at the loads' rate.
inline float row_max(const float* s, int64_t n) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = lowest, m1 = lowest, m2 = lowest, m3 = lowest;
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + j));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + j + 16));
    m2 = _mm512_max_ps(m2, _mm512_loadu_ps(s + j + 32));
    m3 = _mm512_max_ps(m3, _mm512_loadu_ps(s + j + 48));
  }
  for (; j < n; j += 16)
    m0 = _mm512_max_ps(m0, _mm512_mask_loadu_ps(lowest, first_lanes(n - j), s + j));
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
}

// A softmax row's numerators p[0, n) = 2^(s * a + b) (exp2_nonpositive<Degree>: a and b fold
// the scale, log2(e) and the row's max into one FMA), stored in T (bfloat16 rounded once; the
// writes stop at p[n - 1]). Returns their float32 sum. Two vectors a step, each with its own
// sum (one sum is a chain of the add's latency), bfloat16's pair stored by one conversion.
template <int Degree, typename T>
inline float exp2_row(const float* s, T* p, int64_t n, __m512 a, __m512 b) {
  __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 e0 =
        exp2_nonpositive<Degree>(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), a, b), 0xffff);
    const __m512 e1 =
        exp2_nonpositive<Degree>(_mm512_fmadd_ps(_mm512_loadu_ps(s + j + 16), a, b), 0xffff);
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
    if constexpr (std::is_same<T, float>::value) {
      _mm512_storeu_ps(p + j, e0);
      _mm512_storeu_ps(p + j + 16, e1);
    } else {
#if defined(__AVX512BF16__)
      const __m512bh pair = _mm512_cvtne2ps_pbh(e1, e0);
      _mm512_storeu_si512(p + j, reinterpret_cast<const __m512i&>(pair));
#else
      store16(p + j, e0);
      store16(p + j + 16, e1);
#endif
    }
  }
  for (; j < n; j += 16) {  // the row's last 16 or fewer
    const __mmask16 lanes = first_lanes(n - j);
    const __m512 x = _mm512_maskz_loadu_ps(lanes, s + j);
    const __m512 e = exp2_nonpositive<Degree>(_mm512_fmadd_ps(x, a, b), lanes);
    sum0 = _mm512_add_ps(sum0, e);
    store16(p + j, e, lanes);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

// bfloat16 rounding where the reference rounds (the identity for float32).
inline __m512 round16(__m512 v, const float*) { return v; }
inline __m512 round16(__m512 v, const uint16_t*) { return from_bf16(to_bf16(v)); }

// SwiGLU of 16 lanes given as float32: silu(x) = x / (1 + exp(-x)), rounded to T, times u
// (rounded to T by the store); silu_and_mul's, and the bfloat16 GEMM's fused with gate/up. exp's
// argument -x is clamped to [-88, 87], which changes no result: for x < -87 silu is ~1e-36 either
// way, and for x > 88 1 + exp(-x) rounds to 1 (so silu(inf) stays inf).
template <typename T>
inline __m512 silu_mul16(__m512 x, __m512 u) {
  const __m512 minus = _mm512_sub_ps(_mm512_setzero_ps(), x);
  const __m512 e = exp_ps(
      _mm512_max_ps(_mm512_min_ps(minus, _mm512_set1_ps(87.f)), _mm512_set1_ps(-88.f)));
  const __m512 act = round16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                             static_cast<const T*>(nullptr));
  return _mm512_mul_ps(act, u);
}

// Folds 32 values of a row into g: o0 for columns col0 .. col0 + 15 (in lanes0), o1 for the
// next 16 (in lanes1). Only a chunk holding a new maximum (a few of a row's thousand, in any
// order) pays for the horizontal maximum and the first index. The exponentials are clamped at
// exp(-88), as silu_mul16's.
__attribute__((always_inline)) inline void fold_greedy(GreedyRow& g, __m512 o0, __m512 o1, __mmask16 lanes0, __mmask16 lanes1,
                        int64_t col0) {
  constexpr int kNanOrInf = 0x99;  // vfpclassps: QNaN | +inf | -inf | SNaN
  if ((_mm512_mask_fpclass_ps_mask(lanes0, o0, kNanOrInf) |
       _mm512_mask_fpclass_ps_mask(lanes1, o1, kNanOrInf)) != 0)
    g.special = true;
  const __m512 lowest = _mm512_set1_ps(-3.402823466e38f);
  const __m512 a = _mm512_mask_blend_ps(lanes0, lowest, o0);
  const __m512 b = _mm512_mask_blend_ps(lanes1, lowest, o1);
  const __m512 both = _mm512_max_ps(a, b);
  __m512 sums = _mm512_load_ps(g.sums);
  if (g.column < 0 || _mm512_cmp_ps_mask(both, _mm512_set1_ps(g.max), _CMP_GT_OQ) != 0) {
    const float top = _mm512_reduce_max_ps(both);
    const __m512 t = _mm512_set1_ps(top);
    const __mmask16 in0 = _mm512_mask_cmp_ps_mask(lanes0, a, t, _CMP_EQ_OQ);
    const __mmask16 in1 = _mm512_mask_cmp_ps_mask(lanes1, b, t, _CMP_EQ_OQ);
    // The sums so far, to the new maximum (none before the first chunk).
    if (g.column >= 0) sums = _mm512_mul_ps(sums, _mm512_set1_ps(expf_clamped(g.max - top)));
    // (Neither only where a NaN hid the maximum: the row is special then.)
    g.column = in0 != 0 ? col0 + __builtin_ctz(in0)
                        : col0 + 16 + (in1 != 0 ? __builtin_ctz(in1) : 0);
    g.max = top;
  }
  const __m512 m = _mm512_set1_ps(g.max), low = _mm512_set1_ps(-88.f);
  sums = _mm512_mask_add_ps(sums, lanes0, sums, exp_ps(_mm512_max_ps(_mm512_sub_ps(o0, m), low)));
  // Summed in this order in both callers: -ffast-math could otherwise regroup the two adds
  // differently where this is inlined.
  asm("" : "+v"(sums));
  sums = _mm512_mask_add_ps(sums, lanes1, sums, exp_ps(_mm512_max_ps(_mm512_sub_ps(o1, m), low)));
  _mm512_store_ps(g.sums, sums);
}

// A row's result from its segments' folds (count of them, `stride` GreedyRows apart) in
// column order: the first column holding the row's maximum (the earliest segment keeps a tie),
// that maximum, the log-normaliser max + log(sum of exp(value - max)), and whether every value
// was finite (and there was one). One compiled copy (noinline) for both callers.
struct GreedyChoice {
  int64_t column;
  float max;
  float lse;
  bool finite;
};
__attribute__((noinline)) inline GreedyChoice combine_greedy(const GreedyRow* segments,
                                                             int64_t count, int64_t stride) {
  GreedyChoice c{-1, 0.f, 0.f, true};
  for (int64_t s = 0; s < count; ++s) {
    const GreedyRow& g = segments[s * stride];
    c.finite &= !g.special;
    if (g.column >= 0 && (c.column < 0 || g.max > c.max)) {
      c.max = g.max;
      c.column = g.column;
    }
  }
  float sum = 0.f;
  for (int64_t s = 0; s < count; ++s) {
    const GreedyRow& g = segments[s * stride];
    const float segment = _mm512_reduce_add_ps(_mm512_load_ps(g.sums));
    if (g.column >= 0) sum += segment * expf_clamped(g.max - c.max);
  }
  c.lse = c.max + std::log(sum);
  c.finite &= c.column >= 0;
  return c;
}
#endif

// Whether the bfloat16 GEMM and prefill attention take AMX tiles where they can (set_amx): on by
// default; benchmarks and tests turn it off to compare with the register tiles.
inline std::atomic<bool> amx_wanted{true};

// Whether decode items (and, on AMX, prompt chunks) sharing a cached prompt's blocks take its
// keys once for all of them (prompt_partials; set_shared_prompt): on by default; tests and
// benchmarks turn it off to compare with each one reading all its keys itself.
inline std::atomic<bool> shared_prompt_wanted{true};

// AMX: eight tile registers of up to 16 rows x 64 bytes, and TDPBF16PS (a tile of float32 sums
// += a tile of bfloat16 pairs times another). The bfloat16 GEMM and prefill attention use them
// where the CPU has them (Sapphire Rapids and later Xeons) and Linux grants them.
#if defined(FERRUM_AMX)
// Whether Linux lets this process use the tiles: it grants them on request, per process (their
// 8 KB of state is then saved on every context switch). Asked once.
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// Loads the shapes of tiles 0-7 (rows, bytes per row) for this thread: the tile registers and
// their shapes are thread state, so each thread loads them before its first tile instruction
// (and releases them, _tile_release, after its last).
inline void load_tile_shapes(const uint8_t (&rows)[8], const uint16_t (&bytes)[8]) {
  struct alignas(64) Config {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = rows[t];
    config.bytes_per_row[t] = bytes[t];
  }
  // GCC 12 does not count ldtilecfg as reading the struct: inlined into a lambda run once per
  // thread, it dropped the widths' stores as dead, and ldtilecfg faulted on 16 rows of 0 bytes.
  // The barrier makes every store land first.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}
#endif

// Runs of consecutive decode items, or prompt chunks, whose block tables start with the same
// blocks: a cached prompt they share (prefix caching), whose keys both attention kernels then
// take once for the whole run (prompt_partials). Only whole blocks before each one's
// blocks_before(i) count (all its query rows see them), in multiples of 32 keys (a step of
// amx_values), and only a prompt of kMinSharedKeys keys or more shared by two or more.
struct SharedRun {
  int64_t first, count, keys;  // [first, first + count) share keys [0, keys)
};
constexpr int64_t kMinSharedKeys = 64;

template <typename BlocksBefore>
std::vector<SharedRun> shared_runs(const int64_t* tables, int64_t n, int64_t table_width,
                                   int64_t block_size, const BlocksBefore& blocks_before) {
  std::vector<SharedRun> found;
  for (int64_t i = 0; i < n;) {
    const int64_t* first = tables + i * table_width;
    int64_t blocks = blocks_before(i);
    int64_t j = i + 1;
    for (; j < n; ++j) {
      const int64_t* table = tables + j * table_width;
      const int64_t most = std::min(blocks, blocks_before(j));
      int64_t b = 0;
      while (b < most && table[b] == first[b]) ++b;
      if (b * block_size < kMinSharedKeys) break;
      blocks = b;
    }
    const int64_t keys = blocks * block_size / 32 * 32;
    if (j - i >= 2 && keys >= kMinSharedKeys) found.push_back({i, j - i, keys});
    i = j;
  }
  return found;
}

// What the merges that follow read (both attention kernels): each member's (decode item's or
// prompt chunk's) first key of its own pass (0 outside a run: all its keys), and by q row and
// query head the runs' partials: max and sum [q rows][H], out [q rows][H][D], float32. Only
// the rows of runs are written and read, so those are left uninitialised: zeroed, a unified
// step's prompt rows cost a memset of megabytes at every layer.
struct PromptPartials {
  std::vector<int64_t> starts;
  std::unique_ptr<float[]> max, sum, out;
};

// Two parts of one row's softmax merged (a shared prompt's keys and the row's own): each part
// kept as the max m of its scores, the sum l of e^(score - m) and its unnormalised output o.
// The row's output is (o1 a1 + o2 a2) * norm.
struct SoftmaxMerge {
  float a1, a2, norm;
};
inline SoftmaxMerge merge_softmax(float m1, float l1, float m2, float l2) {
  const float m = std::max(m1, m2);
  const float a1 = std::exp(m1 - m), a2 = std::exp(m2 - m);
  return {a1, a2, 1.f / (l1 * a1 + l2 * a2)};
}

// Attention's packed operands, shared by the prefill kernel (every chunk's keys and values) and
// the decode kernel (a shared prompt's, for every item reading it): keys in tiles of kKeyTile
// tokens transposed by 32-bit words (a score vector's lanes; on AMX, TDPBF16PS's B operand),
// values of two tokens interleaved by element (the bfloat16 pair layout). On AMX, the products
// over them (amx_scores, amx_values).
constexpr int kKeyTile = 16;  // keys per packed K tile (the lanes of a score vector)

#if defined(__AVX512F__)
// In place: a[j] word c -> a[c] word j (a 16 x 16 transpose of 32-bit words).
inline void transpose16(__m512i a[16]) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {  // pairs of rows interleaved by word
    t[2 * k] = _mm512_unpacklo_epi32(a[2 * k], a[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(a[2 * k], a[2 * k + 1]);
  }
  // u[4k + c], 128-bit lane L: words 4L + c of rows 4k .. 4k + 3.
  for (int k = 0; k < 4; ++k) {
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  // Word 4L + c of all rows: lane L of u[c], u[4 + c], u[8 + c], u[12 + c] (a 4 x 4 transpose
  // of 128-bit lanes).
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
    const __m512i x2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i x3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
    a[c] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    a[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xdd);
    a[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    a[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xdd);
  }
}
#endif

// One tile of keys, [words][16 tokens] of 32-bit words (a float, or a bfloat16 pair): the
// lanes of a score vector. rows[j] is token j's head row, nullptr past the context (zeros).
template <typename T>
void pack_key_tile(const T* const* rows, int64_t words, uint32_t* out) {
#if defined(__AVX512F__)
  for (int64_t w0 = 0; w0 < words; w0 += 16) {
    const int64_t n = std::min<int64_t>(16, words - w0);
    __m512i a[16];
    for (int j = 0; j < kKeyTile; ++j) {
      const auto* src = reinterpret_cast<const uint32_t*>(rows[j]);
      a[j] = src == nullptr ? _mm512_setzero_si512()
                            : _mm512_maskz_loadu_epi32(first_lanes(n), src + w0);
    }
    transpose16(a);
    for (int64_t c = 0; c < n; ++c) _mm512_storeu_si512(out + (w0 + c) * kKeyTile, a[c]);
  }
#else
  for (int j = 0; j < kKeyTile; ++j)
    for (int64_t i = 0; i < words; ++i) {
      uint32_t word = 0;
      if (rows[j] != nullptr) std::memcpy(&word, reinterpret_cast<const char*>(rows[j]) + 4 * i, 4);
      out[i * kKeyTile + j] = word;
    }
#endif
}

// Values of tokens (t, t + 1) as [D][2] (the bfloat16 pair layout), from their head rows.
inline void pack_value_pair(const uint16_t* a, const uint16_t* b, int64_t head_dim,
                            uint16_t* out) {
#if defined(__AVX512BW__)
  // Output word d = (a[d], b[d]): index i < 32 picks from a, 32 + i from b.
  alignas(64) static const uint16_t lo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                              37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                              11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                              53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                              27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo_idx = _mm512_load_si512(lo), hi_idx = _mm512_load_si512(hi);
  for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
    const int64_t n = std::min<int64_t>(32, head_dim - d0);  // 16 or 32 (D is a multiple of 16)
    const __mmask32 lanes = n == 32 ? ~__mmask32(0) : __mmask32(0xffff);
    const __m512i zero = _mm512_setzero_si512();
    const __m512i x = a == nullptr ? zero : _mm512_maskz_loadu_epi16(lanes, a + d0);
    const __m512i y = b == nullptr ? zero : _mm512_maskz_loadu_epi16(lanes, b + d0);
    _mm512_storeu_si512(out + 2 * d0, _mm512_permutex2var_epi16(x, lo_idx, y));
    if (n == 32) _mm512_storeu_si512(out + 2 * d0 + 32, _mm512_permutex2var_epi16(x, hi_idx, y));
  }
#else
  for (int64_t d = 0; d < head_dim; ++d) {
    out[2 * d] = a == nullptr ? 0 : a[d];
    out[2 * d + 1] = b == nullptr ? 0 : b[d];
  }
#endif
}

// Keys [pad / 16][D / w][16][w] and values [pad / w][D][w] of one (chunk, KV head): packed
// key t is position first + t; padded with zeros past ctx to pad (a multiple of 16) so tiles
// and pairs can run past ctx. This call packs keys [t_begin, t_end) (multiples of 16). S is the
// pool's element type, T the packed one: the same, or bfloat16 widened to float32 (exactly).
template <typename S, typename T>
void pack_kv(const S* k_pool, const S* v_pool, const int64_t* table, int64_t block_size,
             int64_t kv_row, int64_t head_offset, int64_t head_dim, int64_t first, int64_t ctx,
             int64_t t_begin, int64_t t_end, T* k_out, T* v_out) {
  constexpr int w = std::is_same<T, float>::value ? 1 : 2;  // elements per 32-bit word
  constexpr bool widen = !std::is_same<S, T>::value;
  static_assert(!widen || (std::is_same<S, uint16_t>::value && std::is_same<T, float>::value),
                "only bfloat16 widens (to float32)");
  const int64_t words = head_dim / w;
  // Packed key t's row of this head in a pool plane, or nullptr past the context.
  auto row = [&](const S* pool, int64_t t) -> const S* {
    const int64_t p = first + t;
    if (p >= ctx) return nullptr;
    return pool + (table[p / block_size] * block_size + p % block_size) * kv_row + head_offset;
  };
  // Widened rows of one key tile, when the pool is bfloat16 and the kernel runs float32.
  std::vector<T> wide(widen ? kKeyTile * head_dim : 0);
  const T* rows[kKeyTile];
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kKeyTile) {
    for (int j = 0; j < kKeyTile; ++j) {
      const S* src = row(k_pool, t0 + j);
      if constexpr (widen) {
        if (src != nullptr)
          for (int64_t d = 0; d < head_dim; ++d)
            wide[j * head_dim + d] = bf16_to_float(src[d]);
        rows[j] = src == nullptr ? nullptr : wide.data() + j * head_dim;
      } else {
        rows[j] = src;
      }
    }
    pack_key_tile<T>(rows, words, reinterpret_cast<uint32_t*>(k_out + t0 * head_dim));
  }
  for (int64_t t = t_begin; t < t_end; t += w) {
    if constexpr (w == 2) {
      pack_value_pair(row(v_pool, t), row(v_pool, t + 1), head_dim, v_out + t * head_dim);
    } else {
      const S* src = row(v_pool, t);
      T* dst = v_out + t * head_dim;
      if (src == nullptr) {
        std::memset(dst, 0, head_dim * sizeof(T));
      } else if constexpr (widen) {
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = bf16_to_float(src[d]);
      } else {
        std::memcpy(dst, src, head_dim * sizeof(T));
      }
    }
  }
}

#if defined(FERRUM_AMX)
// Tiles: 0 sixteen rows of 32 bfloat16 (q's dimensions, or probabilities of 32 keys); 1 a key
// tile's 16 pairs of dimensions, or 16 pairs of value tokens (16 columns); 2 eight pairs of
// value tokens (a last 16 keys); 3 sixteen rows of 16 probabilities (for those); 4-7 float32
// sums (16 rows x 16 keys or columns).
inline void load_attention_tiles() {
  constexpr uint8_t kRowsOf[8] = {16, 16, 8, 16, 16, 16, 16, 16};
  constexpr uint16_t kBytesOf[8] = {64, 64, 64, 32, 64, 64, 64, 64};
  load_tile_shapes(kRowsOf, kBytesOf);
}

// Scores of 16 q rows (q: [16][D], D apart) over `tiles` packed key tiles from k, into s (rows
// s_stride floats apart), four key tiles at a time.
inline void amx_scores(const uint16_t* q, int64_t head_dim, const uint16_t* k, int64_t tile_elems,
                       int64_t tiles, float* s, int64_t s_stride) {
  const int64_t chunks = head_dim / 32, q_bytes = head_dim * 2, s_bytes = s_stride * 4;
  constexpr int64_t kChunkElems = 16 * kKeyTile * 2;  // 16 pairs of dimensions of 16 tokens
  int64_t t = 0;
  for (; t + 4 <= tiles; t += 4) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const uint16_t* kt = k + t * tile_elems;
    for (int64_t j = 0; j < chunks; ++j) {
      _tile_loadd(0, q + 32 * j, q_bytes);
      _tile_loadd(1, kt + j * kChunkElems, 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(1, kt + tile_elems + j * kChunkElems, 64);
      _tile_dpbf16ps(5, 0, 1);
      _tile_loadd(1, kt + 2 * tile_elems + j * kChunkElems, 64);
      _tile_dpbf16ps(6, 0, 1);
      _tile_loadd(1, kt + 3 * tile_elems + j * kChunkElems, 64);
      _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(4, s + t * kKeyTile, s_bytes);
    _tile_stored(5, s + (t + 1) * kKeyTile, s_bytes);
    _tile_stored(6, s + (t + 2) * kKeyTile, s_bytes);
    _tile_stored(7, s + (t + 3) * kKeyTile, s_bytes);
  }
  for (; t < tiles; ++t) {
    _tile_zero(4);
    for (int64_t j = 0; j < chunks; ++j) {
      _tile_loadd(0, q + 32 * j, q_bytes);
      _tile_loadd(1, k + t * tile_elems + j * kChunkElems, 64);
      _tile_dpbf16ps(4, 0, 1);
    }
    _tile_stored(4, s + t * kKeyTile, s_bytes);
  }
}

// o[16][D] (float32, D apart) = 16 rows of probabilities (p, p_stride apart) over `keys` keys
// (a multiple of 16) times the packed value pairs from v, four 16-column tiles at a time.
inline void amx_values(const uint16_t* p, int64_t p_stride, const uint16_t* v, int64_t head_dim,
                       int64_t keys, float* o) {
  const int64_t p_bytes = p_stride * 2, v_bytes = head_dim * 4, pair_elems = head_dim * 2;
  const int64_t whole = keys / 32 * 32;
  for (int64_t c0 = 0; c0 < head_dim / 16; c0 += 4) {
    const int nc = static_cast<int>(std::min<int64_t>(4, head_dim / 16 - c0));
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const uint16_t* vc = v + c0 * 32;  // column tile c's 16 columns: 32 elements a pair row
    // Probabilities in tile P times the value pairs at vk, column tile by column tile, through
    // tile V. A macro: GCC's tile intrinsics take tile numbers as literal tokens, so a function
    // or template cannot pass them on.
#define FERRUM_AMX_VALUES_STEP(P, V, probs, vk)      \
  do {                                               \
    _tile_loadd(P, probs, p_bytes);                  \
    _tile_loadd(V, vk, v_bytes);                     \
    _tile_dpbf16ps(4, P, V);                         \
    if (nc > 1) {                                    \
      _tile_loadd(V, (vk) + 32, v_bytes);            \
      _tile_dpbf16ps(5, P, V);                       \
    }                                                \
    if (nc > 2) {                                    \
      _tile_loadd(V, (vk) + 64, v_bytes);            \
      _tile_dpbf16ps(6, P, V);                       \
    }                                                \
    if (nc > 3) {                                    \
      _tile_loadd(V, (vk) + 96, v_bytes);            \
      _tile_dpbf16ps(7, P, V);                       \
    }                                                \
  } while (0)
    for (int64_t key = 0; key < whole; key += 32)  // 32 keys: tiles 0 and 1 (16 pairs)
      FERRUM_AMX_VALUES_STEP(0, 1, p + key, vc + (key / 2) * pair_elems);
    if (whole < keys)  // a last 16 keys: tiles 3 and 2 (eight pairs)
      FERRUM_AMX_VALUES_STEP(3, 2, p + whole, vc + (whole / 2) * pair_elems);
#undef FERRUM_AMX_VALUES_STEP
    float* oc = o + c0 * 16;
    _tile_stored(4, oc, v_bytes);
    if (nc > 1) _tile_stored(5, oc + 16, v_bytes);
    if (nc > 2) _tile_stored(6, oc + 32, v_bytes);
    if (nc > 3) _tile_stored(7, oc + 48, v_bytes);
  }
}

#endif

#if defined(FERRUM_SHARED_PROMPT)
// The register-tile forms of amx_scores and amx_values, for a CPU without AMX, in bfloat16
// (vdpbf16ps) or float32 (FMAs): the same packed operands and outputs (packed as pack_kv<T, T>
// lays them out), each sum over its products in order. A "word" is 32 bits of a row: a bfloat16
// pair or a float.
template <typename T>
constexpr int kWordElems = std::is_same<T, float>::value ? 1 : 2;
#if defined(__AVX512BF16__)
constexpr bool kSharedPromptBf16 = true;
#else
constexpr bool kSharedPromptBf16 = false;  // the float32 forms only
#endif

// acc + the products of one broadcast word x of a row with a vector of 16 words y.
template <typename T>
inline __m512 word_madd(__m512 acc, __m512i x, __m512i y) {
  if constexpr (std::is_same<T, float>::value) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(y), acc);
  } else {
#if defined(__AVX512BF16__)
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)y);
#else
    static_assert(std::is_same<T, float>::value, "bfloat16 needs vdpbf16ps");
    return acc;
#endif
  }
}

// Row r's word i, broadcast.
template <typename T>
inline __m512i word_of(const T* row, int64_t i) {
  int32_t word;
  std::memcpy(&word, row + kWordElems<T> * i, sizeof word);
  return _mm512_set1_epi32(word);
}

// Scores: 8 q rows x NT key tiles of sums at a time, so each key vector loaded serves 8 rows.
template <typename T, int NT>
inline void reg_score_block(const T* q, int64_t head_dim, const T* k, int64_t tile_elems,
                            float* s, int64_t s_stride) {
  constexpr int kR = 8, w = kWordElems<T>;
  __m512 acc[kR][NT];
  for (int r = 0; r < kR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < head_dim / w; ++i) {  // word i of every key of the tiles
    __m512i keys[NT];
    for (int t = 0; t < NT; ++t)
      keys[t] = _mm512_loadu_si512(k + t * tile_elems + i * w * kKeyTile);
    for (int r = 0; r < kR; ++r) {
      const __m512i x = word_of(q + r * head_dim, i);
      for (int t = 0; t < NT; ++t) acc[r][t] = word_madd<T>(acc[r][t], x, keys[t]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(s + r * s_stride + t * kKeyTile, acc[r][t]);
}

// Scores of 16 q rows over `tiles` packed key tiles (as amx_scores).
template <typename T>
inline void reg_scores(const T* q, int64_t head_dim, const T* k, int64_t tile_elems,
                       int64_t tiles, float* s, int64_t s_stride) {
  for (int r0 = 0; r0 < 16; r0 += 8) {
    const T* qr = q + r0 * head_dim;
    float* sr = s + r0 * s_stride;
    int64_t t = 0;
    for (; t + 2 <= tiles; t += 2)
      reg_score_block<T, 2>(qr, head_dim, k + t * tile_elems, tile_elems, sr + t * kKeyTile,
                            s_stride);
    if (t < tiles)
      reg_score_block<T, 1>(qr, head_dim, k + t * tile_elems, tile_elems, sr + t * kKeyTile,
                            s_stride);
  }
}

// o's columns [16 c0, 16 (c0 + C)) of 4 rows = their probabilities over `steps` words of keys
// (pairs of keys in bfloat16) times the packed values: 4 x C accumulators, each value vector
// loaded serving 4 rows.
template <typename T, int C>
inline void reg_value_block(const T* p, int64_t p_stride, const T* v, int64_t head_dim,
                            int64_t steps, int64_t c0, float* o) {
  constexpr int kR = 4, w = kWordElems<T>;
  __m512 acc[kR][C];
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < steps; ++i) {
    __m512i values[C];
    const T* vi = v + i * w * head_dim + 16 * w * c0;
    for (int c = 0; c < C; ++c) values[c] = _mm512_loadu_si512(vi + 16 * w * c);
    for (int r = 0; r < kR; ++r) {
      const __m512i x = word_of(p + r * p_stride, i);
      for (int c = 0; c < C; ++c) acc[r][c] = word_madd<T>(acc[r][c], x, values[c]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * head_dim + 16 * (c0 + c), acc[r][c]);
}

// o[16][D] (float32, D apart) = 16 rows of probabilities over `keys` keys (an even count) times
// the packed values (as amx_values); head_dim a multiple of 32.
template <typename T>
inline void reg_values(const T* p, int64_t p_stride, const T* v, int64_t head_dim, int64_t keys,
                       float* o) {
  const int64_t columns = head_dim / 16, steps = keys / kWordElems<T>;  // columns: even
  for (int r0 = 0; r0 < 16; r0 += 4) {
    const T* pr = p + r0 * p_stride;
    float* orow = o + r0 * head_dim;
    int64_t c0 = 0;
    for (; c0 + 4 <= columns; c0 += 4)
      reg_value_block<T, 4>(pr, p_stride, v, head_dim, steps, c0, orow);
    if (c0 < columns) reg_value_block<T, 2>(pr, p_stride, v, head_dim, steps, c0, orow);
  }
}

// Attention partials of up to 16 query rows over `keys` keys every one of them sees (a shared
// prompt's, a multiple of 32), packed as pack_kv<T, T> lays them out (kp and vp, [keys][D]
// each), in T (bfloat16 bits, or float): on AMX tiles where `amx` (bfloat16 only;
// load_attention_tiles first), else on register tiles. For each row r < nr: max[r] (of its
// scores times scale), sum[r] (of e^(score * scale - max)) and out[r * D ..] (those numerators,
// in T, so rounded to bfloat16 there, times V: unnormalised), float32. q_block holds the 16 rows
// ([16][D] in T, zero past nr). The keys go kSharedKeyChunk at a time, each chunk's softmax
// folded into the running one, so the caller's buffers stay 16 x kSharedKeyChunk (in L1)
// however long the prompt: scores and probs, and o_block ([16][D] float32).
constexpr int64_t kSharedKeyChunk = 256;

template <typename T>
inline void shared_key_partials(const T* q_block, int nr, const T* kp, const T* vp, int64_t keys,
                                int64_t head_dim, float scale, float* scores, T* probs,
                                float* o_block, float* max, float* sum, float* out, bool amx) {
  constexpr float kLog2e = 1.44269504f;
  constexpr bool kFloat = std::is_same<T, float>::value;
  constexpr int kDegree = kFloat ? 5 : 4;  // exp2_nonpositive's fit: to T's precision
  float rescale[16];
  for (int64_t c0 = 0; c0 < keys; c0 += kSharedKeyChunk) {
    const int64_t n = std::min(kSharedKeyChunk, keys - c0);  // a multiple of 32
    const T* kc = kp + c0 * head_dim;
#if defined(FERRUM_AMX)
    if constexpr (!kFloat) {
      if (amx) amx_scores(q_block, head_dim, kc, kKeyTile * head_dim, n / kKeyTile, scores, n);
    }
    if (kFloat || !amx)
#endif
      reg_scores<T>(q_block, head_dim, kc, kKeyTile * head_dim, n / kKeyTile, scores, n);
    for (int r = 0; r < 16; ++r) {
      T* p = probs + r * n;
      if (r >= nr) {  // rows past the caller's: zero weights, outputs unused
        std::memset(p, 0, n * sizeof(T));
        continue;
      }
      const float* s = scores + r * n;
      const float chunk_max = row_max(s, n) * scale;  // scale > 0
      const float m = c0 == 0 ? chunk_max : std::max(max[r], chunk_max);
      const float chunk_sum = exp2_row<kDegree>(s, p, n, _mm512_set1_ps(scale * kLog2e),
                                                _mm512_set1_ps(-m * kLog2e));
      rescale[r] = c0 == 0 ? 0.f : std::exp(max[r] - m);
      sum[r] = c0 == 0 ? chunk_sum : sum[r] * rescale[r] + chunk_sum;
      max[r] = m;
    }
#if defined(FERRUM_AMX)
    if constexpr (!kFloat) {
      if (amx) amx_values(probs, n, vp + c0 * head_dim, head_dim, n, o_block);
    }
    if (kFloat || !amx)
#endif
      reg_values<T>(probs, n, vp + c0 * head_dim, head_dim, n, o_block);
    for (int r = 0; r < nr; ++r) {
      float* o = out + r * head_dim;
      const float* add = o_block + r * head_dim;
      const __m512 keep = _mm512_set1_ps(rescale[r]);
      for (int64_t d = 0; d < head_dim; d += 16)
        _mm512_storeu_ps(o + d, c0 == 0 ? _mm512_loadu_ps(add + d)
                                        : _mm512_fmadd_ps(_mm512_loadu_ps(o + d), keep,
                                                          _mm512_loadu_ps(add + d)));
    }
  }
}

// Query rows that all see one cached prompt's keys [0, keys) (a multiple of 32): the decode
// items, or the prompt chunks' rows, of a run sharing its blocks. table: the run's first block
// table (its first keys / block_size blocks are every row's); rows: (q row, query head within
// its KV head's group) pairs, in order.
struct PromptRows {
  const int64_t* table;
  int64_t keys;
  std::vector<std::array<int64_t, 2>> rows;
};

// The prompt part of the softmax of every row of the runs `found` among `members` (block
// tables `tables`, table_width apart) into `partials`; rows_of(member, add) calls add(q row)
// for each of a member's query rows, which then has all `group` query heads of every KV head.
// On AMX tiles where `amx`, else on register tiles: each run's keys and values packed once per
// KV head (pack_kv, in pieces over the threads), then units of 16 rows on one KV head through
// shared_key_partials. T: bfloat16 bits (on AMX where `amx`) or float; head_dim a multiple of
// 32. The outputs go by q row, of which q holds q_rows.
template <typename T, typename RowsOf>
void prompt_partials(const std::vector<SharedRun>& found, int64_t members, const int64_t* tables,
                     int64_t table_width, const RowsOf& rows_of, const T* q, int64_t q_stride,
                     int64_t q_rows, const T* k_pool, const T* v_pool, int64_t block_size,
                     int64_t n_kv_heads, int64_t group, int64_t head_dim, float scale, bool amx,
                     PromptPartials& partials) {
  partials.starts.assign(members, 0);
  std::vector<PromptRows> runs;
  for (const SharedRun& run : found) {
    std::fill_n(partials.starts.begin() + run.first, run.count, run.keys);
    PromptRows of_run{tables + run.first * table_width, run.keys, {}};
    for (int64_t m = run.first; m < run.first + run.count; ++m)
      rows_of(m, [&](int64_t row) {
        for (int64_t g = 0; g < group; ++g) of_run.rows.push_back({row, g});
      });
    runs.push_back(std::move(of_run));
  }
  const int64_t by_row = q_rows * n_kv_heads * group;
  partials.max.reset(new float[by_row]);
  partials.sum.reset(new float[by_row]);
  partials.out.reset(new float[by_row * head_dim]);
  float *max = partials.max.get(), *sum = partials.sum.get(), *out = partials.out.get();
  constexpr int kRows = 16;
  constexpr int64_t kPiece = 256;  // keys per packing piece
  const int64_t kv_row = n_kv_heads * head_dim, heads = n_kv_heads * group;
  std::vector<int64_t> base(runs.size());
  int64_t total = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    base[r] = total;
    total += 2 * n_kv_heads * runs[r].keys * head_dim;  // per KV head: keys, then values
  }
  // Per call (a server keeps freed heap memory: host_memory.py): no more than the prompts'
  // K/V, 1 MB for 1,024 keys of W1's 4 KV heads of 64 in bfloat16. Left uninitialised: the
  // pieces below write all of it.
  const std::unique_ptr<T[]> packed(new T[total]);
  auto packed_at = [&](size_t r, int64_t h) {
    return packed.get() + base[r] + h * 2 * runs[r].keys * head_dim;
  };
  std::vector<std::array<int64_t, 3>> pieces, units;  // (run, KV head, first key or row)
  for (size_t r = 0; r < runs.size(); ++r)
    for (int64_t h = 0; h < n_kv_heads; ++h) {
      for (int64_t t = 0; t < runs[r].keys; t += kPiece)
        pieces.push_back({static_cast<int64_t>(r), h, t});
      for (int64_t i = 0; i < static_cast<int64_t>(runs[r].rows.size()); i += kRows)
        units.push_back({static_cast<int64_t>(r), h, i});
    }
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [r, h, t] = pieces[i];
      T* kp = packed_at(r, h);
      pack_kv<T, T>(k_pool, v_pool, runs[r].table, block_size, kv_row, h * head_dim, head_dim, 0,
                    runs[r].keys, t, std::min(runs[r].keys, t + kPiece), kp,
                    kp + runs[r].keys * head_dim);
    }
  });
  std::atomic<int64_t> next{0};
  const int64_t n_units = static_cast<int64_t>(units.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
#if defined(FERRUM_AMX)
    if (amx) load_attention_tiles();
#endif
    std::vector<float> scores(kRows * kSharedKeyChunk), o_block(kRows * head_dim);
    std::vector<float> o_run(kRows * head_dim);
    std::vector<T> probs(kRows * kSharedKeyChunk), q_block(kRows * head_dim);
    for (int64_t u = next++; u < n_units; u = next++) {
      const auto [r, h, i0] = units[u];
      const PromptRows& run = runs[r];
      const int nr = static_cast<int>(
          std::min<int64_t>(kRows, static_cast<int64_t>(run.rows.size()) - i0));
      int64_t at[kRows];  // each row's (q row, query head) in the outputs
      for (int i = 0; i < kRows; ++i) {
        T* dst = q_block.data() + i * head_dim;
        if (i >= nr) {  // past the run's rows: zero, their outputs unused
          std::memset(dst, 0, head_dim * sizeof(T));
          continue;
        }
        const auto [row, g] = run.rows[i0 + i];
        const int64_t head = h * group + g;
        std::memcpy(dst, q + row * q_stride + head * head_dim, head_dim * sizeof(T));
        at[i] = row * heads + head;
      }
      const T* kp = packed_at(r, h);
      float row_max[kRows], row_sum[kRows];
      shared_key_partials<T>(q_block.data(), nr, kp, kp + run.keys * head_dim, run.keys,
                             head_dim, scale, scores.data(), probs.data(), o_block.data(),
                             row_max, row_sum, o_run.data(), amx);
      for (int i = 0; i < nr; ++i) {
        max[at[i]] = row_max[i];
        sum[at[i]] = row_sum[i];
        std::memcpy(out + at[i] * head_dim, o_run.data() + i * head_dim,
                    head_dim * sizeof(float));
      }
    }
#if defined(FERRUM_AMX)
    if (amx) _tile_release();
#endif
  });
}
#endif

}  // namespace ferrum
