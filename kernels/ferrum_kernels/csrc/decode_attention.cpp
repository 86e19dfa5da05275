// Decode attention over the paged KV pool for the CPU path (see cpu_decode.py for why).
//
// Two passes over each item's history: scores, then the probability-weighted sum of V. Scores and
// softmax are float32 whatever the pool dtype. With AVX-512 (decode_items_avx512) a work unit is
// a whole item, read token row by token row across all KV heads; the portable fallback
// (decode_impl) works per (item, KV head), scoring the G query heads that share a KV head
// together so each K/V row is converted to float32 once for all of them.
//
// Items that share a cached prompt's blocks (prefix caching: shared_prefixes) have the shared
// keys' part of their softmax computed for all of them at once (ferrum::prompt_partials: in
// bfloat16 on AMX tiles, or vdpbf16ps register tiles on a CPU without AMX; in float32 on
// register tiles with FMAs); each then reads only its own keys and merges the two
// (decode_items_avx512).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <c10/util/BFloat16.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Prefetch one token's row of one head (D elements) into the cache.
template <typename T>
inline void prefetch_rows(const T* pool, int64_t slot, int64_t kv_row, int64_t offset,
                          int64_t d) {
  const char* p = reinterpret_cast<const char*>(pool + slot * kv_row + offset);
  for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

// Blocks ahead of the current token that the K pass prefetches (measured: 3 beat 2, 4 and 6).
constexpr int64_t kPrefetchBlocks = 3;
// Tokens of an item's history fetched during the V pass of the item before it, so a new item
// does not start on demand misses. 48 covers the K pass's first kPrefetchBlocks blocks of 16.
// The AVX-512 path fetches ten blocks. On a Zen 4 its time over memory did not move with the
// machine's read rate, so something per core bounds it, most likely the fetches a core keeps
// in flight, and the V pass left those idle after 48 rows. There (twelve pools at
// W1's decode shapes, decode_attention_bench.py) bfloat16 0.886 -> 0.851 ms a layer with blocks
// in order, 0.895 -> 0.873 shuffled, 1.397 -> 1.318 at 448 tokens; float32 1.649 -> 1.552 and
// 1.707 -> 1.664; served w1-long bfloat16's decode forwards 48.4 -> 47.1 ms (four pairs). A Zen 5
// measured 96 and 160 level with 48 (docs/benchmarks.md). The AVX2 path, unmeasured, keeps 48.
// On an Intel Xeon with AMX the AVX-512 path fetches 48 as well (next_item_tokens_512): there
// the V pass reads its rows from L2, and the next item's fetches from memory held the core's
// line-fill buffers that those reads need. Its V pass took 30% of the kernel's time with 160
// against 22% with 48, and the kernel 1.551 against 1.448 ms a layer (twelve pools, 400 tokens,
// blocks shuffled); 0.932 -> 0.858 at 256 tokens, float32 1.728 -> 1.621 (fifty-fourth
// session, docs/benchmarks.md). Bit-identical: only the prefetches move.
constexpr int64_t kNextItemTokensShort = 48;
#if defined(__AVX512F__)
constexpr int64_t kNextItemTokens = 160;  // the most: RowFetches holds this many rows
#else
constexpr int64_t kNextItemTokens = kNextItemTokensShort;
#endif

// One item's token rows t0 .. t0 + n - 1 of pool (every KV head: a row is contiguous in the
// pool) into tile. The token's block and offset advance with it: one division per tile, not
// three per token (a 64-bit divide by a runtime block size costs more than its row's dots).
template <typename T>
inline void tile_rows(const T** tile, const T* pool, const int64_t* table, int64_t t0, int64_t n,
                      int64_t block_size, int64_t kv_row) {
  int64_t block = t0 / block_size, offset = t0 - block * block_size;
  for (int64_t j = 0; j < n; ++j) {
    tile[j] = pool + (table[block] * block_size + offset) * kv_row;
    if (++offset == block_size) {
      offset = 0;
      ++block;
    }
  }
}

// Dot products between two steps of the K pass's RowFetches: stepping before every one costs
// a sixth of the kernel's arithmetic when the rows are in cache already (a shared prompt's
// blocks), and four keep each burst to a handful of lines (measured at W1's shapes on a Zen 4,
// twenty-second session: every 4th or 8th as fast over memory as every one, 2-10% faster over
// cached blocks).
constexpr int64_t kDotsPerStep = 4;
// The same for the AVX-512 path's head-by-head K pass (float32), chosen per CPU because what
// the pacing keeps even is time between steps, and a dot product's time differs. Its tiles are
// 16 rows, and each fetches 32 rows (this tile's V, the K rows three blocks ahead): 512 lines at
// W1's shapes (rows of 1 KB), so a step every 4th dot product issued about eleven prefetches at
// once, and every 2nd about five. On a Zen 5 core (full-width 512-bit arithmetic) every 2nd was
// faster (decode_attention_bench.py shapes, twelve pools from memory at 84-95 GB/s: 0.748 ->
// 0.691 ms a layer with blocks in order, 1.023 -> 1.001 shuffled; cached blocks tied); on a
// Zen 4 core, which runs each 512-bit operation as two 256-bit halves so a dot product takes
// about twice as long, every 4th was (1.188 against 1.235 in order at 30-46 GB/s, 1.521
// against 1.562 shuffled). Bit-identical either way: only the prefetches move.
// AMD family 0x19 with AVX-512 is Zen 4; anything else gets the full-width figure.
#if defined(__AVX512F__)
// The CPU's AMD family (0x19: Zen 3 and 4, 0x1A: Zen 5), or 0 where it is not AMD's.
unsigned amd_family() {
  static const unsigned value = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return 0u;
    const bool amd = ebx == 0x68747541 && edx == 0x69746e65 && ecx == 0x444d4163;  // AuthenticAMD
    if (!amd || __get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return 0u;
    const unsigned base = (eax >> 8) & 0xF;
    return base == 0xF ? base + ((eax >> 20) & 0xFF) : base;
  }();
  return value;
}

int64_t dots_per_step_512() { return amd_family() == 0x19 ? 4 : 2; }

// The next item's tokens the AVX-512 path fetches during a V pass (kNextItemTokens above): the
// full 160 on AMD's cores, where it was measured faster (Zen 4) or level (Zen 5), and 48
// elsewhere (measured on an Intel Xeon with AMX).
int64_t next_item_tokens_512() {
  return amd_family() != 0 ? kNextItemTokens : kNextItemTokensShort;
}
#endif

// Token rows to pull into L2 while a stretch of arithmetic runs, a few lines per step, the
// steps spread over that arithmetic. Blocks sit anywhere in the pool and the hardware
// prefetchers stop at block edges, so the kernels fetch ahead themselves. Issued in bursts (a
// tile's few hundred lines at its start, or even a head's twenty), the prefetches fill the
// core's miss buffers and it stalls instead of computing; paced, the reads overlap the
// arithmetic (docs/cpu-kernels.md: about a fifth faster over scattered blocks). Into L2 rather
// than L1: L2 keeps far more misses in flight, which a walk over scattered blocks needs.
class RowFetches {
 public:
  // The most rows queued at once: claim_next's next item, or a K tile's V rows and the rows
  // ahead (32 at most).
  static constexpr int64_t kMaxRows = kNextItemTokens > 64 ? kNextItemTokens : 64;

  // row_bytes: the bytes of one token row (every KV head).
  explicit RowFetches(int64_t row_bytes) : row_lines_((row_bytes + 63) / 64) {}

  void clear() { n_rows_ = row_ = line_ = credit_ = 0; }
  void add(const void* row) {
    if (n_rows_ < kMaxRows) rows_[n_rows_++] = static_cast<const char*>(row);
  }
  // The rows added so far are fetched over the next `steps` calls of step(), evenly.
  void pace(int64_t steps) {
    steps_ = std::max<int64_t>(steps, 1);
    lines_ = n_rows_ * row_lines_;
    credit_ = 0;
  }
  void step() {
    credit_ += lines_;
    while (credit_ >= steps_) {
      credit_ -= steps_;
      if (row_ == n_rows_) return;
      __builtin_prefetch(rows_[row_] + 64 * line_, 0, 2);
      if (++line_ == row_lines_) {
        line_ = 0;
        ++row_;
      }
    }
  }

 private:
  const char* rows_[kMaxRows];
  int64_t n_rows_ = 0, row_ = 0, line_ = 0;
  int64_t row_lines_, lines_ = 0, steps_ = 1, credit_ = 0;
};

// Tokens at the start of an item whose blocks the item before it also reads (whole blocks):
// a shared prompt's cached blocks under prefix caching. The threads read those rows item after
// item, so they sit in cache, and fetching them ahead is pure cost (w2-prefix's decode steps ran
// 2-6% slower with it). Items are claimed in order, so the item before is the latest read.
inline int64_t shared_tokens(const int64_t* tables, const int64_t* lens, int64_t item,
                             int64_t table_width, int64_t block_size) {
  if (item == 0) return 0;
  const int64_t* table = tables + item * table_width;
  const int64_t* before = table - table_width;
  const int64_t blocks = std::min(lens[item], lens[item - 1]) / block_size;
  int64_t b = 0;
  while (b < blocks && table[b] == before[b]) ++b;
  return b * block_size;
}

// A K-pass tile: its K rows into tile, and what it fetches while it computes into fetches: the
// K rows kPrefetchBlocks blocks ahead, and this tile's V rows, so the V pass that follows
// mostly reads L2; neither for the item's first `shared` tokens (shared_tokens). One walk over
// the block table for both.
template <typename T>
inline void k_tile(const T** tile, RowFetches& fetches, const T* k_pool, const T* v_pool,
                   const int64_t* table, int64_t t0, int64_t n, int64_t ctx, int64_t shared,
                   int64_t block_size, int64_t kv_row) {
  fetches.clear();
  int64_t block = t0 / block_size, offset = t0 - block * block_size;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t slot = table[block] * block_size + offset;
    tile[j] = k_pool + slot * kv_row;
    if (t0 + j >= shared) fetches.add(v_pool + slot * kv_row);
    const int64_t ahead = t0 + j + kPrefetchBlocks * block_size;
    if (ahead < ctx && ahead >= shared)
      fetches.add(k_pool + (table[block + kPrefetchBlocks] * block_size + offset) * kv_row);
    if (++offset == block_size) {
      offset = 0;
      ++block;
    }
  }
}

// Claims the calling thread's next item (n_items or more when none is left) and queues its
// first K rows (`tokens` of them, at most kNextItemTokens, from starts[item], or 0 without
// starts) in next_rows, to be fetched during the current item's V pass (none of them when they
// are shared with the item before it: shared_tokens).
template <typename T>
inline int64_t claim_next(std::atomic<int64_t>& claimed, RowFetches& next_rows, const T* k_pool,
                          const int64_t* tables, const int64_t* lens, const int64_t* starts,
                          int64_t n_items, int64_t table_width, int64_t block_size,
                          int64_t kv_row, int64_t tokens) {
  const int64_t next = claimed.fetch_add(1, std::memory_order_relaxed);
  next_rows.clear();
  if (next >= n_items) return next;
  const int64_t* table = tables + next * table_width;
  const int64_t first = starts != nullptr ? starts[next] : 0;
  const int64_t n = std::min(lens[next], first + std::min(tokens, kNextItemTokens));
  for (int64_t t = std::max(first, shared_tokens(tables, lens, next, table_width, block_size));
       t < n; ++t)
    next_rows.add(k_pool + (table[t / block_size] * block_size + t % block_size) * kv_row);
  return next;
}

// Items of a decode step that read the same cached prompt (ferrum::shared_runs): the blocks
// before each item's last key count (an item's last block is its own, and its last key the one
// just written). The per-item kernel reads those keys once per item, at its per-row cost even
// from L2: in w2-prefix (64 items sharing 1,024 of about 1,150 keys) the decode attention was
// about two thirds of a step. The shared keys' part of every such item's softmax is computed
// for all their query heads at once (ferrum::prompt_partials; on AMX as the prefill kernel does
// for chunks continuing a shared prompt), and each item then reads only its own keys. On a Zen 5
// (twelve pools, 64 items sharing 1,024 of 1,100 keys) that took a layer from 0.97 to 0.57 ms
// in bfloat16 and from 2.03 to 1.27 in float32 (docs/benchmarks.md, forty-seventh session).
std::vector<ferrum::SharedRun> shared_prefixes(const int64_t* tables, const int64_t* lens,
                                               int64_t n_items, int64_t table_width,
                                               int64_t block_size) {
  return ferrum::shared_runs(tables, n_items, table_width, block_size, [&](int64_t i) {
    return std::max<int64_t>(lens[i] - 1, 0) / block_size;
  });
}

#if defined(__AVX512F__)
// Sixteen 16-lane vectors -> one vector whose lane j is the sum of v[j]'s lanes. Four halving
// stages (512 -> 256 -> 128 -> 64 -> 32 bits per input), 45 shuffles and adds for 16 dot
// products instead of 16 separate horizontal reductions.
inline __m512 reduce16(__m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) {
    // [a0 a1 b0 b1] + [a2 a3 b2 b3] (128-bit quarters): each input folded to 8 lanes.
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    // Quarters [a b a b] and [c d c d] -> [a b c d] + [a' b' c' d']: 4 lanes per input.
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    // Within each quarter: 2 lanes per input.
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  }
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88),
                                 _mm512_shuffle_ps(y[0], y[1], 0xDD));
  // Lane order after the stages is quarter-major; put input j back in lane j.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// One key row against one query row: a 16-lane vector of partial sums (reduced by reduce16).
template <int D>
inline __m512 partial_dot(const float* q, const float* k) {
  static_assert(D % 16 == 0, "float32 rows are read 16 lanes at a time");
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
  for (int d = 16; d < D; d += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
  return acc;
}

template <int D>
inline __m512 partial_dot(const c10::BFloat16* q, const c10::BFloat16* k) {
  __m512 acc = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 32) {
    // Pairs of bfloat16 products summed exactly into float32 lanes; a short tail is masked.
    const __mmask32 m = D - d >= 32 ? ~__mmask32(0) : (__mmask32(1) << (D - d)) - 1;
#if defined(__AVX512BF16__)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, q + d),
                           (__m512bh)_mm512_maskz_loadu_epi16(m, k + d));
#else
    const __m512i qi = _mm512_maskz_loadu_epi16(m, q + d), ki = _mm512_maskz_loadu_epi16(m, k + d);
    // Even and odd halves widened to float32, then two FMAs.
    acc = _mm512_fmadd_ps(ferrum::bf16_odds(qi), ferrum::bf16_odds(ki),
                          _mm512_fmadd_ps(ferrum::bf16_evens(qi), ferrum::bf16_evens(ki), acc));
#endif
  }
  return acc;
}

// How k_slice_dots takes a head's query: D bfloat16 values, with vdpbf16ps; without it
// (kSplitQuery), D / 16 float32 vectors, the row split once per item (split_query).
#if defined(__AVX512BF16__)
using QueryOf = c10::BFloat16;
template <int D>
constexpr int64_t kQueryStride = D;
constexpr bool kSplitQuery = false;
#else
using QueryOf = __m512;
template <int D>
constexpr int64_t kQueryStride = D / 16;
constexpr bool kSplitQuery = true;

// A query row [heads, D] split into each 32 elements' even and odd ones in float32: [heads][D /
// 32][2] vectors, for k_slice_dots without vdpbf16ps.
template <int D>
inline void split_query(const c10::BFloat16* q, int64_t heads, __m512* split) {
  for (int64_t i = 0; i < heads * D / 32; ++i) {
    const __m512i v = _mm512_loadu_si512(q + 32 * i);
    split[2 * i] = ferrum::bf16_evens(v);
    split[2 * i + 1] = ferrum::bf16_odds(v);
  }
}
#endif

// One bfloat16 K slice (D elements of one KV head of one token row) against the G query heads
// that share it (rows kQueryStride apart): out[g * 16] = the 16-lane partial sums of dot(q_g,
// k), formed exactly as partial_dot forms them. The slice is loaded once for the G heads, and
// with G a compile-time constant the query rows' loads fold into the dot instructions.
// partial_dot per head reloaded the slice G times. At a W1 decode step's shapes the kernel took
// 15% less time with the pool in cache and up to 9% less over memory, and served W1 decode
// steps' forwards 8% less (docs/benchmarks.md, thirty-fifth session). Without vdpbf16ps (an
// AVX-512 CPU without AVX512_BF16) the dot products are emulated: the slice is split once for
// the G heads into its even and odd elements in float32, as the query rows were (split_query),
// so each head's 32 elements take two FMAs; partial_dot's emulated loop split both again for
// every head (fifty-second session).
template <int D, int G>
inline void k_slice_dots(const QueryOf* q, const c10::BFloat16* k, int64_t group, __m512* out) {
  static_assert(D % 32 == 0, "whole 32-element pairs of a bfloat16 slice");
  constexpr int C = D / 32;
#if defined(__AVX512BF16__)
  __m512i kv[C];
  for (int c = 0; c < C; ++c) kv[c] = _mm512_loadu_si512(k + 32 * c);
#else
  __m512 even[C], odd[C];
  for (int c = 0; c < C; ++c) {
    const __m512i kv = _mm512_loadu_si512(k + 32 * c);
    even[c] = ferrum::bf16_evens(kv);
    odd[c] = ferrum::bf16_odds(kv);
  }
#endif
  const int64_t heads = G > 0 ? G : group;  // G = 0: the group known only at run time
#pragma GCC unroll 16
  for (int64_t g = 0; g < heads; ++g) {
    const QueryOf* qg = q + g * kQueryStride<D>;
    __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
#if defined(__AVX512BF16__)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qg + 32 * c), (__m512bh)kv[c]);
#else
      acc = _mm512_fmadd_ps(qg[2 * c + 1], odd[c], _mm512_fmadd_ps(qg[2 * c], even[c], acc));
#endif
    }
    out[g * 16] = acc;
  }
}

// A K tile's dot products into out[hq * 16 + j] (hq = kv * group + g), slice by slice, a fetch
// step before each slice; G = group, or 0 for a group known only at run time.
template <int D, int G>
inline void k_tile_dots(const QueryOf* q, const c10::BFloat16* const* tile, int64_t n,
                        int64_t n_kv_heads, int64_t group, RowFetches& ahead, __m512* out) {
  for (int64_t j = 0; j < n; ++j) {
    const c10::BFloat16* kr = tile[j];
    for (int64_t kv = 0; kv < n_kv_heads; ++kv, kr += D) {
      ahead.step();
      const int64_t heads = G > 0 ? G : group;
      k_slice_dots<D, G>(q + kv * heads * kQueryStride<D>, kr, group, out + kv * heads * 16 + j);
    }
  }
}

// Sixteen float32 values of a row starting at p (a bfloat16 row is widened): common.h's, and
// the same for c10's bfloat16 type.
using ferrum::load16;
inline __m512 load16(const c10::BFloat16* p) {
  return load16(reinterpret_cast<const uint16_t*>(p));
}


// bfloat16 V with vdpbf16ps: two tokens per instruction, V rows used as stored (no widening).
// Rows j and j+1 are interleaved 16 bits at a time within each 128-bit quarter, so accumulator
// lanes hold the head dims in a permuted order (paired_lane), undone once at the output.
#if defined(__AVX512BF16__)
template <typename T, int D>
constexpr bool kPairedV = std::is_same<T, c10::BFloat16>::value && D % 32 == 0;
#else
template <typename T, int D>
constexpr bool kPairedV = false;
#endif

// Whether a tile's dot products take k_tile_dots: bfloat16 in whole 32-element pairs (with
// vdpbf16ps, or emulated). float32 keeps partial_dot's loop, which read memory 4% faster there.
template <typename T, int D>
constexpr bool kSliceDots = std::is_same<T, c10::BFloat16>::value && D % 32 == 0;

// Where dim d lives in a paired accumulator: per 32 dims, the "low" vector holds dims
// 8q..8q+3 of each quarter q in lanes 4q..4q+3, the "high" vector dims 8q+4..8q+7.
template <typename T, int D>
constexpr int paired_lane(int d) {
  if constexpr (!kPairedV<T, D>) {
    return d;
  } else {
    const int block = d / 32, r = d % 32, quarter = r / 8, within = r % 8;
    return block * 32 + (within < 4 ? 0 : 16) + quarter * 4 + within % 4;
  }
}

// The V pass takes the query heads of one KV head together, up to kVHeads at once: each V row
// is loaded (and, in bfloat16, interleaved) once for all of them, and their accumulators are
// independent chains. One head at a time, the pass waited on its own few accumulators (an FMA
// or dot product's latency per token) and redid the loads for every head of a group.
constexpr int kVHeads = 4;
// Heads per V-pass call for a head dim: their accumulators (D / 16 each) within 16 registers.
template <int D>
constexpr int kVHeadsFor = std::max(1, std::min(kVHeads, 16 / (D / 16)));

#if defined(__AVX512BF16__)
// acc[h] [D] (paired layout) += sum over the tile's n tokens of p[h][j] * V row j (bfloat16) for
// H heads sharing the KV head at offset, p[h] the tile's probabilities of head h as bfloat16
// bits, followed by a 0 after the item's last token.
template <int D, int H>
inline void accumulate_v_pairs(const uint16_t* const* p, const c10::BFloat16* const* tile,
                               int64_t n, int64_t offset, float* const* acc) {
  constexpr int B = D / 32;  // 32-dim blocks, two accumulators each
  __m512 a[H][2 * B];
  for (int h = 0; h < H; ++h)
    for (int k = 0; k < 2 * B; ++k) a[h][k] = _mm512_loadu_ps(acc[h] + 16 * k);
  for (int64_t j = 0; j < n; j += 2) {
    // An odd last token pairs with itself, at the weight 0 that follows it in p.
    const bool odd = j + 1 >= n;
    const c10::BFloat16* r0 = tile[j] + offset;
    const c10::BFloat16* r1 = odd ? r0 : tile[j + 1] + offset;
    __m512bh rows[2 * B];  // tokens j and j + 1 interleaved, as vdpbf16ps pairs them
    for (int b = 0; b < B; ++b) {
      const __m512i x = _mm512_loadu_si512(r0 + 32 * b), y = _mm512_loadu_si512(r1 + 32 * b);
      rows[2 * b] = (__m512bh)_mm512_unpacklo_epi16(x, y);
      rows[2 * b + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
    }
    for (int h = 0; h < H; ++h) {
      uint32_t w;  // p[h][j] | p[h][j + 1] << 16: two tokens' weights, one per 16-bit half
      std::memcpy(&w, p[h] + j, sizeof(w));
      const __m512bh weights = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
      for (int k = 0; k < 2 * B; ++k) a[h][k] = _mm512_dpbf16_ps(a[h][k], rows[k], weights);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int k = 0; k < 2 * B; ++k) _mm512_storeu_ps(acc[h] + 16 * k, a[h][k]);
}
#else
template <int D, int H>
inline void accumulate_v_pairs(const uint16_t* const*, const c10::BFloat16* const*, int64_t,
                               int64_t, float* const*) {}
#endif

// acc[h] [D] += sum over the tile's n tokens of p[h][j] * V row j, for H heads sharing the KV
// head at offset (float32 weights; V float32, or bfloat16 widened).
template <typename T, int D, int H>
inline void accumulate_v(const float* const* p, const T* const* tile, int64_t n, int64_t offset,
                         float* const* acc) {
  constexpr int C = D / 16;
  __m512 a[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) a[h][c] = _mm512_loadu_ps(acc[h] + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(tile[j] + offset + 16 * c);
    for (int h = 0; h < H; ++h) {
      const __m512 w = _mm512_set1_ps(p[h][j]);
      for (int c = 0; c < C; ++c) a[h][c] = _mm512_fmadd_ps(w, v[c], a[h][c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc[h] + 16 * c, a[h][c]);
}

// One V-pass call for H (compile-time) heads: the paired bfloat16 form or the float32 one.
template <typename T, int D, int H>
inline void accumulate_heads(const float* const* p, const uint16_t* const* bits,
                             const T* const* tile, int64_t n, int64_t offset, float* const* acc) {
  if constexpr (kPairedV<T, D>) {
    accumulate_v_pairs<D, H>(bits, tile, n, offset, acc);
  } else {
    accumulate_v<T, D, H>(p, tile, n, offset, acc);
  }
}

// The same for h (1 .. kVHeadsFor<D>) heads known at run time.
template <typename T, int D>
inline void accumulate_heads(int h, const float* const* p, const uint16_t* const* bits,
                             const T* const* tile, int64_t n, int64_t offset, float* const* acc) {
  constexpr int most = kVHeadsFor<D>;
  if (h == 1) accumulate_heads<T, D, 1>(p, bits, tile, n, offset, acc);
  if constexpr (most >= 2) {
    if (h == 2) accumulate_heads<T, D, 2>(p, bits, tile, n, offset, acc);
  }
  if constexpr (most >= 3) {
    if (h == 3) accumulate_heads<T, D, 3>(p, bits, tile, n, offset, acc);
  }
  if constexpr (most >= 4) {
    if (h == 4) accumulate_heads<T, D, 4>(p, bits, tile, n, offset, acc);
  }
}

// Softmax numerators of one head's scores, e^(s - max): in place, or when bits is given, as
// bfloat16 bits there (the paired V pass's weights, rounded once) with s left as it was.
// Returns 1 / their sum (of the float32 values), and the max in max_out. Inline exponentials:
// std::exp vectorises to a glibc call per 16 lanes, and max and sum were two more passes.
inline float softmax16(float* s, int64_t ctx, uint16_t* bits, float* max_out) {
  const __mmask16 tail = ferrum::first_lanes(ctx % 16);
  const int64_t whole = ctx / 16 * 16;
  const float mx = ferrum::row_max(s, ctx);
  *max_out = mx;
  if (bits != nullptr) {
    // e^(s - max) = 2^(s log2e - max log2e), by the degree-4 fit: its 4e-6 against the
    // bfloat16 rounding that follows (4e-3).
    constexpr float kLog2e = 1.44269504f;
    const __m512 a = _mm512_set1_ps(kLog2e), b = _mm512_set1_ps(-mx * kLog2e);
    return 1.f / ferrum::exp2_row<4>(s, bits, ctx, a, b);
  }
  const __m512 top = _mm512_set1_ps(mx);
  // e^-87 is still a normal float, and exp_ps wants t >= -88; what the clamp changes is
  // under 2e-38 of a sum that is at least 1.
  const __m512 floor = _mm512_set1_ps(-87.f);
  __m512 sum = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t < whole; t += 16) {
    const __m512 x = _mm512_loadu_ps(s + t);
    const __m512 e = ferrum::exp_ps(_mm512_max_ps(_mm512_sub_ps(x, top), floor));
    sum = _mm512_add_ps(sum, e);
    _mm512_storeu_ps(s + t, e);
  }
  if (t < ctx) {
    const __m512 x = _mm512_maskz_loadu_ps(tail, s + t);
    const __m512 e = _mm512_maskz_mov_ps(
        tail, ferrum::exp_ps(_mm512_max_ps(_mm512_sub_ps(x, top), floor)));
    sum = _mm512_add_ps(sum, e);
    _mm512_mask_storeu_ps(s + t, tail, e);
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// One work unit is a whole item: its blocks are read front to back, every KV head of a token
// row at once (a row is contiguous in the pool), 16 tokens per tile. The K pass takes a tile's
// rows one at a time, each front to back (every query head's partial sums of a row, then the
// next row), into an L1 array of partial sums; per query head, the tile's 16 dot products then
// come out of one transpose-reduce (reduce16) instead of 16 horizontal sums. Read head by head
// across the tile's rows instead, the kernel took 3-5% longer over a W1 decode step's pool in
// bfloat16 and 13-18% in float32 on a Zen 5 machine (bit-identical: each partial sum is formed
// as before; see docs/benchmarks.md). V is accumulated in registers over the tile, for the query
// heads of a KV head together (accumulate_heads).
//
// With `prefix` (items sharing a prompt's cached blocks: shared_prefixes), an item of a shared
// prefix reads only its keys from prefix.starts[item] on, and its output merges their softmax
// with the shared keys' partial one (prefix.max, sum, out: ferrum::prompt_partials) before it
// is normalised.
template <typename T, int D>
void decode_items_avx512(const T* __restrict q, const T* __restrict k_pool,
                         const T* __restrict v_pool, const int64_t* __restrict tables,
                         const int64_t* __restrict lens, const int64_t* __restrict rows,
                         T* __restrict out, int64_t n_items, int64_t table_width,
                         int64_t block_size, int64_t n_kv_heads, int64_t group,
                         int64_t q_row_stride, float scale,
                         const ferrum::PromptPartials* prefix) {
  const int64_t* starts = prefix != nullptr ? prefix->starts.data() : nullptr;
  static_assert(D % 16 == 0, "rows are read 16 lanes at a time");
  const int64_t kv_row = n_kv_heads * D;
  const int64_t heads = n_kv_heads * group;
  // Items differ in length: hand them out one at a time rather than in equal static halves.
  // A thread claims its next item when it starts one, so it can fetch that item's first rows.
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> scores, acc(heads * D), inv(heads), maxes(heads);
    std::vector<uint16_t> probs;  // bfloat16 V pass: the probabilities as bfloat16 bits
    const T* tile[16];
    std::vector<__m512> parts(heads * 16);  // [H][16]: each query head's partial sums of a tile
    // The emulated k_slice_dots' query rows, split (kSliceDots without vdpbf16ps): [H][D / 16].
    std::vector<__m512> query_split(kSliceDots<T, D> && kSplitQuery ? heads * D / 16 : 0);
    const int64_t row_bytes = kv_row * static_cast<int64_t>(sizeof(T));
    RowFetches ahead(row_bytes), next_rows(row_bytes);
    const int64_t per_step = dots_per_step_512();  // the head-by-head K pass's fetch pacing
    const int64_t next_tokens = next_item_tokens_512();
    int64_t next = 0;
    for (int64_t item = claimed.fetch_add(1, std::memory_order_relaxed); item < n_items;
         item = next) {
      next = claim_next(claimed, next_rows, k_pool, tables, lens, starts, n_items, table_width,
                        block_size, kv_row, next_tokens);
      const int64_t ctx = lens[item];
      const int64_t* table = tables + item * table_width;
      const int64_t shared = shared_tokens(tables, lens, item, table_width, block_size);
      const T* qrow = q + rows[item] * q_row_stride;  // [H, D]
      // Keys [first, ctx): all of them, or those past a shared prefix's.
      const int64_t first = starts != nullptr ? starts[item] : 0, keys = ctx - first;
      scores.resize(heads * keys);                    // [H, keys]
      if constexpr (kPairedV<T, D>) probs.resize(heads * (keys + 1));  // [H, keys + 1]
#if !defined(__AVX512BF16__)
      if constexpr (kSliceDots<T, D>) split_query<D>(qrow, heads, query_split.data());
#endif
      for (int64_t t0 = first; t0 < ctx; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, ctx - t0);
        k_tile(tile, ahead, k_pool, v_pool, table, t0, n, ctx, shared, block_size, kv_row);
        if constexpr (kSliceDots<T, D>) {
          ahead.pace(n * n_kv_heads);
          __m512* out = parts.data();
#if defined(__AVX512BF16__)
          const QueryOf* qs = qrow;
#else
          const QueryOf* qs = query_split.data();
#endif
          switch (group) {  // the common groups unrolled
            case 1: k_tile_dots<D, 1>(qs, tile, n, n_kv_heads, group, ahead, out); break;
            case 2: k_tile_dots<D, 2>(qs, tile, n, n_kv_heads, group, ahead, out); break;
            case 3: k_tile_dots<D, 3>(qs, tile, n, n_kv_heads, group, ahead, out); break;
            case 4: k_tile_dots<D, 4>(qs, tile, n, n_kv_heads, group, ahead, out); break;
            default: k_tile_dots<D, 0>(qs, tile, n, n_kv_heads, group, ahead, out); break;
          }
        } else {
          ahead.pace((n * heads + per_step - 1) / per_step);
          int64_t until_step = 1;  // a step before the first dot product, then every per_step
          for (int64_t j = 0; j < n; ++j) {
            // KV heads, then their query heads: a division per dot product (hq / group) took
            // longer than the dot product.
            const T* kr = tile[j];
            for (int64_t kv = 0, hq = 0; kv < n_kv_heads; ++kv, kr += D) {
              for (int64_t g = 0; g < group; ++g, ++hq) {
                if (--until_step == 0) {
                  ahead.step();
                  until_step = per_step;
                }
                parts[hq * 16 + j] = partial_dot<D>(qrow + hq * D, kr);
              }
            }
          }
        }
        for (int64_t hq = 0; hq < heads; ++hq) {
          __m512* ph = parts.data() + hq * 16;
          for (int64_t j = n; j < 16; ++j) ph[j] = _mm512_setzero_ps();
          const __m512 sc = _mm512_mul_ps(reduce16(ph), _mm512_set1_ps(scale));
          _mm512_mask_storeu_ps(scores.data() + hq * keys + (t0 - first),
                                static_cast<__mmask16>((1u << n) - 1), sc);
        }
      }
      for (int64_t hq = 0; hq < heads; ++hq) {
        float* sh = scores.data() + hq * keys;
        if constexpr (kPairedV<T, D>) {  // the V pass's weights, rounded once
          uint16_t* ph = probs.data() + hq * (keys + 1);
          inv[hq] = softmax16(sh, keys, ph, &maxes[hq]);
          ph[keys] = 0;
        } else {
          inv[hq] = softmax16(sh, keys, nullptr, &maxes[hq]);
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      next_rows.pace((keys + 15) / 16 * heads);  // one step per (tile, head) of the V pass
      constexpr int most = kVHeadsFor<D>;
      for (int64_t t0 = first; t0 < ctx; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, ctx - t0);
        tile_rows(tile, v_pool, table, t0, n, block_size, kv_row);
        for (int64_t hq = 0; hq < heads;) {
          // The next run of query heads on one KV head, kVHeadsFor<D> at most.
          const int64_t kv = hq / group;
          const int h = static_cast<int>(std::min<int64_t>(most, (kv + 1) * group - hq));
          const float* p[kVHeads];
          const uint16_t* bits[kVHeads];
          float* a[kVHeads];
          for (int i = 0; i < h; ++i) {
            next_rows.step();
            p[i] = scores.data() + (hq + i) * keys + (t0 - first);
            bits[i] =
                kPairedV<T, D> ? probs.data() + (hq + i) * (keys + 1) + (t0 - first) : nullptr;
            a[i] = acc.data() + (hq + i) * D;
          }
          accumulate_heads<T, D>(h, p, bits, tile, n, kv * D, a);
          hq += h;
        }
      }
      T* orow = out + item * heads * D;
      if (first > 0) {  // merged with the shared prefix's partial softmax (prompt_partials)
        for (int64_t hq = 0; hq < heads; ++hq) {
          const int64_t at = rows[item] * heads + hq;
          const ferrum::SoftmaxMerge w =
              ferrum::merge_softmax(maxes[hq], 1.f / inv[hq], prefix->max[at], prefix->sum[at]);
          const float* po = prefix->out.get() + at * D;
          for (int d = 0; d < D; ++d)
            orow[hq * D + d] = static_cast<T>(
                (acc[hq * D + paired_lane<T, D>(d)] * w.a1 + po[d] * w.a2) * w.norm);
        }
        continue;
      }
      for (int64_t hq = 0; hq < heads; ++hq)
        for (int d = 0; d < D; ++d)
          orow[hq * D + d] = static_cast<T>(acc[hq * D + paired_lane<T, D>(d)] * inv[hq]);
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The AVX2 path (8-lane vectors), shaped as the AVX-512 one: a work unit is a whole item read
// token row by token row across all KV heads, 8 tokens per tile, the tile's 8 dot products per
// query head out of one transpose-reduce (reduce8), V accumulated per head in an L1-resident
// row, and the softmax's exponentials 8 at a time (exp8). Both passes take a tile's rows one at
// a time, front to back: rows touched in order read fastest, and the development machine
// overlaps little arithmetic with its reads (benchmarks/memory_overlap_bench.py). Measured at
// W1's decode shapes (64 items of about 256 tokens, 12 query / 4 KV heads of 64) on the AVX2
// development machine: see docs/cpu-kernels.md.

// Eight 8-lane vectors -> one vector whose lane j is the sum of v[j]'s lanes.
inline __m256 reduce8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  // u0 = [v0..v3 sums of lanes 0-3 | the same of lanes 4-7], u1 likewise for v4..v7.
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// e^x for x <= 0 (scores minus their row max), 8 lanes: x = n ln2 + r with |r| <= ln2 / 2,
// e^r by Cephes' expf polynomial (about 1e-7 relative), scaled by 2^n through the exponent.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // e^-87 is still a normal float
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline float hmax8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Softmax numerators of one head's scores in place; returns 1 / their sum.
inline float softmax_in_place(float* s, int64_t ctx) {
  const int64_t whole = ctx & ~int64_t(7);
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < whole; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
  float mx = hmax8(mv);
  for (int64_t t = whole; t < ctx; ++t) mx = std::max(mx, s[t]);
  const __m256 m = _mm256_set1_ps(mx);
  __m256 sv = _mm256_setzero_ps();
  for (int64_t t = 0; t < whole; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    _mm256_storeu_ps(s + t, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum8(sv);
  for (int64_t t = whole; t < ctx; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  return 1.f / sum;
}

template <typename T, int D>
void decode_items_avx2(const T* __restrict q, const T* __restrict k_pool,
                       const T* __restrict v_pool, const int64_t* __restrict tables,
                       const int64_t* __restrict lens, const int64_t* __restrict rows,
                       T* __restrict out, int64_t n_items, int64_t table_width,
                       int64_t block_size, int64_t n_kv_heads, int64_t group,
                       int64_t q_row_stride, float scale) {
  static_assert(D % 8 == 0, "rows are read 8 lanes at a time");
  constexpr int C = D / 8;  // 8-lane chunks per head row
  const int64_t kv_row = n_kv_heads * D;
  const int64_t heads = n_kv_heads * group;
  // As the AVX-512 path: items one at a time, each thread claiming its next when it starts one.
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> scores, acc(heads * D), qf(heads * D), inv(heads);
    const T* tile[8];
    std::vector<__m256> part(heads * 8);  // [H][8]: each head's 8 dot products of a tile
    const int64_t row_bytes = kv_row * static_cast<int64_t>(sizeof(T));
    RowFetches ahead(row_bytes), next_rows(row_bytes);
    int64_t next = 0;
    for (int64_t item = claimed.fetch_add(1, std::memory_order_relaxed); item < n_items;
         item = next) {
      next = claim_next(claimed, next_rows, k_pool, tables, lens, nullptr, n_items, table_width,
                        block_size, kv_row, kNextItemTokens);
      const int64_t ctx = lens[item];
      const int64_t* table = tables + item * table_width;
      const int64_t shared = shared_tokens(tables, lens, item, table_width, block_size);
      const T* qrow = q + rows[item] * q_row_stride;  // [H, D]
      for (int64_t i = 0; i < heads * D; ++i) qf[i] = to_float(qrow[i]);
      scores.resize(heads * ctx);  // [H, ctx]
      const __m256 vscale = _mm256_set1_ps(scale);
      for (int64_t t0 = 0; t0 < ctx; t0 += 8) {
        const int64_t n = std::min<int64_t>(8, ctx - t0);
        k_tile(tile, ahead, k_pool, v_pool, table, t0, n, ctx, shared, block_size, kv_row);
        ahead.pace(n * ((heads + kDotsPerStep - 1) / kDotsPerStep));
        // Row by row, each row front to back: a row's cache lines are first touched in order
        // (reading the tile head by head, across its rows, reads memory slower: see
        // memory_overlap_bench's "read by head"). Every dot product is formed as before.
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t hq = 0; hq < heads; ++hq) {
            if (hq % kDotsPerStep == 0) ahead.step();
            const T* kr = tile[j] + (hq / group) * D;
            const float* qh = qf.data() + hq * D;
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qh), load8(kr));
            for (int c = 1; c < C; ++c)
              a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), load8(kr + 8 * c), a);
            part[hq * 8 + j] = a;
          }
        }
        for (int64_t hq = 0; hq < heads; ++hq) {
          for (int64_t j = n; j < 8; ++j) part[hq * 8 + j] = _mm256_setzero_ps();
          const __m256 sc = _mm256_mul_ps(reduce8(part.data() + hq * 8), vscale);
          float* dst = scores.data() + hq * ctx + t0;
          if (n == 8) {
            _mm256_storeu_ps(dst, sc);
          } else {
            alignas(32) float tmp[8];
            _mm256_store_ps(tmp, sc);
            std::copy(tmp, tmp + n, dst);
          }
        }
      }
      for (int64_t hq = 0; hq < heads; ++hq) inv[hq] = softmax_in_place(scores.data() + hq * ctx, ctx);
      std::fill(acc.begin(), acc.end(), 0.f);
      // A step every kDotsPerStep heads of each row of the V pass.
      next_rows.pace(ctx * ((heads + kDotsPerStep - 1) / kDotsPerStep));
      for (int64_t t0 = 0; t0 < ctx; t0 += 8) {
        const int64_t n = std::min<int64_t>(8, ctx - t0);
        tile_rows(tile, v_pool, table, t0, n, block_size, kv_row);
        // Row order, as the K pass; each head's sum still adds the tokens in order.
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t hq = 0; hq < heads; ++hq) {
            if (hq % kDotsPerStep == 0) next_rows.step();
            const T* vr = tile[j] + (hq / group) * D;
            const __m256 p = _mm256_set1_ps(scores[hq * ctx + t0 + j]);
            float* ah = acc.data() + hq * D;
            for (int c = 0; c < C; ++c) {
              const __m256 sum = _mm256_loadu_ps(ah + 8 * c);
              _mm256_storeu_ps(ah + 8 * c, _mm256_fmadd_ps(p, load8(vr + 8 * c), sum));
            }
          }
        }
      }
      T* orow = out + item * heads * D;
      for (int64_t hq = 0; hq < heads; ++hq)
        for (int d = 0; d < D; ++d) orow[hq * D + d] = static_cast<T>(acc[hq * D + d] * inv[hq]);
    }
  }
}
#endif

template <typename T, int D>
void decode_impl(const T* __restrict q, const T* __restrict k_pool, const T* __restrict v_pool,
                 const int64_t* __restrict tables, const int64_t* __restrict lens,
                 const int64_t* __restrict rows, T* __restrict out, int64_t n_items,
                 int64_t table_width, int64_t block_size, int64_t n_kv_heads, int64_t group,
                 int64_t q_row_stride, float scale) {
  const int64_t kv_row = n_kv_heads * D;  // elements between consecutive tokens of a block
  at::parallel_for(0, n_items * n_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * D), acc(group * D), scores, maxes(group), sums(group);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t item = work / n_kv_heads, h = work % n_kv_heads;
      const int64_t ctx = lens[item];
      const int64_t* table = tables + item * table_width;
      const T* qrow = q + rows[item] * q_row_stride + h * group * D;
      for (int64_t i = 0; i < group * D; ++i) qf[i] = to_float(qrow[i]) * scale;
      scores.resize(group * ctx);
      for (int64_t g = 0; g < group; ++g) maxes[g] = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const T* kr = k_pool + slot * kv_row + h * D;
        // Blocks sit anywhere in the pool: fetch this head's rows of the block after next
        // ahead of time (a row a token), since the hardware prefetchers stop at block edges.
        if (t + 2 * block_size < ctx)
          prefetch_rows(k_pool, table[t / block_size + 2] * block_size + t % block_size, kv_row,
                        h * D, D);
        float kf[D];
        for (int d = 0; d < D; ++d) kf[d] = to_float(kr[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
          for (int d = 0; d < D; ++d) s += qg[d] * kf[d];
          scores[g * ctx + t] = s;
          if (s > maxes[g]) maxes[g] = s;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * ctx;
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) {
          sg[t] = std::exp(sg[t] - maxes[g]);
          sum += sg[t];
        }
        sums[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const T* vr = v_pool + slot * kv_row + h * D;
        // Blocks sit anywhere in the pool: fetch this head's rows of the block after next
        // ahead of time (a row a token), since the hardware prefetchers stop at block edges.
        if (t + 2 * block_size < ctx)
          prefetch_rows(v_pool, table[t / block_size + 2] * block_size + t % block_size, kv_row,
                        h * D, D);
        float vf[D];
        for (int d = 0; d < D; ++d) vf[d] = to_float(vr[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * ctx + t];
          float* ag = acc.data() + g * D;
          for (int d = 0; d < D; ++d) ag[d] += p * vf[d];
        }
      }
      T* orow = out + item * (n_kv_heads * group * D) + h * group * D;
      for (int64_t g = 0; g < group; ++g)
        for (int d = 0; d < D; ++d) orow[g * D + d] = static_cast<T>(acc[g * D + d] * sums[g]);
    }
  });
}

template <typename T>
void dispatch(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
              const torch::Tensor& tables, const torch::Tensor& lens, const torch::Tensor& rows,
              torch::Tensor& out, int64_t block_size, int64_t n_kv_heads, int64_t group,
              double scale) {
  const int64_t head_dim = q.size(2);
  auto run = [&](auto dim_tag) {
    constexpr int D = decltype(dim_tag)::value;
#if defined(__AVX512F__)
    const ferrum::PromptPartials* prefix = nullptr;
#if defined(FERRUM_SHARED_PROMPT)
    // Items sharing a cached prompt: its keys' part of their softmax once, on AMX tiles where
    // there are some, else on register tiles.
    ferrum::PromptPartials partials;
    constexpr bool kFloat = std::is_same<T, float>::value;
    if constexpr (D % 32 == 0 && (kFloat || ferrum::kSharedPromptBf16)) {
      const int64_t n_items = rows.size(0);
      const int64_t* table_rows = tables.data_ptr<int64_t>();
      const std::vector<ferrum::SharedRun> found =
          ferrum::shared_prompt_wanted.load()
              ? shared_prefixes(table_rows, lens.data_ptr<int64_t>(), n_items, tables.size(1),
                                block_size)
              : std::vector<ferrum::SharedRun>{};
      if (!found.empty()) {
#if defined(FERRUM_AMX)
        const bool amx = !kFloat && ferrum::amx_wanted.load() && ferrum::amx_permitted();
#else
        constexpr bool amx = false;
#endif
        // The elements as prompt_partials takes them: float, or bfloat16 bits.
        using E = std::conditional_t<kFloat, float, uint16_t>;
        auto bits = [](const torch::Tensor& t) {
          return reinterpret_cast<const E*>(t.data_ptr<T>());
        };
        const int64_t* item_rows = rows.data_ptr<int64_t>();
        ferrum::prompt_partials<E>(
            found, n_items, table_rows, tables.size(1),
            [&](int64_t item, const auto& add) { add(item_rows[item]); }, bits(q), q.stride(0),
            q.size(0), bits(k_pool), bits(v_pool), block_size, n_kv_heads, group, D,
            static_cast<float>(scale), amx, partials);
        prefix = &partials;
      }
    }
#endif
    decode_items_avx512<T, D>(
#elif defined(__AVX2__) && defined(__FMA__)
    decode_items_avx2<T, D>(
#else
    decode_impl<T, D>(
#endif
                      q.data_ptr<T>(), k_pool.data_ptr<T>(), v_pool.data_ptr<T>(),
                      tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                      rows.data_ptr<int64_t>(), out.data_ptr<T>(), rows.size(0),
                      tables.size(1), block_size, n_kv_heads, group, q.stride(0),
                      static_cast<float>(scale)
#if defined(__AVX512F__)
                      , prefix
#endif
    );
  };
  switch (head_dim) {
    case 32: run(std::integral_constant<int, 32>{}); break;
    case 64: run(std::integral_constant<int, 64>{}); break;
    case 80: run(std::integral_constant<int, 80>{}); break;
    case 96: run(std::integral_constant<int, 96>{}); break;
    case 128: run(std::integral_constant<int, 128>{}); break;
    case 256: run(std::integral_constant<int, 256>{}); break;
    default: TORCH_CHECK(false, "unsupported head_dim ", head_dim);
  }
}

}  // namespace

// q [T, H, D] (row stride may exceed H*D), pools [NB * BS * Hkv * D] contiguous,
// tables [N, W] int64, lens [N] int64, rows [N] int64 (query row of each item) -> [N, H, D]
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                               torch::Tensor tables, torch::Tensor lens, torch::Tensor rows,
                               int64_t block_size, int64_t n_kv_heads, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q layout");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pool must be contiguous");
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous() && rows.is_contiguous(), "index");
  TORCH_CHECK(k_pool.scalar_type() == q.scalar_type() && v_pool.scalar_type() == q.scalar_type(),
              "pool dtype must match q");
  const int64_t group = q.size(1) / n_kv_heads;
  auto out = torch::empty({rows.size(0), q.size(1), q.size(2)}, q.options());
  if (q.scalar_type() == torch::kFloat) {
    dispatch<float>(q, k_pool, v_pool, tables, lens, rows, out, block_size, n_kv_heads, group,
                    scale);
  } else if (q.scalar_type() == torch::kBFloat16) {
    dispatch<c10::BFloat16>(q, k_pool, v_pool, tables, lens, rows, out, block_size, n_kv_heads,
                            group, scale);
  } else {
    TORCH_CHECK(false, "unsupported dtype");
  }
  return out;
}

// The runs of items whose decode attention shares keys (shared_prefixes: whole blocks before
// every item's last key, at least 64 keys, at least two items), for tests: [runs, 3] int64 of
// (first item, items, shared keys). tables [N, W] int64, lens [N] int64.
torch::Tensor decode_shared_prefixes(torch::Tensor tables, torch::Tensor lens,
                                     int64_t block_size) {
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == torch::kLong && tables.is_contiguous(),
              "tables must be a contiguous [N, W] int64 tensor");
  TORCH_CHECK(lens.dim() == 1 && lens.scalar_type() == torch::kLong && lens.is_contiguous() &&
                  lens.size(0) == tables.size(0),
              "lens must be a contiguous [N] int64 tensor");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  const int64_t n = tables.size(0), width = tables.size(1);
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(lp[i] >= 1 && (lp[i] - 1) / block_size < std::max<int64_t>(width, 1),
                "each length must be at least 1 and within its table");
  const std::vector<ferrum::SharedRun> found =
      shared_prefixes(tables.data_ptr<int64_t>(), lp, n, width, block_size);
  auto out = torch::empty({static_cast<int64_t>(found.size()), 3}, torch::kLong);
  for (size_t i = 0; i < found.size(); ++i) {
    out[i][0] = found[i].first;
    out[i][1] = found[i].count;
    out[i][2] = found[i].keys;
  }
  return out;
}

// True where decode items sharing a cached prompt can take its keys once for all of them
// (prompt_partials), in bfloat16 (a CPU with vdpbf16ps; on AMX tiles where it has them) or in
// float32 (AVX-512), and head_dim a multiple of 32.
bool shared_prompt_available(bool bfloat16) {
#if defined(FERRUM_SHARED_PROMPT)
  return !bfloat16 || ferrum::kSharedPromptBf16;
#else
  return false;
#endif
}

// Whether they do (the default; on AMX prompt chunks continuing a shared prompt too) or each
// reads all its keys itself; returns the previous setting. For benchmarks and tests that
// compare the two; a server leaves it on.
bool set_shared_prompt(bool on) { return ferrum::shared_prompt_wanted.exchange(on); }
