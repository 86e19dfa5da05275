// Greedy choice and log-normaliser of each logits row in two cache-resident passes, for the CPU
// path. torch runs argmax, then logsumexp as amax, subtract (a fresh [N, V] tensor), exp, sum and
// log: five passes and a temporary at vocabulary width. Here a row (128 KB at V = 32000) is read
// once for the maximum and its first index, then once more, still in L2, for the sum of
// exponentials.
//
// -ffast-math lets the compiler assume no NaN or infinity, so a row holding one is detected with
// integer bit tests instead and reported through `finite`; the caller recomputes those rows with
// torch, which defines the answer for them (argmax picks the first NaN, logsumexp propagates it).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "common.h"

namespace {

using ferrum::Elem;

inline bool exponent_all_ones(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x7f800000u) == 0x7f800000u;
}

// The first index of row[0 .. vocab) equal to x, or vocab.
template <typename T>
int64_t first_equal(const T* row, int64_t vocab, float x) {
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(x);
  int64_t i = 0;
  for (; i + 16 <= vocab; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(ferrum::load16(row + i), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  if (i < vocab) {
    const __mmask16 lanes = ferrum::first_lanes(vocab - i);
    const __mmask16 hit =
        _mm512_mask_cmp_ps_mask(lanes, ferrum::load16(row + i, lanes), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return vocab;
#else
  int64_t i = 0;
  while (i < vocab && Elem<T>::load(row, i) != x) ++i;
  return i;
#endif
}

template <typename T>
void argmax_lse_rows(const T* logits, int64_t stride, int64_t rows, int64_t vocab, int64_t* ids,
                     float* lse, bool* finite) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = logits + r * stride;
      // Exponent bits all ones = NaN or infinity; an OR-reduction keeps the loop vectorised.
      uint32_t special = 0;
      float mx = Elem<T>::load(row, 0);
#pragma omp simd reduction(max : mx) reduction(| : special)
      for (int64_t i = 0; i < vocab; ++i) {
        const float v = Elem<T>::load(row, i);
        special |= static_cast<uint32_t>(exponent_all_ones(v));
        mx = std::max(mx, v);
      }
      // The first index holding the maximum (torch's tie rule). Sixteen lanes at a time: one
      // element at a time this scan took as long as both passes when the maximum sat late in
      // the row (64 x 32000 float32 rows from L2: 157 us with it first, 407 with it last).
      int64_t best = first_equal(row, vocab, mx);
      float sum = 0.f;
#if defined(__AVX512F__)
      // Scores below mx - 88 add under 1e-38 each: clamped there, exp_ps's range.
      const __m512 top = _mm512_set1_ps(mx), low = _mm512_set1_ps(-88.f);
      __m512 acc = _mm512_setzero_ps();
      // This pass is bound by exp's arithmetic, the first by memory (an LM head streams its
      // logits past the cache): fetching the next row into L2 meanwhile overlaps the two.
      const char* next = r + 1 < end ? reinterpret_cast<const char*>(row + stride) : nullptr;
      int64_t i = 0;
      for (; i + 16 <= vocab; i += 16) {
        if (next != nullptr) _mm_prefetch(next + i * sizeof(T), _MM_HINT_T1);
        acc = _mm512_add_ps(
            acc, ferrum::exp_ps(_mm512_max_ps(_mm512_sub_ps(ferrum::load16(row + i), top), low)));
      }
      if (i < vocab) {
        const __mmask16 lanes = ferrum::first_lanes(vocab - i);
        const __m512 t = _mm512_sub_ps(ferrum::load16(row + i, lanes), top);
        acc = _mm512_mask_add_ps(acc, lanes, acc, ferrum::exp_ps(_mm512_max_ps(t, low)));
      }
      sum = _mm512_reduce_add_ps(acc);
#else
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < vocab; ++i) sum += std::exp(Elem<T>::load(row, i) - mx);
#endif
      ids[r] = best;
      lse[r] = mx + std::log(sum);
      finite[r] = special == 0 && best < vocab;
    }
  });
}

}  // namespace

// logits [N, V] float32 or bfloat16 (unit inner stride) -> (argmax [N] int64,
// logsumexp [N] float32, finite [N] bool: False where the row holds a NaN or an infinity and the
// first two results are meaningless).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> argmax_logsumexp(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be [N, V] with V > 0 and unit inner stride");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto ids = torch::empty({rows}, logits.options().dtype(torch::kLong));
  auto lse = torch::empty({rows}, logits.options().dtype(torch::kFloat));
  auto finite = torch::empty({rows}, logits.options().dtype(torch::kBool));
  if (logits.scalar_type() == torch::kFloat) {
    argmax_lse_rows<float>(logits.data_ptr<float>(), logits.stride(0), rows, vocab,
                           ids.data_ptr<int64_t>(), lse.data_ptr<float>(),
                           finite.data_ptr<bool>());
  } else if (logits.scalar_type() == torch::kBFloat16) {
    argmax_lse_rows<uint16_t>(reinterpret_cast<const uint16_t*>(logits.data_ptr()),
                              logits.stride(0), rows, vocab, ids.data_ptr<int64_t>(),
                              lse.data_ptr<float>(), finite.data_ptr<bool>());
  } else {
    TORCH_CHECK(false, "argmax_logsumexp: unsupported dtype ", logits.scalar_type());
  }
  return {ids, lse, finite};
}
