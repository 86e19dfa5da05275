// Fused elementwise layers for the CPU path: RMSNorm (optionally with the residual add), SwiGLU
// and in-place rotary embedding. Each replaces a chain of 4-8 ATen ops (each a pass over memory
// and, in bfloat16, a conversion to float32 and back) with one pass.
//
// Numerics follow ferrum_kernels.layers (the transformers formulation) op by op: every point
// where the reference rounds to the activation dtype rounds here too, and the build does not
// contract a*b+c into FMAs, so float32 results differ from the reference only by summation
// order in the RMS statistic and by exp's last bit. Also the causal softmax of the CPU prefill
// attention (scores in the activation dtype, float32 inside, probabilities rounded back).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#include <cstdint>

#include "common.h"

namespace {

using ferrum::Elem;
#if defined(__AVX512F__)
using ferrum::exp_ps;
using ferrum::first_lanes;
using ferrum::from_bf16;
using ferrum::load16;
using ferrum::store16;
using ferrum::to_bf16;
#endif

// Rows per parallel chunk such that a chunk holds at least ~16k elements.
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

#if defined(__AVX512F__)
using ferrum::round16;

// Stores v rounded to T and returns what was stored, as float32 (one conversion each way).
inline __m512 store_rounded(float* p, __m512 v, __mmask16 lanes) {
  ferrum::store16_first(p, v, lanes);
  return v;
}
inline __m512 store_rounded(uint16_t* p, __m512 v, __mmask16 lanes) {
  const __m256i bits = ferrum::to_bf16(v);
  if (lanes == 0xffff) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits);
  } else {
    _mm256_mask_storeu_epi16(p, lanes, bits);
  }
  return ferrum::from_bf16(bits);
}

// One row of (optionally residual-added) RMSNorm in 16-lane vectors, the tail masked (its
// missing lanes load as zero and add nothing to the sum). The sum of squares is a mul then an
// add per lane, as the scalar loop, in two chains so the adds overlap; only its order differs.
// `row` (width rounded up to whole vectors) keeps the row as float32 between the passes, and
// `weight` is the weight widened once per chunk of rows: in bfloat16 the conversions, not
// memory, bound this kernel.
template <typename T>
void rms_norm_row(const T* x, const float* weight, T* out, T* residual, const T* delta,
                  float* row, int64_t width, float eps) {
  const T* tag = nullptr;
  __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
  for (int64_t i = 0; i < width; i += 16) {
    const __mmask16 lanes = ferrum::first_lanes(width - i);
    __m512 v;
    if (residual != nullptr) {
      // residual <- residual + delta, rounded to T as the reference's add; the sum is what
      // the statistic and the output read.
      const __m512 added = _mm512_add_ps(load16(residual + i, lanes), load16(delta + i, lanes));
      v = store_rounded(residual + i, added, lanes);
    } else {
      v = load16(x + i, lanes);
    }
    _mm512_storeu_ps(row + i, v);  // row has whole vectors: the tail's zero lanes land there
    even = _mm512_add_ps(even, _mm512_mul_ps(v, v));
    std::swap(even, odd);
  }
  const float sum = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(sum / static_cast<float>(width) + eps));
  for (int64_t i = 0; i < width; i += 16) {
    const __mmask16 lanes = ferrum::first_lanes(width - i);
    const __m512 normed = round16(_mm512_mul_ps(_mm512_loadu_ps(row + i), inv), tag);
    const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(weight + i), normed);
    ferrum::store16_first(out + i, scaled, lanes);
  }
}
#endif

template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* w, T* out, int64_t out_stride,
                   T* residual, const T* delta, int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    // The widened weight, then one row of float32; both rounded up to whole vectors. Kept per
    // thread (2 x the widest row seen, 6 KB at W1's 768): a vector allocated per call made the
    // norms of an engine's W1 decode steps 39-45 us a call against 29 for the scalar loop
    // (12-15 us kept), though it was faster in a loop of its own.
    const int64_t padded = (width + 15) / 16 * 16;
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < 2 * padded) scratch.assign(2 * padded, 0.f);
    for (int64_t i = 0; i < width; ++i) scratch[i] = Elem<T>::load(w, i);
#endif
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
#if defined(__AVX512F__)
      rms_norm_row(xr, scratch.data(), out + r * out_stride,
                   residual != nullptr ? residual + r * width : nullptr,
                   delta != nullptr ? delta + r * width : nullptr, scratch.data() + padded, width,
                   eps);
#else
      if (residual != nullptr) {
        // residual <- residual + delta (rounded to T, as the reference's add), then normalised.
        T* rr = residual + r * width;
        const T* dr = delta + r * width;
        for (int64_t i = 0; i < width; ++i)
          Elem<T>::store(rr, i, Elem<T>::load(rr, i) + Elem<T>::load(dr, i));
        xr = rr;
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < width; ++i) {
        const float v = Elem<T>::load(xr, i);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
      T* orow = out + r * out_stride;
      for (int64_t i = 0; i < width; ++i) {
        const float normed = Elem<T>::round(Elem<T>::load(xr, i) * inv);
        Elem<T>::store(orow, i, Elem<T>::load(w, i) * normed);
      }
#endif
    }
  });
}

#if defined(__AVX512F__)
using ferrum::silu_mul16;

// One row: full vectors, then the tail masked, through the same arithmetic.
template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t inter) {
  int64_t i = 0;
  for (; i + 16 <= inter; i += 16) store16(o + i, silu_mul16<T>(load16(g + i), load16(u + i)));
  if (i < inter) {
    const __mmask16 lanes = first_lanes(inter - i);
    store16(o + i, silu_mul16<T>(load16(g + i, lanes), load16(u + i, lanes)), lanes);
  }
}
#endif

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, row_grain(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
#if defined(__AVX512F__)
      silu_mul_row(g, u, o, inter);
#else
      for (int64_t i = 0; i < inter; ++i) {
        const float x = Elem<T>::load(g, i);
        // exp's argument is capped so it stays finite (-ffast-math assumes no infinities);
        // below -87 silu is ~1e-36 either way.
        const float act = Elem<T>::round(x / (1.f + std::exp(-std::max(x, -87.f))));
        Elem<T>::store(o, i, act * Elem<T>::load(u, i));
      }
#endif
    }
  });
}

#if defined(__AVX512F__)
// One row's heads, 16 lanes of each half at a time (the tail masked), through the scalar
// loop's arithmetic: every product rounded to T, then the difference and sum (rounded by the
// store), so the result is the same bit for bit.
template <typename T>
void rotary_row(T* x, const T* cos, const T* sin, int64_t heads, int64_t half) {
  const T* tag = nullptr;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 lanes = ferrum::first_lanes(half - i);
    const __m512 c = load16(cos + i, lanes), s = load16(sin + i, lanes);
    for (int64_t h = 0; h < heads; ++h) {
      T* x1 = x + h * 2 * half + i;
      T* x2 = x1 + half;
      const __m512 a = load16(x1, lanes), b = load16(x2, lanes);
      const __m512 first = _mm512_sub_ps(round16(_mm512_mul_ps(a, c), tag),
                                         round16(_mm512_mul_ps(b, s), tag));
      const __m512 second = _mm512_add_ps(round16(_mm512_mul_ps(b, c), tag),
                                          round16(_mm512_mul_ps(a, s), tag));
      ferrum::store16_first(x1, first, lanes);
      ferrum::store16_first(x2, second, lanes);
    }
  }
}
#endif

// One row's first `heads` heads rotated in place (cos, sin: the row's [D/2]).
template <typename T>
inline void rotary_one(T* x, const T* c, const T* s, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
#if defined(__AVX512F__)
  rotary_row(x, c, s, heads, half);
#else
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = x + h * head_dim;
    T* x2 = x1 + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = Elem<T>::load(x1, i), b = Elem<T>::load(x2, i);
      const float ci = Elem<T>::load(c, i), si = Elem<T>::load(s, i);
      // (x1*c - x2*s, x2*c + x1*s), each product and sum rounded like the reference.
      const float first = Elem<T>::round(a * ci) - Elem<T>::round(b * si);
      const float second = Elem<T>::round(b * ci) + Elem<T>::round(a * si);
      Elem<T>::store(x1, i, first);
      Elem<T>::store(x2, i, second);
    }
  }
#endif
}

template <typename T>
void rotary_rows(T* x, int64_t row_stride, const T* cos, const T* sin, int64_t rows,
                 int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, row_grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      rotary_one(x + r * row_stride, cos + r * half, sin + r * half, heads, head_dim);
    }
  });
}

template <typename F>
void by_dtype(const torch::Tensor& t, F&& body) {
  if (t.scalar_type() == torch::kFloat) {
    body(static_cast<float*>(nullptr));
  } else if (t.scalar_type() == torch::kBFloat16) {
    body(static_cast<uint16_t*>(nullptr));
  } else {
    TORCH_CHECK(false, "ferrum fused ops: unsupported dtype ", t.scalar_type());
  }
}

template <typename T>
T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, width] with unit inner stride");
}

// rotary_'s operands: x [T, W] rows with W >= heads * head_dim, cos/sin [T, D/2] in x's dtype.
void check_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                  int64_t heads, int64_t head_dim) {
  check_rows(x, "x");
  TORCH_CHECK(head_dim % 2 == 0 && heads * head_dim <= x.size(1), "heads * head_dim > width");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "cos/sin contiguous");
  TORCH_CHECK(cos.size(0) == x.size(0) && cos.size(1) == head_dim / 2 && cos.sizes() == sin.sizes(),
              "cos/sin must be [T, D/2]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos/sin dtype must match x");
}

}  // namespace

// x [T, H] (rows may be strided), weight [H] -> [T, H]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [H]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight dtype must match x");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  by_dtype(x, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<T>(ptr<T>(x), x.stride(0), ptr<T>(weight), ptr<T>(out), x.size(1), nullptr,
                     nullptr, x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// residual [T, H] += delta [T, H] (in place), then RMSNorm of the sum -> [T, H]
torch::Tensor add_rms_norm_(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight,
                            double eps) {
  TORCH_CHECK(residual.is_contiguous() && delta.is_contiguous(), "residual/delta contiguous");
  TORCH_CHECK(residual.sizes() == delta.sizes() && residual.dim() == 2, "shapes must match");
  TORCH_CHECK(residual.scalar_type() == delta.scalar_type(), "dtypes must match");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == residual.size(1), "weight [H]");
  TORCH_CHECK(weight.scalar_type() == residual.scalar_type(), "weight dtype must match");
  auto out = torch::empty_like(residual);
  by_dtype(residual, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<T>(ptr<T>(residual), residual.size(1), ptr<T>(weight), ptr<T>(out),
                     residual.size(1), ptr<T>(residual), ptr<T>(delta), residual.size(0),
                     residual.size(1), static_cast<float>(eps));
  });
  return out;
}

// gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I]
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be contiguous [T, 2I]");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  by_dtype(gate_up, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_mul_rows<T>(ptr<T>(gate_up), ptr<T>(out), gate_up.size(0), inter);
  });
  return out;
}

// Rotates, in place, the first `heads` heads of every row of x [T, W] (W >= heads * D), e.g.
// the q and k parts of a fused qkv projection. cos/sin [T, D/2] in x's dtype.
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads,
             int64_t head_dim) {
  check_rotary(x, cos, sin, heads, head_dim);
  by_dtype(x, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rotary_rows<T>(ptr<T>(x), x.stride(0), ptr<T>(cos), ptr<T>(sin), x.size(0), heads, head_dim);
  });
}

namespace {

template <typename T>
void causal_softmax_rows(T* scores, int64_t rows, int64_t width, int64_t block_rows,
                         int64_t offset) {
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    std::vector<float> e(width);
    for (int64_t i = begin; i < end; ++i) {
      T* row = scores + i * width;
      // Row r of a block of queries sees keys [0, offset + r]; the rest are the future.
      const int64_t seen = std::min<int64_t>(width, offset + i % block_rows + 1);
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < seen; ++j) mx = std::max(mx, Elem<T>::load(row, j));
      float sum = 0.f;
      for (int64_t j = 0; j < seen; ++j) {
        e[j] = std::exp(Elem<T>::load(row, j) - mx);
        sum += e[j];
      }
      const float inv = 1.f / sum;
      for (int64_t j = 0; j < seen; ++j) Elem<T>::store(row, j, e[j] * inv);
      for (int64_t j = seen; j < width; ++j) Elem<T>::store(row, j, 0.f);
    }
  });
}

}  // namespace

// In place over scores [R, V] (contiguous): float32 softmax of each row's visible prefix, the
// rest zeroed, the result rounded to the scores' dtype. Rows come in blocks of `block_rows`
// queries; row r of a block sees keys [0, offset + r] (a causal diagonal at `offset`).
void causal_softmax_(torch::Tensor scores, int64_t block_rows, int64_t offset) {
  TORCH_CHECK(scores.dim() == 2 && scores.is_contiguous(), "scores must be contiguous [R, V]");
  TORCH_CHECK(block_rows > 0 && offset >= 0, "block_rows > 0 and offset >= 0");
  by_dtype(scores, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    causal_softmax_rows<T>(ptr<T>(scores), scores.size(0), scores.size(1), block_rows, offset);
  });
}
