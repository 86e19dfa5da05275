// Decode attention over the paged KV pool for the CPU path (see cpu_decode.py for why).
//
// One work unit is an (item, KV head) pair; the G query heads that share the KV head are scored
// together so each K/V row is converted to float32 once for all of them. Two passes over the
// history: scores, then the probability-weighted sum of V. Scores and softmax are float32
// whatever the pool dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <limits>
#include <vector>

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
    decode_impl<T, D>(q.data_ptr<T>(), k_pool.data_ptr<T>(), v_pool.data_ptr<T>(),
                      tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                      rows.data_ptr<int64_t>(), out.data_ptr<T>(), rows.size(0),
                      tables.size(1), block_size, n_kv_heads, group, q.stride(0),
                      static_cast<float>(scale));
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
