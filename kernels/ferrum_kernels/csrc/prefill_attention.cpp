// Causal attention of prefill chunks over the paged KV pool, fused (see cpu_attention.py).
//
// Two phases. First each (chunk, KV head) has its keys and values copied out of the pool, once,
// into the layouts the inner loops stream: keys transposed in tiles of 16 (a score vector holds
// 16 keys), values as rows (float32) or interleaved token pairs (bfloat16: the operand layout of
// vdpbf16ps). Then work units of (chunk, KV head, a run of query positions) x the G query heads
// sharing the KV head are taken by the threads, largest first. A unit goes a group of rows at a
// time: scores of the rows over exactly the keys they can see (register blocks, so each key
// vector loaded serves several rows), a float32 softmax, then probabilities times V with the
// output held in registers and written once. Only a block's causal diagonal is computed and
// masked; the upper triangle is skipped. Scores of a group (24 rows x context) stay in L1/L2.
//
// Sliding window (window > 0: a query at p sees keys in (p - window, p]): a chunk packs only the
// keys from its first query's window start (rounded down to a tile), and each group and block
// of rows starts at the tile holding its first row's window start, so the work per row is
// O(window), however long the context. All of it is index arithmetic in prefill_impl (which
// keys are packed, where a row's visible range starts and ends); the vectorised loops only see
// pointers and lengths, as for global attention.
//
// Numerics: scores, softmax and accumulation in float32 whatever the dtype; the scale applies to
// float32 scores (not folded into a rounded q). In bfloat16 the unnormalised probabilities are
// rounded to bfloat16 for PV (the torch path rounds the normalised ones: the same relative
// error), and the output is rounded once at the end.
//
// On a CPU with AMX, bfloat16 with head_dim a multiple of 32 runs QK^T and PV on AMX tiles
// (amx_scores, amx_values), on the same packed K/V: about 2.6-3.1x the register blocks on a
// 2-vCPU Xeon at W1's shapes (docs/cpu-kernels.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#define FERRUM_PREFILL_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
// float32 only: the same tiles of 16 keys, each held as two 8-lane vectors.
#define FERRUM_PREFILL_AVX2 1
#endif
#if defined(FERRUM_PREFILL_AVX512) || defined(FERRUM_PREFILL_AVX2)
#include <immintrin.h>
#endif
// Register blocks' loops fully unrolled, so their accumulator arrays live in registers. Without
// it GCC 12 kept them on the stack, stored every iteration: the AVX2 blocks ran 3x slower, and
// the AVX-512 build had 205 zmm stack stores (6 with it).
#define FERRUM_UNROLL _Pragma("GCC unroll 16")

#include "common.h"

namespace {

using ferrum::Elem;
#if defined(__AVX512F__)
using ferrum::exp2_nonpositive;
using ferrum::first_lanes;
using ferrum::store16;
using ferrum::to_bf16;
#endif

constexpr int kTile = ferrum::kKeyTile;  // keys per packed K tile (the lanes of a score vector)
#if defined(__AVX512F__)
using ferrum::transpose16;
#endif
using ferrum::pack_key_tile;
using ferrum::pack_kv;
using ferrum::pack_value_pair;
#if defined(FERRUM_AMX)
using ferrum::amx_scores;
using ferrum::amx_values;
using ferrum::load_attention_tiles;
#endif
#if defined(FERRUM_PREFILL_AVX512)
// Register blocks (measured on Zen 4, head_dim 64): QK^T holds 8 rows x 2 key tiles of scores
// (16 accumulators; each key vector loaded feeds 8 rows), PV 6 rows x 4 output vectors (24).
constexpr int kQkRows = 8;
constexpr int kQkTiles = 2;
constexpr int kPvRows = 6;
constexpr int kMaxCols = 4;      // PV output vectors (16 columns each) per row held at once
#else
// AVX2 has 16 registers of 8 floats, and a tile of 16 keys (or 16 output columns) takes two:
// QK^T holds 6 rows x 1 tile (12 accumulators, 2 key vectors, a broadcast), PV 6 rows x 16
// columns (the same count).
constexpr int kQkRows = 6;
constexpr int kQkTiles = 1;
constexpr int kPvRows = 6;
constexpr int kMaxCols = 1;
#endif
constexpr int kGroupRows = 24;   // rows scored, softmaxed and summed together (blocks divide it)
constexpr int kUnitRows = 48;    // query rows (positions x G heads) per work unit, about
constexpr int64_t kPackKeys = 256;  // positions per piece of packing work (a multiple of 16)

// Element types by storage: float, or bfloat16 bits. A "word" is 32 bits of a row: one float,
// or a pair of adjacent bfloat16 values (the unit vdpbf16ps multiplies and adds).
template <typename T>
struct Ops;

template <>
struct Ops<float> {
  static constexpr int kPerWord = 1;
  static inline float word_dot(const float* a, const float* b) { return a[0] * b[0]; }
#if defined(__AVX512F__)
  using Vec = __m512;
  static inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static inline Vec bcast(const float* row, int64_t w) { return _mm512_set1_ps(row[w]); }
  static inline __m512 madd(__m512 acc, Vec a, Vec b) { return _mm512_fmadd_ps(a, b, acc); }
#define FERRUM_PREFILL_SIMD_F32 1
#elif defined(FERRUM_PREFILL_AVX2)
#define FERRUM_PREFILL_SIMD_F32 1  // the loops below have AVX2 branches for float
#endif
};

template <>
struct Ops<uint16_t> {
  static constexpr int kPerWord = 2;
  static inline float word_dot(const uint16_t* a, const uint16_t* b) {
    return ferrum::bf16_to_float(a[0]) * ferrum::bf16_to_float(b[0]) +
           ferrum::bf16_to_float(a[1]) * ferrum::bf16_to_float(b[1]);
  }
#if defined(__AVX512BF16__)
  using Vec = __m512i;
  static inline Vec load(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static inline Vec bcast(const uint16_t* row, int64_t w) {
    int32_t word;
    std::memcpy(&word, row + 2 * w, sizeof word);
    return _mm512_set1_epi32(word);
  }
  static inline __m512 madd(__m512 acc, Vec a, Vec b) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
  }
#define FERRUM_PREFILL_SIMD_BF16 1
#elif defined(__AVX512F__)
  // No vdpbf16ps: each 32-bit lane's pair is widened to two floats (a bfloat16 is the high half
  // of a float) and multiplied with two FMAs. About half the speed; same layouts.
  using Vec = __m512i;
  static inline Vec load(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static inline Vec bcast(const uint16_t* row, int64_t w) {
    int32_t word;
    std::memcpy(&word, row + 2 * w, sizeof word);
    return _mm512_set1_epi32(word);
  }
  static inline __m512 madd(__m512 acc, Vec a, Vec b) {
    return _mm512_fmadd_ps(ferrum::bf16_odds(a), ferrum::bf16_odds(b),
                           _mm512_fmadd_ps(ferrum::bf16_evens(a), ferrum::bf16_evens(b), acc));
  }
#define FERRUM_PREFILL_SIMD_BF16 1
#endif
};

template <typename T>
constexpr bool has_simd() {
#if defined(FERRUM_PREFILL_SIMD_BF16)
  if (std::is_same<T, uint16_t>::value) return true;
#endif
#if defined(FERRUM_PREFILL_SIMD_F32)
  if (std::is_same<T, float>::value) return true;
#endif
  return false;
}

#if defined(FERRUM_PREFILL_AVX2)
// 2^t for t <= 0, 8 lanes: the degree-5 fit of exp2_nonpositive (common.h; 2e-7 relative),
// scaled by 2^n built in the exponent bits. t below -127 is clamped there, where 2^n's bits are
// all zero, so far-below-range lanes (and the -FLT_MAX padding of a row's tail) come out 0.
inline __m256 exp2_nonpositive_avx2(__m256 t) {
  t = _mm256_max_ps(t, _mm256_set1_ps(-127.f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.34004327e-3f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.67603736e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.55032715e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.40221068e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.93147182e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.00000012f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float reduce_max(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline float reduce_add(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
#endif

// Softmax numerators of one row: p[0, m) = exp((s[j] - max) * scale) rounded to T, p[m, end)
// zero (keys the row cannot see, up to where the PV loop reads). Returns 1 / their float sum;
// the PV epilogue applies it, so the probabilities need no second pass.
template <typename T>
float softmax_row(const float* s, T* p, int64_t m, int64_t end, float scale) {
  if constexpr (has_simd<T>()) {
#if defined(__AVX512F__)
    constexpr float kLog2e = 1.44269504f;
    constexpr int degree = std::is_same<T, float>::value ? 5 : 4;
    const float mx = ferrum::row_max(s, m);
    // exp((s - mx) * scale) = 2^(s * a + b), one FMA per element.
    const __m512 a = _mm512_set1_ps(scale * kLog2e), b = _mm512_set1_ps(-mx * scale * kLog2e);
    const float sum = ferrum::exp2_row<degree>(s, p, m, a, b);
    std::fill(p + m, p + end, T(0));  // keys the row cannot see, up to where PV reads
    return 1.f / sum;
#elif defined(FERRUM_PREFILL_AVX2)
    constexpr float kLog2e = 1.44269504f;
    constexpr float kLowest = -std::numeric_limits<float>::max();
    __m256 top = _mm256_set1_ps(kLowest);
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + j));
    float mx = reduce_max(top);
    for (int64_t i = j; i < m; ++i) mx = std::max(mx, s[i]);
    const __m256 a = _mm256_set1_ps(scale * kLog2e), b = _mm256_set1_ps(-mx * scale * kLog2e);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= m; j += 8) {
      const __m256 e = exp2_nonpositive_avx2(_mm256_fmadd_ps(_mm256_loadu_ps(s + j), a, b));
      sum = _mm256_add_ps(sum, e);
      _mm256_storeu_ps(p + j, e);
    }
    if (j < m) {  // the row's last keys; padded lanes give 0 (see exp2_nonpositive_avx2)
      alignas(32) float tail[8];
      for (int l = 0; l < 8; ++l) tail[l] = j + l < m ? s[j + l] : kLowest;
      const __m256 e = exp2_nonpositive_avx2(_mm256_fmadd_ps(_mm256_load_ps(tail), a, b));
      sum = _mm256_add_ps(sum, e);
      _mm256_storeu_ps(p + j, e);  // within the row's slack past m
      j += 8;
    }
    for (; j < end; j += 8) _mm256_storeu_ps(p + j, _mm256_setzero_ps());
    return 1.f / reduce_add(sum);
#endif
  }
  float mx = s[0];
  for (int64_t j = 1; j < m; ++j) mx = std::max(mx, s[j]);
  float sum = 0.f;
  for (int64_t j = 0; j < m; ++j) {
    const float e = std::exp((s[j] - mx) * scale);
    sum += e;
    Elem<T>::store(p, j, e);
  }
  for (int64_t j = m; j < end; ++j) p[j] = T(0);
  return 1.f / sum;
}

// Scores s[r][0, 16 * NT) = q[r] . keys of NT consecutive packed tiles (tile = [D/w][16][w]).
template <typename T, int R, int NT>
inline void qk_block(const T* const* q, const T* k, int64_t tile_elems, int64_t words, float* s,
                     int64_t s_stride) {
  constexpr int w = Ops<T>::kPerWord;
  if constexpr (has_simd<T>()) {
#if defined(__AVX512F__)
    __m512 acc[R][NT];
    FERRUM_UNROLL for (int r = 0; r < R; ++r)
      FERRUM_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < words; ++i) {
      typename Ops<T>::Vec kv[NT];
      FERRUM_UNROLL for (int t = 0; t < NT; ++t)
        kv[t] = Ops<T>::load(k + t * tile_elems + i * kTile * w);
      FERRUM_UNROLL for (int r = 0; r < R; ++r) {
        const auto b = Ops<T>::bcast(q[r], i);
        FERRUM_UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = Ops<T>::madd(acc[r][t], b, kv[t]);
      }
    }
    FERRUM_UNROLL for (int r = 0; r < R; ++r)
      FERRUM_UNROLL for (int t = 0; t < NT; ++t)
        _mm512_storeu_ps(s + r * s_stride + t * kTile, acc[r][t]);
    return;
#elif defined(FERRUM_PREFILL_AVX2)
    __m256 acc[R][NT][2];
    FERRUM_UNROLL for (int r = 0; r < R; ++r)
      FERRUM_UNROLL for (int t = 0; t < NT; ++t)
        acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < words; ++i) {
      __m256 kv[NT][2];
      FERRUM_UNROLL for (int t = 0; t < NT; ++t)
        FERRUM_UNROLL for (int h = 0; h < 2; ++h)
          kv[t][h] = _mm256_loadu_ps(k + t * tile_elems + i * kTile + 8 * h);
      FERRUM_UNROLL for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_broadcast_ss(q[r] + i);
        FERRUM_UNROLL for (int t = 0; t < NT; ++t)
          FERRUM_UNROLL for (int h = 0; h < 2; ++h)
            acc[r][t][h] = _mm256_fmadd_ps(b, kv[t][h], acc[r][t][h]);
      }
    }
    FERRUM_UNROLL for (int r = 0; r < R; ++r)
      FERRUM_UNROLL for (int t = 0; t < NT; ++t)
        FERRUM_UNROLL for (int h = 0; h < 2; ++h)
          _mm256_storeu_ps(s + r * s_stride + t * kTile + 8 * h, acc[r][t][h]);
    return;
#endif
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t)
      for (int j = 0; j < kTile; ++j) {
        float sum = 0.f;
        for (int64_t i = 0; i < words; ++i)
          sum += Ops<T>::word_dot(q[r] + i * w, k + t * tile_elems + (i * kTile + j) * w);
        s[r * s_stride + t * kTile + j] = sum;
      }
}

// Scores of R rows over `tiles` key tiles from key 0.
template <typename T, int R>
void qk_rows(const T* const* q, const T* k, int64_t tile_elems, int64_t words, int64_t tiles,
             float* s, int64_t s_stride) {
  int64_t t = 0;
  for (; t + kQkTiles <= tiles; t += kQkTiles)
    qk_block<T, R, kQkTiles>(q, k + t * tile_elems, tile_elems, words, s + t * kTile, s_stride);
  for (; t < tiles; ++t)
    qk_block<T, R, 1>(q, k + t * tile_elems, tile_elems, words, s + t * kTile, s_stride);
}

// o[r][0, 16 * C) = inv[r] * sum over `steps` words i of p[r] word i x v rows of word i
// ([steps][D][w]), rounded to T; `v` and `o` already offset to the first output column.
template <typename T, int R, int C>
inline void pv_block(const T* p, int64_t p_stride, const T* v, int64_t step_elems, int64_t steps,
                     const float* inv, T* const* o, int64_t col) {
  constexpr int w = Ops<T>::kPerWord;
  if constexpr (has_simd<T>()) {
#if defined(__AVX512F__)
    __m512 acc[R][C];
    FERRUM_UNROLL for (int r = 0; r < R; ++r)
      FERRUM_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < steps; ++i) {
      typename Ops<T>::Vec vv[C];
      FERRUM_UNROLL for (int c = 0; c < C; ++c)
        vv[c] = Ops<T>::load(v + i * step_elems + c * kTile * w);
      FERRUM_UNROLL for (int r = 0; r < R; ++r) {
        const auto b = Ops<T>::bcast(p + r * p_stride, i);
        FERRUM_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = Ops<T>::madd(acc[r][c], b, vv[c]);
      }
    }
    FERRUM_UNROLL for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_set1_ps(inv[r]);
      FERRUM_UNROLL for (int c = 0; c < C; ++c)
        store16(o[r] + col + c * kTile, _mm512_mul_ps(acc[r][c], scale));
    }
    return;
#elif defined(FERRUM_PREFILL_AVX2)
    __m256 acc[R][C][2];
    FERRUM_UNROLL for (int r = 0; r < R; ++r)
      FERRUM_UNROLL for (int c = 0; c < C; ++c)
        acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < steps; ++i) {
      __m256 vv[C][2];
      FERRUM_UNROLL for (int c = 0; c < C; ++c)
        FERRUM_UNROLL for (int h = 0; h < 2; ++h)
          vv[c][h] = _mm256_loadu_ps(v + i * step_elems + c * kTile + 8 * h);
      FERRUM_UNROLL for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_broadcast_ss(p + r * p_stride + i);
        FERRUM_UNROLL for (int c = 0; c < C; ++c)
          FERRUM_UNROLL for (int h = 0; h < 2; ++h)
            acc[r][c][h] = _mm256_fmadd_ps(b, vv[c][h], acc[r][c][h]);
      }
    }
    FERRUM_UNROLL for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_set1_ps(inv[r]);
      FERRUM_UNROLL for (int c = 0; c < C; ++c)
        FERRUM_UNROLL for (int h = 0; h < 2; ++h)
          _mm256_storeu_ps(o[r] + col + c * kTile + 8 * h, _mm256_mul_ps(acc[r][c][h], scale));
    }
    return;
#endif
  }
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < C * kTile; ++l) {
      float sum = 0.f;
      for (int64_t i = 0; i < steps; ++i)
        sum += Ops<T>::word_dot(p + r * p_stride + i * w, v + i * step_elems + l * w);
      Elem<T>::store(o[r], col + l, sum * inv[r]);
    }
}

template <typename T, int R>
void pv_rows(const T* p, int64_t p_stride, const T* v, int64_t head_dim, int64_t steps,
             const float* inv, T* const* o) {
  constexpr int w = Ops<T>::kPerWord;
  const int64_t cols = head_dim / kTile;  // 16-wide column vectors
  for (int64_t c0 = 0; c0 < cols; c0 += kMaxCols) {
    const T* vc = v + c0 * kTile * w;
    const int64_t col = c0 * kTile;
    switch (std::min<int64_t>(kMaxCols, cols - c0)) {
      case 1: pv_block<T, R, 1>(p, p_stride, vc, head_dim * w, steps, inv, o, col); break;
      case 2: pv_block<T, R, 2>(p, p_stride, vc, head_dim * w, steps, inv, o, col); break;
      case 3: pv_block<T, R, 3>(p, p_stride, vc, head_dim * w, steps, inv, o, col); break;
      default: pv_block<T, R, 4>(p, p_stride, vc, head_dim * w, steps, inv, o, col); break;
    }
  }
}

// Op<T, min(rows, R)>::run(args...): a runtime row count to an unrolled block.
template <typename T, template <typename, int> class Op, int R, typename... Args>
void by_rows(int rows, Args... args) {
  if constexpr (R > 1) {
    if (rows < R) return by_rows<T, Op, R - 1>(rows, args...);
  }
  Op<T, R>::run(args...);
}

template <typename T, int R>
struct QK {
  static void run(const T* const* q, const T* k, int64_t te, int64_t words, int64_t tiles,
                  float* s, int64_t ss) {
    qk_rows<T, R>(q, k, te, words, tiles, s, ss);
  }
};

template <typename T, int R>
struct PV {
  static void run(const T* p, int64_t ps, const T* v, int64_t d, int64_t steps, const float* inv,
                  T* const* o) {
    pv_rows<T, R>(p, ps, v, d, steps, inv, o);
  }
};

constexpr int kAmxTileRows = 16;  // query rows per AMX tile
#if defined(FERRUM_AMX)
// The bfloat16 products on AMX tiles (FERRUM_AMX, head_dim a multiple of 32): the packed keys
// of a tile are 16 rows (pairs of dimensions) of 16 tokens' pairs, and a pair of packed value
// tokens [D][2], both already the operand layout of TDPBF16PS, so the scratch is the same. A
// group's q rows are copied into one strided block (a tile loads rows a fixed stride apart).
// Scores of 16 rows x 16 keys sum D in float32, as the register blocks do (in another order);
// probabilities are the same bfloat16 ones; each output is summed over 32 keys a tile (16 for
// a last half), in float32, and rounded once.
constexpr int kMaxGroupRows = 32;  // rows scored, softmaxed and summed together on tiles

#else
constexpr int kMaxGroupRows = kGroupRows;
#endif

struct Unit {
  int64_t chunk, head, q0, q1, cost;
};

// The first key position any query of a chunk can see, rounded down to a whole tile: where the
// chunk's packed keys start (0 for global attention).
inline int64_t first_packed(int64_t ctx, int64_t n, int64_t window) {
  if (window == 0) return 0;
  return std::max<int64_t>(0, ctx - n - window + 1) / kTile * kTile;
}

// Keys packed for a chunk: from position `first` (first_packed, or a shared prompt's end) to
// its context, padded to whole tiles.
inline int64_t packed_keys(int64_t ctx, int64_t first) {
  return (ctx - first + kTile - 1) / kTile * kTile;
}

// Chunks of a step that continue a cached prompt they share (ferrum::shared_runs: a system
// prompt ahead of each request's own tokens), counting the blocks before each chunk's first
// query. Each chunk would pack and score those keys itself (w2-prefix: about 16 chunks a step,
// each over the same 1,024 keys). On AMX the prompt's part of every such row's softmax is
// computed once for all of them (ferrum::prompt_partials, as the decode kernel does for items
// sharing one), and each chunk packs and scores only its own keys after it.
std::vector<ferrum::SharedRun> prompt_runs(const int64_t* info, const int64_t* tables,
                                           int64_t n_chunks, int64_t table_width,
                                           int64_t block_size) {
  return ferrum::shared_runs(tables, n_chunks, table_width, block_size, [&](int64_t c) {
    return (info[3 * c + 2] - (info[3 * c + 1] - info[3 * c])) / block_size;
  });
}

// S: the element type of q, the pools and out; T: the one the loops run in (S, or float32 for
// bfloat16 on a CPU whose SIMD loops are float32 only: q rows, keys and values are widened
// exactly as they are packed or loaded, and each output row is rounded to bfloat16 once).
template <typename S, typename T>
void prefill_impl(const S* q, int64_t q_stride, const S* k_pool, const S* v_pool, S* out,
                  int64_t out_stride, const int64_t* info, const int64_t* tables,
                  int64_t n_chunks, int64_t table_width, int64_t block_size, int64_t n_kv_heads,
                  int64_t group, int64_t head_dim, float scale, int64_t window, T* scratch) {
  constexpr int w = Ops<T>::kPerWord;
  const int64_t kv_row = n_kv_heads * head_dim;
  const int64_t tile_elems = kTile * head_dim;
  constexpr bool widen = !std::is_same<S, T>::value;
#if defined(FERRUM_AMX)
  constexpr bool kBf16 = std::is_same<T, uint16_t>::value && !widen;
  const bool amx = kBf16 && head_dim % 32 == 0 && ferrum::amx_wanted.load() &&
                   ferrum::amx_permitted();
#else
  constexpr bool amx = false;
#endif
  const int64_t heads = n_kv_heads * group;
  // Chunks continuing a cached prompt they share: its keys' partials, once (prompt_runs).
  ferrum::PromptPartials partials;  // starts: keys left to the partials, per chunk (0: none)
#if defined(FERRUM_AMX)
  if constexpr (kBf16) {
    if (amx && window == 0 && ferrum::shared_prompt_wanted.load()) {
      const std::vector<ferrum::SharedRun> runs =
          prompt_runs(info, tables, n_chunks, table_width, block_size);
      if (!runs.empty()) {
        int64_t rows = 0;
        for (int64_t c = 0; c < n_chunks; ++c) rows = std::max(rows, info[3 * c + 1]);
        ferrum::prompt_partials<uint16_t>(
            runs, n_chunks, tables, table_width,
            [&](int64_t c, const auto& add) {
              for (int64_t t = info[3 * c]; t < info[3 * c + 1]; ++t) add(t);
            },
            reinterpret_cast<const uint16_t*>(q), q_stride, rows,
            reinterpret_cast<const uint16_t*>(k_pool), reinterpret_cast<const uint16_t*>(v_pool),
            block_size, n_kv_heads, group, head_dim, scale, /*amx=*/true, partials);
      }
    }
  }
#endif
  if (partials.starts.empty()) partials.starts.assign(n_chunks, 0);
  const std::vector<int64_t>& prompt_keys = partials.starts;
  // Where each chunk's packed K/V starts in the scratch: [C][Hkv][K pad*D, V pad*D], and the
  // position of its packed key 0.
  std::vector<int64_t> base(n_chunks), pad(n_chunks), first(n_chunks);
  int64_t total = 0, max_pad = 0;
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t n = info[3 * c + 1] - info[3 * c], ctx = info[3 * c + 2];
    first[c] = prompt_keys[c] > 0 ? prompt_keys[c] : first_packed(ctx, n, window);
    pad[c] = packed_keys(ctx, first[c]);
    max_pad = std::max(max_pad, pad[c]);
    base[c] = total;
    total += pad[c] * head_dim * 2 * n_kv_heads;
  }
  // Packing goes in pieces of kPackKeys positions of one (chunk, KV head), so that a single
  // long chunk, or a model with one KV head, still keeps every thread busy.
  std::vector<std::array<int64_t, 3>> pieces;  // (chunk, head, first packed key)
  for (int64_t c = 0; c < n_chunks; ++c)
    for (int64_t h = 0; h < n_kv_heads; ++h)
      for (int64_t t = 0; t < pad[c]; t += kPackKeys) pieces.push_back({c, h, t});
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [c, h, t] = pieces[i];
      T* kp = scratch + base[c] + h * pad[c] * head_dim * 2;
      pack_kv<S, T>(k_pool, v_pool, tables + c * table_width, block_size, kv_row, h * head_dim,
                 head_dim, first[c], info[3 * c + 2], t, std::min(pad[c], t + kPackKeys), kp,
                 kp + pad[c] * head_dim);
    }
  });

  // Units, largest first, taken dynamically: the causal cost grows along a chunk, and a static
  // split of an ordered list would leave one thread the long tail.
  const int64_t per_unit = std::max<int64_t>(1, kUnitRows / group);
  std::vector<Unit> units;
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t n = info[3 * c + 1] - info[3 * c], offset = info[3 * c + 2] - n;
    for (int64_t q0 = 0; q0 < n; q0 += per_unit) {
      const int64_t q1 = std::min(n, q0 + per_unit);
      // The unit's last row sees these (past a shared prompt's), its first row fewer.
      int64_t keys = offset + q1 - prompt_keys[c];
      if (window) keys = std::min(keys, window + q1 - q0);
      for (int64_t h = 0; h < n_kv_heads; ++h)
        units.push_back({c, h, q0, q1, (q1 - q0) * (keys + 8)});
    }
  }
  std::stable_sort(units.begin(), units.end(),
                   [](const Unit& a, const Unit& b) { return a.cost > b.cost; });
  // Score / probability row width: any group's keys fit, plus one vector of slack for the
  // softmax's whole-vector stores from a row's (unaligned) first visible key.
  const int64_t span = (max_pad + 2 * kTile - 1) / (2 * kTile) * (2 * kTile) + kTile;
  std::atomic<int64_t> next{0};
  const int64_t n_units = static_cast<int64_t>(units.size());
  const int threads = at::get_num_threads();
  const int group_rows = amx ? kMaxGroupRows : kGroupRows;
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scores(kMaxGroupRows * span);
    std::vector<T> probs(kMaxGroupRows * span);
    float inv[kMaxGroupRows];
    const T* qrows[kMaxGroupRows];
    T* orows[kMaxGroupRows];
    // Widened q rows and float32 output rows of a group, when S is not T.
    std::vector<T> qwide(widen ? kMaxGroupRows * head_dim : 0), owide(qwide.size());
    S* out_rows[kMaxGroupRows];
    // Row r sees packed keys [lo[r], hi[r]); at[r]: its (token row, query head).
    int64_t lo[kMaxGroupRows], hi[kMaxGroupRows], at[kMaxGroupRows];
    // AMX: the group's q rows as one block (zero past its rows), a tile's float32 outputs.
    std::vector<T> q_block(amx ? kMaxGroupRows * head_dim : 0);
    std::vector<float> o_tile(amx ? kTile * head_dim : 0);
#if defined(FERRUM_AMX)
    if (amx) load_attention_tiles();
#endif
    for (int64_t i = next++; i < n_units; i = next++) {
      const Unit& unit = units[i];
      const int64_t c = unit.chunk, h = unit.head;
      const int64_t start = info[3 * c], n = info[3 * c + 1] - start;
      const int64_t offset = info[3 * c + 2] - n;  // absolute position of the chunk's query 0
      const T* kp = scratch + base[c] + h * pad[c] * head_dim * 2;
      const T* vp = kp + pad[c] * head_dim;
      const int64_t rows = (unit.q1 - unit.q0) * group;  // row r: position q0 + r / G, head r % G
      for (int64_t r0 = 0; r0 < rows; r0 += group_rows) {
        const int nr = static_cast<int>(std::min<int64_t>(group_rows, rows - r0));
        for (int r = 0; r < nr; ++r) {
          const int64_t pos = unit.q0 + (r0 + r) / group, head = h * group + (r0 + r) % group;
          const S* q_row = q + (start + pos) * q_stride + head * head_dim;
          out_rows[r] = out + (start + pos) * out_stride + head * head_dim;
          if constexpr (widen) {
            T* wide = qwide.data() + r * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) wide[d] = ferrum::bf16_to_float(q_row[d]);
            qrows[r] = wide;
            orows[r] = owide.data() + r * head_dim;
          } else {
            qrows[r] = q_row;
            orows[r] = out_rows[r];
          }
          const int64_t p = offset + pos;  // keys (p - window, p] are visible, or [0, p]
          // (A chunk continuing a shared prompt sees its own packed keys from there, first[c].)
          lo[r] = (window ? std::max<int64_t>(0, p - window + 1) : first[c]) - first[c];
          hi[r] = p + 1 - first[c];
          at[r] = (start + pos) * heads + head;
        }
        // Rows go by position, so a block's first row sees the earliest keys and its last row
        // the latest; each block goes from the tile holding the first to the last. Scores and
        // probabilities of the group are indexed from g0, its first row's first tile.
        const int64_t g0 = lo[0] / kTile * kTile;
        // AMX's blocks are 16 rows (a tile), the register blocks' kQkRows.
        const int qk_rows = amx ? kAmxTileRows : kQkRows;
        if (amx) {  // q rows into one block: tiles load rows a fixed stride apart
          const int padded = (nr + kAmxTileRows - 1) / kAmxTileRows * kAmxTileRows;
          for (int r = 0; r < padded; ++r) {
            T* dst = q_block.data() + r * head_dim;
            if (r < nr) {
              std::memcpy(dst, qrows[r], head_dim * sizeof(T));
            } else {
              std::memset(dst, 0, head_dim * sizeof(T));
            }
          }
        }
        for (int b = 0; b < nr; b += qk_rows) {
          const int m = std::min(qk_rows, nr - b);
          const int64_t t0 = lo[b] / kTile, t1 = (hi[b + m - 1] + kTile - 1) / kTile;
          float* s = scores.data() + b * span + t0 * kTile - g0;
#if defined(FERRUM_AMX)
          if constexpr (kBf16) {
            if (amx) {  // (rows past nr get scores too: the buffers hold kMaxGroupRows)
              amx_scores(q_block.data() + b * head_dim, head_dim, kp + t0 * tile_elems,
                         tile_elems, t1 - t0, s, span);
              continue;
            }
          }
#endif
          by_rows<T, QK, kQkRows>(m, qrows + b, kp + t0 * tile_elems, tile_elems, head_dim / w,
                                  t1 - t0, s, span);
        }
        // Probabilities up to a whole word past what the PV blocks read (zeros where a row
        // cannot see): they consume them a word (w keys) at a time; AMX's, 16 keys at a time.
        const int64_t multiple = amx ? kTile : w;
        const int64_t end = (hi[nr - 1] - g0 + multiple - 1) / multiple * multiple;
        for (int r = 0; r < nr; ++r) {
          const int64_t a = lo[r] - g0;  // keys before a row's window: zero probabilities
          T* p = probs.data() + r * span;
          for (int64_t j = 0; j < a; ++j) p[j] = T(0);
          inv[r] = softmax_row<T>(scores.data() + r * span + a, p + a, hi[r] - g0 - a, end - a,
                                  scale);
        }
#if defined(FERRUM_AMX)
        if constexpr (kBf16) {
          if (amx) {
            for (int b = 0; b < nr; b += kAmxTileRows) {
              const int m = std::min(kAmxTileRows, nr - b);
              // From the tile holding the block's first visible key to its last row's end.
              const int64_t k0 = (lo[b] - g0) / kTile * kTile;
              const int64_t k1 = (hi[b + m - 1] - g0 + kTile - 1) / kTile * kTile;
              amx_values(probs.data() + b * span + k0, span, vp + (g0 + k0) * head_dim,
                         head_dim, k1 - k0, o_tile.data());
              for (int r = 0; r < m; ++r) {
                const float* o = o_tile.data() + r * head_dim;
                if (prompt_keys[c] > 0) {  // merged with the shared prompt's partial softmax
                  const int64_t a = lo[b + r] - g0, id = at[b + r];
                  const float own = ferrum::row_max(scores.data() + (b + r) * span + a,
                                                    hi[b + r] - g0 - a) * scale;
                  const ferrum::SoftmaxMerge w =
                      ferrum::merge_softmax(own, 1.f / inv[b + r], partials.max[id],
                                            partials.sum[id]);
                  const __m512 own_w = _mm512_set1_ps(w.a1 * w.norm);
                  const __m512 shared_w = _mm512_set1_ps(w.a2 * w.norm);
                  const float* po = partials.out.get() + id * head_dim;
                  for (int64_t d = 0; d < head_dim; d += kTile)
                    store16(orows[b + r] + d,
                            _mm512_fmadd_ps(_mm512_loadu_ps(o + d), own_w,
                                            _mm512_mul_ps(_mm512_loadu_ps(po + d), shared_w)));
                  continue;
                }
                const __m512 scale_r = _mm512_set1_ps(inv[b + r]);
                for (int64_t d = 0; d < head_dim; d += kTile)
                  store16(orows[b + r] + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), scale_r));
              }
            }
            continue;
          }
        }
#endif
        for (int b = 0; b < nr; b += kPvRows) {
          const int m = std::min(kPvRows, nr - b);
          const int64_t w0 = (lo[b] - g0) / w, w1 = (hi[b + m - 1] - g0 + w - 1) / w;
          by_rows<T, PV, kPvRows>(m, probs.data() + b * span + w0 * w, span,
                                  vp + (g0 + w0 * w) * head_dim, head_dim, w1 - w0, inv + b,
                                  orows + b);
        }
        if constexpr (widen)
          for (int r = 0; r < nr; ++r)
            for (int64_t d = 0; d < head_dim; ++d)
              out_rows[r][d] = ferrum::float_to_bf16(orows[r][d]);
      }
    }
#if defined(FERRUM_AMX)
    if (amx) _tile_release();
#endif
  });
}

// Elements of packed K/V scratch needed: sum over chunks of packed_keys * Hkv * D * 2.
int64_t scratch_numel(const torch::Tensor& chunks, int64_t n_kv_heads, int64_t head_dim,
                      int64_t window) {
  const int64_t* info = chunks.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t c = 0; c < chunks.size(0); ++c) {
    const int64_t n = info[3 * c + 1] - info[3 * c], ctx = info[3 * c + 2];
    total += packed_keys(ctx, first_packed(ctx, n, window)) * head_dim * 2 * n_kv_heads;
  }
  return total;
}

}  // namespace

// Whether the kernel runs vectorised for this dtype on the CPU it was built for (AVX-512; on
// AVX2 with FMA, float32, and bfloat16 widened to float32); the portable loops it falls back
// to elsewhere are slower than the torch path's BLAS calls.
bool prefill_attention_vectorized(bool bfloat16) {
  return bfloat16 ? has_simd<uint16_t>() || has_simd<float>() : has_simd<float>();
}

// Causal attention of C prefill chunks, written into out's chunk rows in place.
// q, out [T, H, D] (row strides may exceed H*D); pools [NB * BS * Hkv * D] contiguous holding
// every chunk's keys (this step's included); chunks [C, 3] int64 rows (start, end, ctx): query
// rows [start, end) are the last end - start of ctx positions; tables [C, W] int64; window: 0
// for global attention, else a query at p sees keys in (p - window, p]; scratch in q's dtype,
// at least sum over chunks of K * Hkv * D * 2 elements, K = ceil(ctx / 16) * 16 keys when
// global, else the keys from the chunk's first query's window start (rounded down to a
// multiple of 16) to ctx, rounded up to a multiple of 16.
void prefill_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                       torch::Tensor out, torch::Tensor chunks, torch::Tensor tables,
                       torch::Tensor scratch, int64_t block_size, int64_t n_kv_heads,
                       double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q layout");
  TORCH_CHECK(out.dim() == 3 && out.sizes() == q.sizes() && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "out layout");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pool must be contiguous");
  TORCH_CHECK(scratch.is_contiguous(), "scratch must be contiguous");
  TORCH_CHECK(chunks.dim() == 2 && chunks.size(1) == 3 && chunks.is_contiguous() &&
                  chunks.scalar_type() == torch::kLong,
              "chunks must be contiguous [C, 3] int64");
  TORCH_CHECK(tables.dim() == 2 && tables.is_contiguous() && tables.scalar_type() == torch::kLong,
              "tables must be contiguous [C, W] int64");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k_pool.scalar_type() == dtype && v_pool.scalar_type() == dtype &&
                  out.scalar_type() == dtype && scratch.scalar_type() == dtype,
              "pool, out and scratch dtype must match q");
  const int64_t n_tokens = q.size(0), n_heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(head_dim % kTile == 0, "head_dim must be a multiple of 16");
  const int64_t n_chunks = chunks.size(0), width = tables.size(1);
  TORCH_CHECK(tables.size(0) == n_chunks, "one table row per chunk");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0 = global)");
  const int64_t n_blocks = k_pool.numel() / (block_size * n_kv_heads * head_dim);
  const int64_t* info = chunks.data_ptr<int64_t>();
  const int64_t* table = tables.data_ptr<int64_t>();
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t start = info[3 * c], end = info[3 * c + 1], ctx = info[3 * c + 2];
    TORCH_CHECK(0 <= start && start < end && end <= n_tokens && ctx >= end - start,
                "chunk ", c, " out of range");
    const int64_t used = (ctx + block_size - 1) / block_size;
    TORCH_CHECK(used <= width, "chunk ", c, ": table too narrow for its context");
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(0 <= table[c * width + b] && table[c * width + b] < n_blocks,
                  "chunk ", c, ": block id out of range");
  }
  // After the chunks are known to be in range: their sizes give the scratch's.
  TORCH_CHECK(scratch.numel() >= scratch_numel(chunks, n_kv_heads, head_dim, window),
              "scratch too small");
  if (n_chunks == 0) return;
  const int64_t group = n_heads / n_kv_heads;
  if (dtype == torch::kFloat) {
    prefill_impl<float, float>(q.data_ptr<float>(), q.stride(0), k_pool.data_ptr<float>(),
                        v_pool.data_ptr<float>(), out.data_ptr<float>(), out.stride(0), info,
                        table, n_chunks, width, block_size, n_kv_heads, group, head_dim,
                        static_cast<float>(scale), window, scratch.data_ptr<float>());
  } else if (dtype == torch::kBFloat16) {
    auto bits = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    if (!has_simd<uint16_t>() && has_simd<float>()) {
      // No bfloat16 SIMD loops here (AVX2): the float32 ones, on keys and values widened into
      // a float32 scratch of the same element count.
      auto wide = torch::empty({scratch_numel(chunks, n_kv_heads, head_dim, window)},
                               torch::dtype(torch::kFloat));
      prefill_impl<uint16_t, float>(bits(q), q.stride(0), bits(k_pool), bits(v_pool), bits(out),
                                    out.stride(0), info, table, n_chunks, width, block_size,
                                    n_kv_heads, group, head_dim, static_cast<float>(scale),
                                    window, wide.data_ptr<float>());
    } else {
      prefill_impl<uint16_t, uint16_t>(bits(q), q.stride(0), bits(k_pool), bits(v_pool),
                                       bits(out), out.stride(0), info, table, n_chunks, width,
                                       block_size, n_kv_heads, group, head_dim,
                                       static_cast<float>(scale), window, bits(scratch));
    }
  } else {
    TORCH_CHECK(false, "unsupported dtype");
  }
}
