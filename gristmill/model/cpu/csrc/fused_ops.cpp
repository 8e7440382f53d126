// The small steps between a layer's matmuls, fused, for CPU float32: RMSNorm, the
// residual add with the norms around it, and q/k norm + rotary over the fused qkv output;
// for encoders, the residual add + LayerNorm and GELU.
// Spelled out in torch each is 5-12 small ops; at batch 1 their dispatch, not their
// arithmetic, is what costs (a decode step of Gemma 3 270M runs ~1000 of them).
// Rows run in parallel only when there are enough of them to pay for waking threads.
#include "cpu_ops.h"
#include "vector_math.h"


#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kWorkPerThread = 1 << 15;  // floats a thread must get before we split

int64_t grain_for(int64_t row_width) { return std::max<int64_t>(1, kWorkPerThread / std::max<int64_t>(1, row_width)); }

// 1 / sqrt(mean(x^2) + eps), the sum taken in double (torch sums float32 pairwise; a
// double sum is as close to exact, in any order).
inline float inv_rms(const float* x, int64_t n, double eps) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  return static_cast<float>(1.0 / std::sqrt(sum / n + eps));
}

// out = x * inv_rms(x) * (w + offset) (w may be null: no weight). Gemma's weights are
// stored as w with offset 1, the others' with offset 0.
inline void norm_row(const float* x, const float* w, float offset, float* out, int64_t n, double eps) {
  const float r = inv_rms(x, n, eps);
  if (w) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * r) * (w[i] + offset);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r;
  }
}

const float* weight_or_null(const at::Tensor& w, int64_t n, const char* name) {
  if (w.numel() == 0) return nullptr;
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == n,
              name, " must be a contiguous float32 tensor of ", n, " values");
  return w.data_ptr<float>();
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, name, " must be a CPU float32 tensor");
}

}  // namespace

// x: (..., d) -> x / rms(x) * (weight + offset), weight (d,).
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double offset, double eps) {
  check_rows(x, "x");
  x = x.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  const float* w = weight_or_null(weight, d, "weight");
  auto out = x.new_empty(x.sizes());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_for(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * d, w, offset, op + r * d, d, eps);
  });
  return out;
}

// The residual stream around a sublayer: x_new = x + norm(delta) * (delta_weight +
// offset) (or x + delta when delta_weight is empty), and h = norm(x_new) * (out_weight +
// offset) (empty when out_weight is empty). x, delta: (rows, d).
std::vector<at::Tensor> residual_norm(at::Tensor x, at::Tensor delta, at::Tensor delta_weight,
                                         at::Tensor out_weight, double offset, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  x = x.contiguous();
  delta = delta.contiguous();
  TORCH_CHECK(x.sizes() == delta.sizes(), "x and delta must have one shape");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  const float* wd = weight_or_null(delta_weight, d, "delta_weight");
  const float* wo = weight_or_null(out_weight, d, "out_weight");
  auto x_new = x.new_empty(x.sizes());
  auto h = wo ? x.new_empty(x.sizes()) : x.new_empty({0});
  const float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  float* xn = x_new.data_ptr<float>();
  float* hp = wo ? h.data_ptr<float>() : nullptr;
  const float foffset = static_cast<float>(offset);
  at::parallel_for(0, rows, grain_for(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * d;
      const float* dr = dp + r * d;
      float* out = xn + r * d;
      if (wd) {
        const float s = inv_rms(dr, d, eps);
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) out[i] = xr[i] + (dr[i] * s) * (wd[i] + foffset);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) out[i] = xr[i] + dr[i];
      }
      if (wo) norm_row(out, wo, foffset, hp + r * d, d, eps);
    }
  });
  return {x_new, h};
}

// LayerNorm of x + delta (of x alone when delta is empty) over the last dimension, times
// weight plus bias (each (d,) or empty): the residual add of a post-LayerNorm encoder and
// its norm in one pass over the row. Mean and variance are summed in double. The result
// is written over delta (a sublayer's output, read by nothing else: a fresh tensor of a
// few MB a call costs its page faults) when delta is contiguous, else into a new tensor.
at::Tensor add_layer_norm_(at::Tensor x, at::Tensor delta, at::Tensor weight, at::Tensor bias, double eps) {
  check_rows(x, "x");
  x = x.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  const bool has_delta = delta.numel() > 0;
  if (has_delta) {
    check_rows(delta, "delta");
    delta = delta.contiguous();
    TORCH_CHECK(x.sizes() == delta.sizes(), "x and delta must have one shape");
  }
  const float* w = weight_or_null(weight, d, "weight");
  const float* b = weight_or_null(bias, d, "bias");
  auto out = has_delta ? delta : x.new_empty(x.sizes());
  const float* xp = x.data_ptr<float>();
  const float* dp = has_delta ? delta.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_for(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* o = op + r * d;
      const float* xr = xp + r * d;
      if (dp) {
        const float* dr = dp + r * d;  // (o itself)
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) o[i] = xr[i] + dr[i];
      } else {
        std::copy(xr, xr + d, o);
      }
      double sum = 0.0;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < d; ++i) sum += o[i];
      const double mean = sum / d;
      double squares = 0.0;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < d; ++i) squares += (o[i] - mean) * (o[i] - mean);
      const float m = static_cast<float>(mean), rstd = static_cast<float>(1.0 / std::sqrt(squares / d + eps));
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        const float v = (o[i] - m) * rstd;
        o[i] = (w ? v * w[i] : v) + (b ? b[i] : 0.f);
      }
    }
  });
  return out;
}

// x = gelu(x) (erf form), in place; x contiguous float32. Returns x.
at::Tensor gelu_(at::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.is_contiguous(), "gelu_: x must be contiguous");
  float* p = x.data_ptr<float>();
  const bool avx2 = best_isa() >= kAvx2;
  at::parallel_for(0, x.numel(), kWorkPerThread, [&](int64_t begin, int64_t end) {
    vmath::gelu_inplace(p + begin, end - begin, avx2);
  });
  return x;
}

// The attention inputs from the q, k, v projections, each (rows, heads * D) with unit
// column stride (views of one fused projection's output do): q (rows, H, D), k and v
// (rows, KV, D), contiguous; q and k get their per-head RMSNorm (when q_weight / k_weight
// are given; times weight + offset) and then rotate-half rotary at each row's position from the
// (max_positions, D / 2) cos / sin tables.
std::vector<at::Tensor> qkv_rotary(at::Tensor q_in, at::Tensor k_in, at::Tensor v_in,
                                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                      at::Tensor q_weight, at::Tensor k_weight, double offset, double eps,
                                      at::Tensor cos, at::Tensor sin, at::Tensor positions) {
  const int64_t rows = positions.numel(), half = head_dim / 2;
  auto check_input = [&](at::Tensor& t, int64_t heads, const char* name) {
    check_rows(t, name);
    if (t.dim() != 2 || t.stride(1) != 1) t = t.reshape({rows, -1}).contiguous();
    TORCH_CHECK(t.size(0) == rows && t.size(1) == heads * head_dim, name, " must be (rows, heads * head_dim)");
  };
  check_input(q_in, num_heads, "q");
  check_input(k_in, num_kv_heads, "k");
  check_input(v_in, num_kv_heads, "v");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  positions = positions.contiguous();
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions must be int64");
  TORCH_CHECK(head_dim % 2 == 0 && cos.dim() == 2 && cos.size(1) == half && sin.sizes() == cos.sizes()
              && cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be contiguous (max_positions, head_dim / 2)");
  const int64_t max_pos = cos.size(0);
  const float* wq = weight_or_null(q_weight, head_dim, "q_weight");
  const float* wk = weight_or_null(k_weight, head_dim, "k_weight");
  auto q = q_in.new_empty({rows, num_heads, head_dim});
  auto k = q_in.new_empty({rows, num_kv_heads, head_dim});
  auto v = q_in.new_empty({rows, num_kv_heads, head_dim});
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < max_pos, "position ", pos[r], " is past the rotary table (", max_pos, ")");
  const float *qs = q_in.data_ptr<float>(), *ks = k_in.data_ptr<float>(), *vs = v_in.data_ptr<float>();
  const int64_t q_stride = q_in.stride(0), k_stride = k_in.stride(0), v_stride = v_in.stride(0);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;

  at::parallel_for(0, rows, grain_for(width), [&](int64_t begin, int64_t end) {
    std::vector<float> normed(head_dim);
    // One head: norm (when w), then rotary at the row's cos / sin.
    auto head = [&](const float* in, const float* w, const float* c, const float* s, float* out) {
      const float* a = in;
      if (w) {
        norm_row(in, w, static_cast<float>(offset), normed.data(), head_dim, eps);
        a = normed.data();
      }
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        out[i] = a[i] * c[i] - a[i + half] * s[i];
        out[i + half] = a[i + half] * c[i] + a[i] * s[i];
      }
    };
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + pos[r] * half;
      const float* s = sp + pos[r] * half;
      for (int64_t h = 0; h < num_heads; ++h)
        head(qs + r * q_stride + h * head_dim, wq, c, s, qp + (r * num_heads + h) * head_dim);
      for (int64_t h = 0; h < num_kv_heads; ++h)
        head(ks + r * k_stride + h * head_dim, wk, c, s, kp + (r * num_kv_heads + h) * head_dim);
      const float* vrow = vs + r * v_stride;
      std::copy(vrow, vrow + num_kv_heads * head_dim, vp + r * num_kv_heads * head_dim);
    }
  });
  return {q, k, v};
}

// Structured output: logits[rows[k]][t] = -inf for every token t whose bit is clear in
// bitmask[k] (int32 words, bit i of word w = token 32 w + i), in place. One pass over the
// words: a word of all ones (most of a JSON string's tokens) costs one compare.
void mask_logits(at::Tensor logits, at::Tensor bitmask, std::vector<int64_t> rows) {
  TORCH_CHECK(logits.dtype() == at::kFloat && logits.is_contiguous() && logits.dim() == 2,
              "mask_logits: logits must be contiguous float32 (rows, vocab)");
  TORCH_CHECK(bitmask.dtype() == at::kInt && bitmask.is_contiguous() &&
              bitmask.size(0) == static_cast<int64_t>(rows.size()), "mask_logits: one int32 mask row per row");
  const int64_t vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "mask_logits: the mask is narrower than the vocabulary");
  float* out = logits.data_ptr<float>();
  const int32_t* bits = bitmask.data_ptr<int32_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, static_cast<int64_t>(rows.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      TORCH_CHECK(rows[k] >= 0 && rows[k] < logits.size(0), "mask_logits: row out of range");
      float* row = out + rows[k] * vocab;
      const uint32_t* mask = reinterpret_cast<const uint32_t*>(bits + k * words);
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = mask[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t base = w * 32, n = std::min<int64_t>(32, vocab - base);
        if (word == 0) {  // none allowed (most tokens once a JSON value is closed)
          std::fill(row + base, row + base + n, neg_inf);
          continue;
        }
        for (int64_t i = 0; i < n; ++i) {
          if (!((word >> i) & 1u)) row[base + i] = neg_inf;
        }
      }
    }
  });
}
