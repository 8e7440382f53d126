// int8 weight x float activation linear layer on CPU: y = x @ W^T (+ bias).
//
// W is quantized per output channel (int8 in [-127, 127], one float scale per row) and
// packed once into blocks of 16 output channels x 4 input channels (64 bytes):
//   packed[n / 16][k / 4][n % 16][k % 4]
// with N padded to a multiple of 64 and K to a multiple of 4 (zeros). Each row of x is
// quantized per token to int8 here (absmax / 127); one 4-byte group of x, broadcast,
// meets a 64-byte weight block, so every lane accumulates one output channel in int32
// and no horizontal sums are needed. The result is scaled back:
//   y[m, n] = acc[m, n] * x_scale[m] * w_scale[n] (+ bias[n]).
//
// Three code paths, chosen at run time from what the CPU reports (never assumed):
//   avx512_vnni  vpdpbusd: x is shifted to uint8 (x + 128) and the shift is taken back
//                out with the precomputed row sums of W.
//   avx2         vpmaddubsw / vpmaddwd with the sign trick: |x| times W carrying x's
//                sign, so no 16-bit pair sum can saturate (2 * 127 * 127 < 2^15).
//   portable     plain C++ loops; any CPU.
// All three compute the same int32 sums, hence the same outputs.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2 };

constexpr int kBlock = 16;        // output channels per packed block
constexpr int kGroupN = 64;       // output channels per tile (4 blocks)
constexpr int kMaxM = 4;          // activation rows per tile
constexpr int kBlockBytes = 64;   // one block x 4 input channels

int64_t detect_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni"))
    return kAvx512Vnni;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kPortable;
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// acc[i * 64 + c] = sum_k x[i][k] * W[n0 + c][k] for i < mb, c < 64, where `w` points at
// the first of the tile's 4 packed blocks and blocks lie `block_stride` bytes apart.
using TileFn = void (*)(const int8_t* x, int64_t ldx, int mb, const int8_t* w,
                        int64_t block_stride, int64_t groups, int32_t* acc);

void tile_portable(const int8_t* x, int64_t ldx, int mb, const int8_t* w, int64_t block_stride,
                   int64_t groups, int32_t* acc) {
  for (int i = 0; i < mb; ++i) {
    const int8_t* xi = x + i * ldx;
    for (int b = 0; b < kGroupN / kBlock; ++b) {
      int32_t sums[kBlock] = {0};
      const int8_t* wb = w + b * block_stride;
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* wg = wb + g * kBlockBytes;
        for (int c = 0; c < kBlock; ++c)
          for (int q = 0; q < 4; ++q) sums[c] += int32_t(xi[4 * g + q]) * int32_t(wg[4 * c + q]);
      }
      std::memcpy(acc + i * kGroupN + b * kBlock, sums, sizeof(sums));
    }
  }
}

#if defined(__x86_64__) || defined(__i386__)

// MB rows x 2 blocks (32 channels): 4 ymm accumulators per row, 8 channels each.
template <int MB>
__attribute__((target("avx2,fma"))) void tile_avx2_m(const int8_t* x, int64_t ldx, const int8_t* w,
                                                     int64_t block_stride, int64_t groups,
                                                     int32_t* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sums[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) sums[i][j] = _mm256_setzero_si256();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* w0 = w + g * kBlockBytes;
    const int8_t* w1 = w0 + block_stride;
    const __m256i wv[4] = {_mm256_loadu_si256((const __m256i*)w0), _mm256_loadu_si256((const __m256i*)(w0 + 32)),
                           _mm256_loadu_si256((const __m256i*)w1), _mm256_loadu_si256((const __m256i*)(w1 + 32))};
    for (int i = 0; i < MB; ++i) {
      const __m256i xv = _mm256_set1_epi32(load4(x + i * ldx + 4 * g));
      const __m256i ax = _mm256_sign_epi8(xv, xv);
      for (int j = 0; j < 4; ++j) {
        const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[j], xv));
        sums[i][j] = _mm256_add_epi32(sums[i][j], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) _mm256_storeu_si256((__m256i*)(acc + i * kGroupN + 8 * j), sums[i][j]);
}

void tile_avx2(const int8_t* x, int64_t ldx, int mb, const int8_t* w, int64_t block_stride,
               int64_t groups, int32_t* acc) {
  for (int half = 0; half < 2; ++half) {
    const int8_t* wh = w + 2 * half * block_stride;
    int32_t* ah = acc + 32 * half;
    for (int i = 0; i < mb; i += 2) {
      if (mb - i >= 2)
        tile_avx2_m<2>(x + i * ldx, ldx, wh, block_stride, groups, ah + i * kGroupN);
      else
        tile_avx2_m<1>(x + i * ldx, ldx, wh, block_stride, groups, ah + i * kGroupN);
    }
  }
}

// MB rows x 4 blocks (64 channels): one zmm accumulator per row and block.
template <int MB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni_m(
    const int8_t* x, int64_t ldx, const int8_t* w, int64_t block_stride, int64_t groups, int32_t* acc) {
  __m512i sums[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) sums[i][j] = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_si512((const void*)(w + j * block_stride + g * kBlockBytes));
    for (int i = 0; i < MB; ++i) {
      const __m512i xv = _mm512_set1_epi32(load4(x + i * ldx + 4 * g));  // uint8 (x + 128)
      for (int j = 0; j < 4; ++j) sums[i][j] = _mm512_dpbusd_epi32(sums[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) _mm512_storeu_si512((void*)(acc + i * kGroupN + 16 * j), sums[i][j]);
}

void tile_vnni(const int8_t* x, int64_t ldx, int mb, const int8_t* w, int64_t block_stride,
               int64_t groups, int32_t* acc) {
  switch (mb) {
    case 1: tile_vnni_m<1>(x, ldx, w, block_stride, groups, acc); break;
    case 2: tile_vnni_m<2>(x, ldx, w, block_stride, groups, acc); break;
    case 3: tile_vnni_m<3>(x, ldx, w, block_stride, groups, acc); break;
    default: tile_vnni_m<4>(x, ldx, w, block_stride, groups, acc); break;
  }
}

#endif

TileFn tile_for(int64_t isa) {
#if defined(__x86_64__) || defined(__i386__)
  if (isa == kAvx512Vnni) return tile_vnni;
  if (isa == kAvx2) return tile_avx2;
#endif
  return tile_portable;
}

// Quantize row m of x (k values) into q (kp bytes, zero padded); returns its scale.
// With `shift`, bytes hold x + 128 as uint8 (the vpdpbusd layout); padding then holds 128,
// which meets zero weights and adds nothing.
float quantize_row(const float* x, int64_t k, int64_t kp, bool shift, int8_t* q) {
  float absmax = 0.f;
  for (int64_t i = 0; i < k; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  const float scale = absmax / 127.f;
  const float inv = absmax > 0.f ? 127.f / absmax : 0.f;
  const int offset = shift ? 128 : 0;
  for (int64_t i = 0; i < k; ++i) {
    const int v = int(std::nearbyint(x[i] * inv));
    q[i] = int8_t(uint8_t(std::clamp(v, -127, 127) + offset));
  }
  for (int64_t i = k; i < kp; ++i) q[i] = int8_t(uint8_t(offset));
  return scale;
}

}  // namespace

int64_t best_isa() {
  static const int64_t isa = detect_isa();
  return isa;
}

// x: (M, K) float32. w: packed int8, (Np / 16, Kp / 4, 16, 4) with Np % 64 == 0, Kp >= K.
// w_scale: (Np,) float32. w_sum: (Np,) int32, the row sums of W. bias: (N,) float32 or empty.
// Returns (M, N) float32, N = out_features.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, torch::Tensor w_sum,
                          torch::Tensor bias, int64_t out_features, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_linear: x must be (M, K) float32");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kChar && w.size(2) == kBlock && w.size(3) == 4 &&
                  w.size(0) % (kGroupN / kBlock) == 0 && w.is_contiguous(),
              "int8_linear: w must be packed int8 (Np / 16, Kp / 4, 16, 4) with Np % 64 == 0");
  const int64_t groups = w.size(1), kp = 4 * groups, n_out = out_features;
  TORCH_CHECK(x.size(1) <= kp && n_out <= w.size(0) * kBlock, "int8_linear: shapes do not match");
  TORCH_CHECK(isa >= kPortable && isa <= best_isa(), "int8_linear: this CPU cannot run isa ", isa);
  x = x.contiguous();
  const int64_t m_total = x.size(0), k = x.size(1);
  const bool shift = isa == kAvx512Vnni;
  auto out = torch::empty({m_total, n_out}, x.options());
  if (m_total == 0) return out;

  std::vector<int8_t> xq(m_total * kp);
  std::vector<float> xs(m_total);
  const float* x_ptr = x.data_ptr<float>();
  at::parallel_for(0, m_total, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) xs[m] = quantize_row(x_ptr + m * k, k, kp, shift, xq.data() + m * kp);
  });

  const int8_t* w_ptr = w.data_ptr<int8_t>();
  const int64_t block_stride = groups * kBlockBytes;
  const float* ws_ptr = w_scale.data_ptr<float>();
  const int32_t* wsum_ptr = w_sum.data_ptr<int32_t>();
  const float* b_ptr = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* o_ptr = out.data_ptr<float>();
  const TileFn tile = tile_for(isa);
  const int64_t n_tiles = (n_out + kGroupN - 1) / kGroupN;
  // Activation rows in chunks that stay in L2 while every weight tile passes over them.
  const int64_t m_chunk = std::max<int64_t>(kMaxM, (256 * 1024 / kp) / kMaxM * kMaxM);
  for (int64_t m0 = 0; m0 < m_total; m0 += m_chunk) {
    const int64_t m1 = std::min(m_total, m0 + m_chunk);
    at::parallel_for(0, n_tiles, 4, [&](int64_t t_begin, int64_t t_end) {
      int32_t acc[kMaxM * kGroupN];
      for (int64_t t = t_begin; t < t_end; ++t) {
        const int64_t n0 = t * kGroupN;
        const int64_t width = std::min<int64_t>(kGroupN, n_out - n0);
        for (int64_t m = m0; m < m1; m += kMaxM) {
          const int mb = int(std::min<int64_t>(kMaxM, m1 - m));
          tile(xq.data() + m * kp, kp, mb, w_ptr + (n0 / kBlock) * block_stride, block_stride, groups, acc);
          for (int i = 0; i < mb; ++i) {
            const float sx = xs[m + i];
            float* row = o_ptr + (m + i) * n_out + n0;
            for (int64_t c = 0; c < width; ++c) {
              const int64_t n = n0 + c;
              const int32_t sum = acc[i * kGroupN + c] - (shift ? 128 * wsum_ptr[n] : 0);
              const float y = float(sum) * sx * ws_ptr[n];
              row[c] = b_ptr ? y + b_ptr[n] : y;
            }
          }
        }
      }
    });
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "int8-weight linear layer with per-token int8 activations");
  m.def("best_isa", &best_isa, "0 portable, 1 avx2, 2 avx512_vnni: the best this CPU runs");
}
