// A decode step's decoder layers in one call: for steps where every token is a decode
// (batch 1 in particular), the ~20 Python-level calls a layer makes between its matmuls
// cost as much as the matmuls of a small model. This runs the same ops, in the same
// order, from C++: the fused norms and rotary, the quantized (or float) linears, the
// KV cache write and the paged decode attention.
//
// Per layer, `tensors` holds kTensorsPerLayer entries (an empty tensor for what the
// family lacks): the norms in, attn_out, mlp_in, mlp_out, q, k (Llama: in and mlp_in
// only); the qkv, o, gate_up and down linears, 4 tensors each (for int8 / q4: packed
// weight, scales, sums / minimums, bias; for GGUF blocks: layout, -, -, bias; for float:
// weight, -, -, bias); the rotary cos and sin tables; the layer's k and v cache. `ints`
// holds kIntsPerLayer: each linear's kind (0 float, 1 int8, 2 q4, 3 gguf: each linear
// its own) and out_features, the sliding window (0: none), and the code path of the
// quantized kernels. `scales`: each layer's attention scale.
//
// LoRA adapters (an engine with enable_lora): `lora` holds, per layer and linear (qkv, o,
// gate_up, down), the adapter slots' a_t, b_t and parts_used of lora_update.cpp (three
// empty tensors where no adapter may update it), and `lora_bounds` each such linear's
// split points, as its count then the points. When the step has adapter rows
// (`lora_rows` not empty, grouped by slot as lora_update_ takes them), each linear's
// output gets their update right after its matmul, as the layers' forward hooks do.
#include "cpu_ops.h"
#include "linear_common.h"

#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/silu.h>

#include <type_traits>

namespace {

constexpr int64_t kTensorsPerLayer = 26;
constexpr int64_t kIntsPerLayer = 10;
enum Kind : int64_t { kFloat = 0, kInt8 = 1, kQ4 = 2, kGGUF = 3 };

at::Tensor linear_of(const at::Tensor& x, const at::Tensor* t, int64_t kind, int64_t out_features,
                        int64_t isa) {
  static const at::Tensor none;
  switch (kind) {
    case kInt8:
      return int8_linear(x, t[0], t[1], t[2], t[3], out_features, isa, /*x_levels=*/127, linear::kNoActivation,
                         x.new_empty({0}));
#if GRISTMILL_Q4
    case kQ4: return q4_linear(x, t[0], t[1], t[2], t[3], out_features, isa, linear::kNoActivation, x.new_empty({0}));
#else
    case kQ4: TORCH_CHECK(false, "decode_stack: these kernels were built without q4_linear");
#endif
    case kGGUF: return gguf_linear(x, t[0], t[3], x.size(1), isa, linear::kNoActivation, x.new_empty({0}));
    default: return at::linear(x, t[0], t[3].numel() ? c10::optional<at::Tensor>(t[3]) : c10::nullopt);
  }
}

at::Tensor act_mul(const at::Tensor& gate_up, int64_t activation) {
  const int64_t half = gate_up.size(1) / 2;
  auto gate = gate_up.narrow(1, 0, half), up = gate_up.narrow(1, half, half);
  at::Tensor a;
  if (activation == 0) a = at::silu(gate);
  else if (activation == 1) a = at::gelu(gate, "tanh");
  else a = at::gelu(gate);
  return a.mul_(up);
}

// k, v: (n, kv_heads, head_dim) into their slots of the (blocks, block_size, kv_heads,
// head_dim) caches, rounded to the caches' float type as torch's `.to` rounds (nearest even).
template <class T>
void write_rows(const float* kp, const float* vp, T* kc, T* vc, int64_t row, int64_t num_slots, const int64_t* slots,
                int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, "slot ", slots[i], " is outside the KV cache");
    if constexpr (std::is_same_v<T, float>) {
      std::copy(kp + i * row, kp + (i + 1) * row, kc + slots[i] * row);
      std::copy(vp + i * row, vp + (i + 1) * row, vc + slots[i] * row);
    } else {
      for (int64_t j = 0; j < row; ++j) {
        kc[slots[i] * row + j] = T(kp[i * row + j]);
        vc[slots[i] * row + j] = T(vp[i * row + j]);
      }
    }
  }
}

void write_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                 const int64_t* slots, int64_t n) {
  const int64_t row = k.size(1) * k.size(2), num_slots = k_cache.numel() / row;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  if (k_cache.scalar_type() == at::kHalf)
    write_rows(kp, vp, k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), row, num_slots, slots, n);
  else if (k_cache.scalar_type() == at::kBFloat16)
    write_rows(kp, vp, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), row, num_slots, slots, n);
  else
    write_rows(kp, vp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), row, num_slots, slots, n);
}

}  // namespace

at::Tensor decode_stack(at::Tensor x, at::Tensor positions, at::Tensor slot_mapping,
                           at::Tensor block_tables, at::Tensor context_lens,
                           std::vector<at::Tensor> tensors, std::vector<int64_t> ints,
                           std::vector<double> scales, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t activation, double norm_offset, double eps,
                           std::vector<at::Tensor> lora, std::vector<int64_t> lora_bounds, at::Tensor lora_rows,
                           at::Tensor lora_group_slots, at::Tensor lora_group_starts) {
  const int64_t num_layers = static_cast<int64_t>(scales.size());
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == num_layers * kTensorsPerLayer &&
                  static_cast<int64_t>(ints.size()) == num_layers * kIntsPerLayer,
              "decode_stack: ", kTensorsPerLayer, " tensors and ", kIntsPerLayer, " ints per layer");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "decode_stack: x must be (n, hidden) float32");
  slot_mapping = slot_mapping.contiguous();
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == x.size(0),
              "decode_stack: one int64 slot per token");
  const int64_t n = x.size(0), q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  x = x.contiguous();
  // Each linear's LoRA split points (empty: no adapter updates it), when the step has adapter rows.
  std::vector<std::vector<int64_t>> site_bounds;
  if (lora_rows.numel() > 0) {
    TORCH_CHECK(static_cast<int64_t>(lora.size()) == num_layers * 4 * 3,
                "decode_stack: the step has LoRA rows, but not three LoRA tensors per linear");
    size_t at = 0;
    for (int64_t site = 0; site < num_layers * 4; ++site) {
      TORCH_CHECK(at < lora_bounds.size() && at + 1 + lora_bounds[at] <= lora_bounds.size(),
                  "decode_stack: lora_bounds is short");
      const auto count = static_cast<size_t>(lora_bounds[at]);
      site_bounds.emplace_back(lora_bounds.begin() + at + 1, lora_bounds.begin() + at + 1 + count);
      at += 1 + count;
    }
  }
  // y += the adapter rows' update of linear `j` of layer `l` (its input `in`)
  auto adapted = [&](at::Tensor y, const at::Tensor& in, int64_t l, int64_t j) {
    if (site_bounds.empty()) return y;
    const int64_t site = l * 4 + j;
    const at::Tensor* s = lora.data() + site * 3;
    if (s[0].numel() > 0)
      lora_update_(y, in, s[0], s[1], s[2], lora_rows, lora_group_slots, lora_group_starts, site_bounds[site]);
    return y;
  };
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* t = tensors.data() + l * kTensorsPerLayer;
    const int64_t* li = ints.data() + l * kIntsPerLayer;
    const int64_t isa = li[9];
    at::Tensor k_cache = t[24], v_cache = t[25];

    auto h = rms_norm(x, t[0], norm_offset, eps);
    auto qkv = adapted(linear_of(h, t + 6, li[0], li[4], isa), h, l, 0);
    auto heads = qkv_rotary(qkv.narrow(1, 0, q_width), qkv.narrow(1, q_width, kv_width),
                            qkv.narrow(1, q_width + kv_width, kv_width), num_heads, num_kv_heads, head_dim,
                            t[4], t[5], norm_offset, eps, t[22], t[23], positions);
    write_cache(heads[1], heads[2], k_cache, v_cache, slots, n);
    auto attn = paged_decode_attention(heads[0], k_cache, v_cache, block_tables, context_lens, scales[l], li[8], -1);
    auto attn_rows = attn.view({n, q_width});
    auto o = adapted(linear_of(attn_rows, t + 10, li[1], li[5], isa), attn_rows, l, 1);
    auto res = residual_norm(x, o, t[1], t[2], norm_offset, eps);
    auto gate_up = adapted(linear_of(res[1], t + 14, li[2], li[6], isa), res[1], l, 2);
    auto act = act_mul(gate_up, activation);
    auto down = adapted(linear_of(act, t + 18, li[3], li[7], isa), act, l, 3);
    x = residual_norm(res[0], down, t[3], x.new_empty({0}), norm_offset, eps)[0];
  }
  return x;
}
