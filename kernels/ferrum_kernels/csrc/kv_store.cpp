// This step's key and value rows written into their KV pool slots: the write that the CPU
// attention starts each layer with (see cpu_attention.write_kv_cpu), alone (store_kv_) or
// fused with the rotary embedding before it (rotary_store_kv_, the native layers' form).
//
// The torch write (two index_copy_ calls, each over a strided view of the qkv projection) cost
// about 1.7 ms of a W1 float32 prefill step (512 rows, 12 layers) and 0.8 ms of a 64-decode
// step. A row of K (or V) is Hkv x D contiguous elements in both the projection and the pool,
// so each row is one memcpy, and one call writes both planes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kRowTile = 16;  // rows rotated, then written, at a time

// Where a step's K/V rows go: kv_layer [2, NB, BS, Hkv, D] contiguous, `rows` rows of
// Hkv x D elements of kv_layer's dtype, slots [T] int64. Every slot is checked before anything
// is written, so a bad one changes nothing.
struct KvSlots {
  char* k_pool;
  char* v_pool;
  const int64_t* slot;
  int64_t row_bytes;
  torch::Tensor slots;  // keeps a contiguous copy alive

  KvSlots(const torch::Tensor& kv_layer, int64_t rows, int64_t heads, int64_t dim,
          const torch::Tensor& slot_tensor) {
    TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(0) == 2 && kv_layer.is_contiguous(),
                "kv_layer must be a contiguous [2, NB, BS, Hkv, D] pool");
    TORCH_CHECK(kv_layer.size(3) == heads && kv_layer.size(4) == dim, "key rows are [", heads,
                ", ", dim, "], the pool's [", kv_layer.size(3), ", ", kv_layer.size(4), "]");
    TORCH_CHECK(slot_tensor.dim() == 1 && slot_tensor.size(0) == rows &&
                    slot_tensor.scalar_type() == torch::kLong,
                "slots must be [T] int64");
    slots = slot_tensor.contiguous();
    const int64_t capacity = kv_layer.size(1) * kv_layer.size(2);
    slot = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows; ++i) {
      TORCH_CHECK(slot[i] >= 0 && slot[i] < capacity, "slot ", slot[i], " of row ", i,
                  " is outside the pool's ", capacity, " slots");
    }
    row_bytes = heads * dim * kv_layer.element_size();
    k_pool = static_cast<char*>(kv_layer.data_ptr());
    v_pool = k_pool + capacity * row_bytes;
  }

  // Row i's two slots fetched for writing (a prefetch with write intent), so the copy after
  // the rotation finds its lines in cache instead of waiting for them to be read for
  // ownership. A step's slots are cold pool lines. rotary_store_kv_ fetches a row's slots as
  // it rotates the row where the row continues the slots of the row before it (a prompt
  // chunk's rows, block by block): 1,024 rows into shuffled blocks of 16 took 202 against
  // 239 us a call, 64 rows into consecutive slots 13.0 against 16.5. Rows in slots of their
  // own (a decode step's, one per cache) ran 24.5 against 23.3 us with every row fetched so,
  // so they are left as they were (23.0 against 23.7: level). bfloat16 at W1's shapes on an
  // Intel Xeon with AMX, fifty-fourth session (docs/benchmarks.md).
  inline void fetch_for_write(int64_t i) const {
    const char* k = k_pool + slot[i] * row_bytes;
    const char* v = v_pool + slot[i] * row_bytes;
    for (int64_t b = 0; b < row_bytes; b += 64) {
      __builtin_prefetch(k + b, 1, 3);
      __builtin_prefetch(v + b, 1, 3);
    }
  }

  inline void write(int64_t i, const char* k, const char* v) const {
    std::memcpy(k_pool + slot[i] * row_bytes, k, row_bytes);
    std::memcpy(v_pool + slot[i] * row_bytes, v, row_bytes);
  }
};

}  // namespace

// kv_layer [2, NB, BS, Hkv, D] contiguous; key, value [T, Hkv, D] in kv_layer's dtype, each row
// contiguous (views of the qkv projection are: only their row stride differs); slots [T] int64.
// Every slot is checked before anything is written, so a bad one changes nothing.
void store_kv_(torch::Tensor kv_layer, torch::Tensor key, torch::Tensor value,
               torch::Tensor slots) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
              "key and value must be [T, Hkv, D] of one shape");
  TORCH_CHECK(key.scalar_type() == kv_layer.scalar_type() &&
                  value.scalar_type() == kv_layer.scalar_type(),
              "key and value must have the pool's dtype");
  const int64_t rows = key.size(0), heads = key.size(1), dim = key.size(2);
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == dim && value.stride(2) == 1 &&
                  value.stride(1) == dim,
              "each key and value row must be contiguous");
  const KvSlots to(kv_layer, rows, heads, dim, slots);
  const int64_t size = kv_layer.element_size();
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * size, v_stride = value.stride(0) * size;
  // A decode step's 64 rows (128 KB in float32 at W1's shape) are copied faster than a second
  // thread wakes; a 512-row prefill step splits in two.
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) to.write(i, k + i * k_stride, v + i * v_stride);
  });
}

// qkv [T, W] rows of a fused projection (q's `heads` heads, then k's and v's `kv_heads` each,
// head_dim D apart); cos, sin [T, D/2] in its dtype; kv_layer and slots as store_kv_ takes them.
// Rotates q and k in place, as rotary_(qkv, cos, sin, heads + kv_heads, D) does, and writes
// each row's rotated k and its v into the row's slot, as store_kv_ then does: the same values
// bit for bit, in one pass over the rows with the threads splitting them, kRowTile rows at a
// time rotated, then written (row by row, a 1,024-row prompt step's twelve layers took 0.3 ms
// longer). Inside a step's native layers the rows' KV writes go to cold pool lines, so two
// separate calls left one core waiting on the other's serial copy in a decode step
// (store_kv_'s rows stay on one thread below 256) and read each k row twice.
void rotary_store_kv_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, torch::Tensor kv_layer,
                      torch::Tensor slots) {
  check_rotary(qkv, cos, sin, heads + kv_heads, head_dim);
  TORCH_CHECK((heads + 2 * kv_heads) * head_dim <= qkv.size(1),
              "qkv rows must hold q, k and v heads");
  TORCH_CHECK(qkv.scalar_type() == kv_layer.scalar_type(), "qkv must have the pool's dtype");
  const int64_t rows = qkv.size(0);
  const KvSlots to(kv_layer, rows, kv_heads, head_dim, slots);
  const int64_t half = head_dim / 2;
  by_dtype(qkv, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* x = ptr<T>(qkv);
    const T* c = ptr<T>(cos);
    const T* s = ptr<T>(sin);
    const int64_t stride = qkv.stride(0);
    const int64_t k0 = heads * head_dim, v0 = (heads + kv_heads) * head_dim;
    // Rows of a few KB each: a decode step's 64 split between the threads too.
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r0 = begin; r0 < end; r0 += kRowTile) {
        const int64_t r1 = std::min(end, r0 + kRowTile);
        for (int64_t r = r0; r < r1; ++r) {
          if (r > 0 && to.slot[r] == to.slot[r - 1] + 1) to.fetch_for_write(r);
          rotary_one(x + r * stride, c + r * half, s + r * half, heads + kv_heads, head_dim);
        }
        for (int64_t r = r0; r < r1; ++r) {
          const T* row = x + r * stride;
          to.write(r, reinterpret_cast<const char*>(row + k0),
                   reinterpret_cast<const char*>(row + v0));
        }
      }
    });
  });
}
