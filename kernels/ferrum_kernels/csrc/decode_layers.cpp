// Every dense layer of a decode-only step in one call, and every layer but the last of a step
// of prompt chunks alone (cpu_decode_layer.NativeDecodeLayers and its prefill).
//
// NativeDecodeLayer runs a layer as eight native calls from Python; across a W1 step's twelve
// layers the Python between them (argument conversion, the calls themselves, the layer's own
// lines) was about 2 ms of a 27-30 ms bfloat16 decode step of 64 items. Here the same kernels
// run in the same order on the same operands from C++: the results are bit for bit those of the
// per-layer calls (tested), and a step pays for one call instead of 96. A prompt step's
// layers, through the model's generic path, spent 3.4-4 ms between their kernels (of 50 ms at 2
// x 256 tokens, 100 ms at 4 x 256); its last layer stays with the model, which finishes only
// the rows whose logits the step needs.
#include <torch/extension.h>

#include <tuple>
#include <vector>

// The layer loop both entry points share: layers 0 .. layers - 1 of kv_cache, each as
// NativeDecodeLayer's eight calls, with attend(q [T, H, D] view, kv_layer [2, NB, BS, Hkv, D])
// -> [T, H, D] the attention over the pool after this layer's K/V are stored.
template <typename Attend>
std::tuple<torch::Tensor, torch::Tensor> dense_layers(
    torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
    const torch::Tensor& kv_cache, const std::vector<torch::Tensor>& weights,
    const std::vector<double>& eps, const std::vector<int64_t>& widths, int64_t layers,
    int64_t heads, int64_t kv_heads, int64_t head_dim, const torch::Tensor& slots,
    const Attend& attend) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [L, 2, NB, BS, Hkv, D] pool");
  TORCH_CHECK(layers >= 1 && layers <= kv_cache.size(0), "layers must be within the pool's");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 6 * layers &&
                  static_cast<int64_t>(eps.size()) == 2 * layers &&
                  static_cast<int64_t>(widths.size()) == 4 * layers,
              "six weights, two epsilons and four widths per layer");
  TORCH_CHECK(hidden.dim() == 2, "hidden must be [T, H]");
  const int64_t t = hidden.size(0);
  const int64_t k0 = heads * head_dim;
  torch::Tensor x, res;
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + 6 * l;
    const int64_t* n = widths.data() + 4 * l;
    if (l == 0) {  // the residual stream starts as the embeddings
      x = rms_norm(hidden, w[0], eps[0]);
      res = hidden;
    } else {
      x = add_rms_norm_(res, hidden, w[0], eps[2 * l]);
    }
    torch::Tensor kv_layer = kv_cache.select(0, l);
    torch::Tensor qkv = packed_gemm(x, w[2], c10::nullopt, n[0]);  // [T, (H + 2 Hkv) D]
    // q and k rotated in place and k, v written into their slots, in one pass over the rows.
    rotary_store_kv_(qkv, cos, sin, heads, kv_heads, head_dim, kv_layer, slots);
    torch::Tensor attended = attend(qkv.slice(1, 0, k0).view({t, heads, head_dim}), kv_layer);
    torch::Tensor out = packed_gemm(attended.view({t, heads * head_dim}), w[3], c10::nullopt, n[1]);
    x = add_rms_norm_(res, out, w[1], eps[2 * l + 1]);
    torch::Tensor act = packed_gemm_halves(x, w[4], c10::nullopt, n[2], true);
    hidden = packed_gemm(act, w[5], c10::nullopt, n[3]);
  }
  return {hidden, res};
}

// hidden [T, H] (the embeddings); cos, sin [T, D/2];
// kv_cache [L, 2, NB, BS, Hkv, D] contiguous; per layer l, `weights` [6 l .. 6 l + 5]: the input
// and post-attention norms' weights, then the packed qkv, o, gate/up (paired) and down weights
// (no bias), `eps` [2 l, 2 l + 1] the norms' epsilons and `widths` [4 l .. 4 l + 3] the four
// projections' N; slots [T] the KV slots; tables, lens, rows the decode attention's plan
// (decode_attention). -> (the last layer's output, the residual stream), each [T, H], as the
// layers' calls leave them.
std::tuple<torch::Tensor, torch::Tensor> decode_layers(
    torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv_cache,
    std::vector<torch::Tensor> weights, std::vector<double> eps, std::vector<int64_t> widths,
    int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, torch::Tensor slots,
    torch::Tensor tables, torch::Tensor lens, torch::Tensor rows) {
  TORCH_CHECK(kv_cache.dim() == 6, "kv_cache must be a contiguous [L, 2, NB, BS, Hkv, D] pool");
  return dense_layers(
      hidden, cos, sin, kv_cache, weights, eps, widths, kv_cache.size(0), heads, kv_heads,
      head_dim, slots, [&](const torch::Tensor& q, const torch::Tensor& kv_layer) {
        return decode_attention(q, kv_layer.select(0, 0), kv_layer.select(0, 1), tables, lens,
                                rows, kv_layer.size(2), kv_layer.size(3), scale);
      });
}

// The first weights.size() / 6 layers of a step of prompt chunks alone (no decodes), as
// decode_layers runs a decode step's, with the prefill attention (prefill_attention: chunks,
// tables and scratch its plan and workspace, as cpu_attention._native_prefill passes them;
// global attention) in place of the decode attention. The model's last layer is left to the
// caller, which finishes only the rows whose logits the step needs.
std::tuple<torch::Tensor, torch::Tensor> prefill_layers(
    torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv_cache,
    std::vector<torch::Tensor> weights, std::vector<double> eps, std::vector<int64_t> widths,
    int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, torch::Tensor slots,
    torch::Tensor chunks, torch::Tensor tables, torch::Tensor scratch) {
  const int64_t layers = static_cast<int64_t>(weights.size()) / 6;
  return dense_layers(
      hidden, cos, sin, kv_cache, weights, eps, widths, layers, heads, kv_heads, head_dim, slots,
      [&](const torch::Tensor& q, const torch::Tensor& kv_layer) {
        torch::Tensor out = torch::empty(q.sizes(), q.options());  // [T, H, D] contiguous
        prefill_attention(q, kv_layer.select(0, 0), kv_layer.select(0, 1), out, chunks, tables,
                          scratch, kv_layer.size(2), kv_heads, scale, 0);
        return out;
      });
}
