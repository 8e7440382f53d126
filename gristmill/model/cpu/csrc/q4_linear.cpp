// 4-bit weight x int8 activation linear layer on CPU: y = x @ W^T (+ bias).
//
// W is quantized in blocks of 32 input channels to unsigned 4-bit values q in [0, 15]
// with an fp16 scale and minimum per output channel and block (as llama.cpp's Q4_1):
// w = scale * q + min. Half the bytes of int8, and at batch 1 a linear layer is bound by
// the bytes of its weights. Packed once into 16 output channels x 4 input channels in 32
// bytes, channels 0-7 in the low nibbles and 8-15 in the high nibbles:
//   qweight[n / 16][k / 4][4 * (n % 8) + k % 4]   (bits 4 * (n % 16 / 8) and up)
//   wscale[n / 16][k / 32][n % 16]   wmin: the same
// with N and K padded to multiples of 32. x is quantized per row and block to int8 (see
// linear_common.h). Per block b:
//   y[m, n] += x_scale[m, b] * (w_scale[n, b] * sum_k q[n, k] x_q[m, k]
//                               + w_min[n, b] * sum_k x_q[m, k])
// q is unsigned and x_q signed, the operand order of vpmaddubsw: no sign trick. A pair
// sum is at most 2 * 15 * 127 and a block's 16 pair sums at most 30480, so the int16
// sums of a whole block cannot overflow and are widened once a block.
//
// Code paths, chosen at run time: avx2 (on AVX-512 machines too) and portable. The
// int32 block sums are identical on both; only float rounding may differ.
#include "linear_common.h"

namespace {

using namespace linear;

constexpr int kGroupBytes = 32;  // one packed block x 4 input channels, two per byte

struct Tile {
  const int8_t* x;   // quantized rows, `ldx` bytes apart
  int64_t ldx;
  const float* xs;   // their block scales, `ldxs` apart
  const float* xss;  // their block scale x block sum
  int64_t ldxs;
  const uint8_t* w;  // the tile's first packed block; the next is `stride` bytes on
  int64_t stride;
  const uint16_t* ws;  // block scales and minimums, 16 per block, `sstride` apart
  const uint16_t* wm;
  int64_t sstride;
  int64_t qblocks;
};

using TileFn = void (*)(const Tile& t, int mb, float* out);

void tile_portable(const Tile& t, int mb, float* out) {
  for (int i = 0; i < mb; ++i) {
    const int8_t* xi = t.x + i * t.ldx;
    for (int blk = 0; blk < kTileN / kBlock; ++blk) {
      float acc[kBlock] = {0};
      const uint8_t* wb = t.w + blk * t.stride;
      for (int64_t b = 0; b < t.qblocks; ++b) {
        int32_t sums[kBlock] = {0};
        for (int64_t g = b * (kQ / 4); g < (b + 1) * (kQ / 4); ++g) {
          const uint8_t* wg = wb + g * kGroupBytes;
          for (int j = 0; j < kGroupBytes; ++j) {
            const int32_t xv = xi[4 * g + j % 4];
            sums[j / 4] += int32_t(wg[j] & 15) * xv;
            sums[8 + j / 4] += int32_t(wg[j] >> 4) * xv;
          }
        }
        const float sx = t.xs[i * t.ldxs + b], sxs = t.xss[i * t.ldxs + b];
        const uint16_t* scales = t.ws + blk * t.sstride + b * kBlock;
        const uint16_t* mins = t.wm + blk * t.sstride + b * kBlock;
        for (int c = 0; c < kBlock; ++c)
          acc[c] += float(sums[c]) * (half_to_float(scales[c]) * sx) + half_to_float(mins[c]) * sxs;
      }
      std::memcpy(out + i * kTileN + blk * kBlock, acc, sizeof(acc));
    }
  }
}

#if defined(__x86_64__) || defined(__i386__)

// MB rows x one block (16 channels, 2 ymm).
template <int MB>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2_m(const Tile& t, const int8_t* x, const float* xs,
                                                          const float* xss, const uint8_t* w, const uint16_t* ws,
                                                          const uint16_t* wm, float* out) {
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0f);
  __m256 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < t.qblocks; ++b) {
    __m256i sums[MB][2];
    for (int i = 0; i < MB; ++i) sums[i][0] = sums[i][1] = _mm256_setzero_si256();
    for (int64_t g = b * (kQ / 4); g < (b + 1) * (kQ / 4); ++g) {
      const __m256i packed = _mm256_loadu_si256((const __m256i*)(w + g * kGroupBytes));
      const __m256i w0 = _mm256_and_si256(packed, nibble);
      const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
      for (int i = 0; i < MB; ++i) {
        const __m256i xv = _mm256_set1_epi32(load4(x + i * t.ldx + 4 * g));
        sums[i][0] = _mm256_add_epi16(sums[i][0], _mm256_maddubs_epi16(w0, xv));
        sums[i][1] = _mm256_add_epi16(sums[i][1], _mm256_maddubs_epi16(w1, xv));
      }
    }
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ws + b * kBlock)));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ws + b * kBlock + 8)));
    const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(wm + b * kBlock)));
    const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(wm + b * kBlock + 8)));
    for (int i = 0; i < MB; ++i) {
      const __m256 sx = _mm256_set1_ps(xs[i * t.ldxs + b]), sxs = _mm256_set1_ps(xss[i * t.ldxs + b]);
      const __m256 d0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[i][0], ones));
      const __m256 d1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[i][1], ones));
      acc[i][0] = _mm256_fmadd_ps(m0, sxs, _mm256_fmadd_ps(d0, _mm256_mul_ps(s0, sx), acc[i][0]));
      acc[i][1] = _mm256_fmadd_ps(m1, sxs, _mm256_fmadd_ps(d1, _mm256_mul_ps(s1, sx), acc[i][1]));
    }
  }
  for (int i = 0; i < MB; ++i) {
    _mm256_storeu_ps(out + i * kTileN, acc[i][0]);
    _mm256_storeu_ps(out + i * kTileN + 8, acc[i][1]);
  }
}

void tile_avx2(const Tile& t, int mb, float* out) {
  for (int blk = 0; blk < kTileN / kBlock; ++blk) {
    const uint8_t* w = t.w + blk * t.stride;
    const uint16_t* ws = t.ws + blk * t.sstride;
    const uint16_t* wm = t.wm + blk * t.sstride;
    for (int i = 0; i < mb; i += 2) {
      const int8_t* x = t.x + i * t.ldx;
      float* o = out + i * kTileN + blk * kBlock;
      if (mb - i >= 2)
        tile_avx2_m<2>(t, x, t.xs + i * t.ldxs, t.xss + i * t.ldxs, w, ws, wm, o);
      else
        tile_avx2_m<1>(t, x, t.xs + i * t.ldxs, t.xss + i * t.ldxs, w, ws, wm, o);
    }
  }
}

#endif

TileFn tile_for(int64_t isa) {
#if defined(__x86_64__) || defined(__i386__)
  if (isa >= kAvx2) return tile_avx2;
#endif
  return tile_portable;
}

}  // namespace

// x: (M, K) float32. qweight: (Np / 16, Kp / 4, 32) uint8; wscale, wmin: (Np / 16, Kp / 32, 16)
// float16. Np % 32 == 0, Kp % 32 == 0, Kp >= K. bias: (N,) float32 or empty. Returns (M, N)
// float32, N = out_features, written into `out` when it is not empty. activation: as
// int8_linear's.
at::Tensor q4_linear(at::Tensor x, at::Tensor qweight, at::Tensor wscale, at::Tensor wmin,
                        at::Tensor bias, int64_t out_features, int64_t isa, int64_t activation, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q4_linear: x must be (M, K) float32");
  TORCH_CHECK(qweight.dim() == 3 && qweight.scalar_type() == at::kByte && qweight.size(2) == kGroupBytes &&
                  qweight.size(0) % (kTileN / kBlock) == 0 && qweight.size(1) % (kQ / 4) == 0 &&
                  qweight.is_contiguous(),
              "q4_linear: qweight must be packed uint8 (Np / 16, Kp / 4, 32), Np and Kp multiples of 32");
  const int64_t blocks = qweight.size(0), groups = qweight.size(1), kp = 4 * groups, qblocks = kp / kQ;
  for (const auto& t : {wscale, wmin})
    TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.numel() == blocks * qblocks * kBlock,
                "q4_linear: wscale and wmin must be float16 (Np / 16, Kp / 32, 16)");
  const int64_t n_out = out_features;
  TORCH_CHECK(x.size(1) <= kp && n_out <= blocks * kBlock, "q4_linear: shapes do not match");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == n_out),
              "q4_linear: bias must be float32 (N,)");
  TORCH_CHECK(isa >= kPortable && isa <= best_isa(), "q4_linear: this CPU cannot run isa ", isa);
  TORCH_CHECK(activation == kNoActivation || activation == kGelu, "q4_linear: unknown activation ", activation);
  x = x.contiguous();
  out = output_for(x, n_out, out);
  if (x.size(0) == 0) return out;

  Rows rows = make_rows(x.size(0), kp, /*with_sums=*/true);
  const uint8_t* w_ptr = qweight.data_ptr<uint8_t>();
  const auto* ws_ptr = reinterpret_cast<const uint16_t*>(wscale.data_ptr<at::Half>());
  const auto* wm_ptr = reinterpret_cast<const uint16_t*>(wmin.data_ptr<at::Half>());
  const TileFn tile = tile_for(isa);
  const int64_t stride = groups * kGroupBytes, sstride = qblocks * kBlock;
  quantize_and_run_tiles(x, RowFormat{}, rows, n_out, bias.numel() ? bias.data_ptr<float>() : nullptr, activation,
                         out.data_ptr<float>(), [&](int64_t m, int mb, int64_t blk, float* acc) {
                           const Tile tl{rows.q + m * kp, kp, rows.scale + m * qblocks,
                                         rows.scaled_sum + m * qblocks, qblocks, w_ptr + blk * stride, stride,
                                         ws_ptr + blk * sstride, wm_ptr + blk * sstride, sstride, qblocks};
                           tile(tl, mb, acc);
                         });
  return out;
}
