// Greedy choice and log-normaliser of each logits row, for the CPU path. torch runs argmax, then
// logsumexp as amax, subtract (a fresh [N, V] tensor), exp, sum and log: five passes and a
// temporary at vocabulary width. Here a row (128 KB at V = 32000) is read once on an AVX-512 CPU
// (folded as the GEMM folds an LM head's outputs, common.h's fold_greedy), twice elsewhere.
//
// -ffast-math lets the compiler assume no NaN or infinity, so a row holding one is detected with
// bit tests instead and reported through `finite`; the caller recomputes those rows with torch,
// which defines the answer for them (argmax picks the first NaN, logsumexp propagates it).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "common.h"

namespace {

#if defined(__AVX512F__)
// Rows folded together: each fold's exponentials are a long chain of dependent arithmetic, and
// one row's chunks, each waiting on the sums before it, left the core idle between them.
constexpr int64_t kRowsTogether = 8;

// Each row folded 32 columns at a time (ferrum::fold_greedy), as the AVX-512 GEMM's kGreedy
// store folds an LM head's outputs: a row's argmax and log-normaliser are the same bits whether
// its step sampled written logits (here) or let the head's GEMM fold them. One pass over the
// row: its maximum, first index and sum of exponentials together, rescaling the sums whenever
// the maximum grows. kRowsTogether rows at a time, chunk by chunk (each row's arithmetic is
// its own, in the same order).
template <typename T>
void argmax_lse_rows(const T* logits, int64_t stride, int64_t rows, int64_t vocab, int64_t* ids,
                     float* lse, bool* finite) {
  const int64_t segments =
      (vocab + ferrum::kGreedySegmentColumns - 1) / ferrum::kGreedySegmentColumns;
  const int64_t groups = (rows + kRowsTogether - 1) / kRowsTogether;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<ferrum::GreedyRow> folds(static_cast<size_t>(kRowsTogether * segments));
    for (int64_t group = begin; group < end; ++group) {
      const int64_t r0 = group * kRowsTogether;
      const int64_t n = std::min(kRowsTogether, rows - r0);
      std::fill(folds.begin(), folds.end(), ferrum::GreedyRow{});
      for (int64_t c = 0; c < vocab; c += 32) {
        const __mmask16 lanes0 = ferrum::first_lanes(vocab - c);
        const __mmask16 lanes1 = vocab > c + 16 ? ferrum::first_lanes(vocab - c - 16) : 0;
        ferrum::GreedyRow* fold = folds.data() + (c / ferrum::kGreedySegmentColumns);
        for (int64_t i = 0; i < n; ++i) {
          const T* row = logits + (r0 + i) * stride + c;
          ferrum::fold_greedy(fold[i * segments], ferrum::load16(row, lanes0),
                              ferrum::load16(row + 16, lanes1), lanes0, lanes1, c);
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const ferrum::GreedyChoice choice =
            ferrum::combine_greedy(folds.data() + i * segments, segments, 1);
        ids[r0 + i] = choice.column;
        lse[r0 + i] = choice.lse;
        finite[r0 + i] = choice.finite;
      }
    }
  });
}
#else
using ferrum::Elem;

inline bool exponent_all_ones(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x7f800000u) == 0x7f800000u;
}

// Two passes over a row, the second while it sits in cache: its maximum (and whether it holds a
// NaN or an infinity), then the sum of exponentials.
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
      int64_t best = 0;  // the first index holding it
      while (best < vocab && Elem<T>::load(row, best) != mx) ++best;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < vocab; ++i) sum += std::exp(Elem<T>::load(row, i) - mx);
      ids[r] = best;
      lse[r] = mx + std::log(sum);
      finite[r] = special == 0 && best < vocab;
    }
  });
}
#endif

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
