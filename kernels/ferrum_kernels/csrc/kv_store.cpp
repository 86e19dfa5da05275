// This step's key and value rows written into their KV pool slots: the write that the CPU
// attention starts each layer with (see cpu_attention.write_kv_cpu).
//
// The torch write (two index_copy_ calls, each over a strided view of the qkv projection) cost
// about 1.7 ms of a W1 float32 prefill step (512 rows, 12 layers) and 0.8 ms of a 64-decode
// step. A row of K (or V) is Hkv x D contiguous elements in both the projection and the pool,
// so each row is one memcpy, and one call writes both planes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

// kv_layer [2, NB, BS, Hkv, D] contiguous; key, value [T, Hkv, D] in kv_layer's dtype, each row
// contiguous (views of the qkv projection are: only their row stride differs); slots [T] int64.
// Every slot is checked before anything is written, so a bad one changes nothing.
void store_kv_(torch::Tensor kv_layer, torch::Tensor key, torch::Tensor value,
               torch::Tensor slots) {
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(0) == 2 && kv_layer.is_contiguous(),
              "kv_layer must be a contiguous [2, NB, BS, Hkv, D] pool");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
              "key and value must be [T, Hkv, D] of one shape");
  TORCH_CHECK(key.scalar_type() == kv_layer.scalar_type() &&
                  value.scalar_type() == kv_layer.scalar_type(),
              "key and value must have the pool's dtype");
  const int64_t rows = key.size(0), heads = key.size(1), dim = key.size(2);
  TORCH_CHECK(kv_layer.size(3) == heads && kv_layer.size(4) == dim,
              "key rows are [", heads, ", ", dim, "], the pool's [", kv_layer.size(3), ", ",
              kv_layer.size(4), "]");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == dim && value.stride(2) == 1 &&
                  value.stride(1) == dim,
              "each key and value row must be contiguous");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == rows && slots.scalar_type() == torch::kLong,
              "slots must be [T] int64");
  slots = slots.contiguous();
  const int64_t capacity = kv_layer.size(1) * kv_layer.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < capacity, "slot ", slot[i], " of row ", i,
                " is outside the pool's ", capacity, " slots");
  }
  const int64_t size = kv_layer.element_size();
  const int64_t row_bytes = heads * dim * size;
  char* k_pool = static_cast<char*>(kv_layer.data_ptr());
  char* v_pool = k_pool + capacity * row_bytes;
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * size, v_stride = value.stride(0) * size;
  // A decode step's 64 rows (128 KB in float32 at W1's shape) are copied faster than a second
  // thread wakes; a 512-row prefill step splits in two.
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(k_pool + slot[i] * row_bytes, k + i * k_stride, row_bytes);
      std::memcpy(v_pool + slot[i] * row_bytes, v + i * v_stride, row_bytes);
    }
  });
}
