// What the quantized linear kernels share: the run-time choice of code path, the
// quantization of activations (per row, in blocks of 32 input channels, to int8 with a
// float scale), and the loop over output tiles. int8_linear.cpp and q4_linear.cpp each
// add their weight layout and their tile code; bindings.cpp binds them.
#pragma once

#include "aten_light.h"
#include "isa.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>


at::Tensor int8_linear(at::Tensor x, at::Tensor qweight, at::Tensor wscale, at::Tensor wsum,
                          at::Tensor bias, int64_t out_features, int64_t isa, at::Tensor out);
at::Tensor q4_linear(at::Tensor x, at::Tensor qweight, at::Tensor wscale, at::Tensor wmin,
                        at::Tensor bias, int64_t out_features, int64_t isa, at::Tensor out);

namespace linear {

constexpr int kBlock = 16;  // output channels per packed block
constexpr int kTileN = 32;  // output channels per tile (2 blocks)
constexpr int kMaxM = 4;    // activation rows per tile
constexpr int kQ = 32;      // input channels per quantization block

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: value = mant * 2^-24
      float f = std::ldexp(float(mant), -24);
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// x's rows quantized: `kp` bytes a row (zero padded), `qblocks` block scales a row, and
// when asked, each block's scale x (sum of its int8 values), which q4's block minimum meets.
struct Rows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> scaled_sum;
  int64_t kp = 0, qblocks = 0;
};

// With `shift`, bytes hold x + 128 as uint8 (the vpdpbusd layout); padding then holds
// 128, which meets zero weights and is taken back out with the block sums.
inline Rows quantize_rows(const at::Tensor& x, int64_t kp, bool shift, bool with_sums) {
  const int64_t m_total = x.size(0), k = x.size(1), qblocks = kp / kQ;
  Rows rows;
  rows.kp = kp;
  rows.qblocks = qblocks;
  rows.q.resize(m_total * kp);
  rows.scale.resize(m_total * qblocks);
  if (with_sums) rows.scaled_sum.resize(m_total * qblocks);
  const int offset = shift ? 128 : 0;
  const float* x_ptr = x.data_ptr<float>();
  at::parallel_for(0, m_total, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xr = x_ptr + m * k;
      int8_t* q = rows.q.data() + m * kp;
      for (int64_t b0 = 0; b0 < kp; b0 += kQ) {
        const int64_t b1 = std::min(k, b0 + kQ);
        float absmax = 0.f;
        for (int64_t i = b0; i < b1; ++i) absmax = std::max(absmax, std::fabs(xr[i]));
        const float scale = absmax / 127.f, inv = absmax > 0.f ? 127.f / absmax : 0.f;
        int32_t sum = 0;
        for (int64_t i = b0; i < b1; ++i) {
          const int v = std::clamp(int(std::nearbyint(xr[i] * inv)), -127, 127);
          sum += v;
          q[i] = int8_t(uint8_t(v + offset));
        }
        for (int64_t i = std::max(b0, b1); i < b0 + kQ; ++i) q[i] = int8_t(uint8_t(offset));
        rows.scale[m * qblocks + b0 / kQ] = scale;
        if (with_sums) rows.scaled_sum[m * qblocks + b0 / kQ] = scale * float(sum);
      }
    }
  });
  return rows;
}

// `out` when given (checked: contiguous float32 (M, N)), else a new (M, N) tensor.
inline at::Tensor output_for(const at::Tensor& x, int64_t n_out, at::Tensor out) {
  if (out.numel() == 0) return x.new_empty({x.size(0), n_out});
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == n_out,
              "quantized linear: out must be contiguous float32 (M, N)");
  return out;
}

// Calls tile(m, mb, block, acc) for every tile of kTileN output channels (starting at
// packed block `block`) and every run of up to kMaxM rows; the tile fills
// acc[i * kTileN + c], which lands in out (plus bias). Rows go in chunks that stay in L2
// while every weight tile passes over them; tiles are split between threads.
template <typename TileCall>
void for_each_tile(int64_t m_total, int64_t n_out, int64_t kp, const float* bias, float* out,
                   const TileCall& tile) {
  const int64_t n_tiles = (n_out + kTileN - 1) / kTileN;
  const int64_t m_chunk = std::max<int64_t>(kMaxM, (256 * 1024 / kp) / kMaxM * kMaxM);
  for (int64_t m0 = 0; m0 < m_total; m0 += m_chunk) {
    const int64_t m1 = std::min(m_total, m0 + m_chunk);
    at::parallel_for(0, n_tiles, 4, [&](int64_t t_begin, int64_t t_end) {
      float acc[kMaxM * kTileN];
      for (int64_t t = t_begin; t < t_end; ++t) {
        const int64_t n0 = t * kTileN;
        const int64_t width = std::min<int64_t>(kTileN, n_out - n0);
        for (int64_t m = m0; m < m1; m += kMaxM) {
          const int mb = int(std::min<int64_t>(kMaxM, m1 - m));
          tile(m, mb, n0 / kBlock, acc);
          for (int i = 0; i < mb; ++i) {
            float* row = out + (m + i) * n_out + n0;
            for (int64_t c = 0; c < width; ++c) row[c] = bias ? acc[i * kTileN + c] + bias[n0 + c] : acc[i * kTileN + c];
          }
        }
      }
    });
  }
}

}  // namespace linear
