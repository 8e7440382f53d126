// int8 weight x int8 activation linear layer on CPU: y = x @ W^T (+ bias).
//
// Both sides are quantized in blocks of 32 input channels (as llama.cpp's Q8_0):
//   W: int8 in [-127, 127] with one fp16 scale per output channel and block, packed once
//      into 16 output channels x 4 input channels (64 bytes):
//        qweight[n / 16][k / 4][n % 16][k % 4]   wscale[n / 16][k / 32][n % 16]
//      with N padded to a multiple of 32 and K to a multiple of 32 (zeros).
//   x: quantized here, per row and block, to int8 with a float scale (absmax / 127), or
//      to 7 bits (absmax / 63, see below).
// One 4-byte group of x, broadcast, meets a 64-byte weight group, so every lane sums one
// output channel in int32 and no horizontal sums are needed. After each block the int32
// sums are scaled into float accumulators:
//   y[m, n] = sum_b acc_b[m, n] * x_scale[m, b] * w_scale[n, b] (+ bias[n]).
// Per-token scales alone lose too much on models with outlier channels (Gemma: +9%
// perplexity); blocks of 32 keep int8 within 1% of float.
//
// Three code paths, chosen at run time from what the CPU reports (never assumed):
//   avx512_vnni  vpdpbusd: x is shifted to uint8 (x + 128); each block's sums start at
//                -128 x (the block's weight sum), which takes the shift back out.
//   avx2         vpmaddubsw / vpmaddwd with the sign trick: |x| times W carrying x's
//                sign, so no 16-bit pair sum can saturate (2 * 127 * 127 < 2^15).
//   portable     plain C++ loops; any CPU.
// The int32 block sums are identical on every path; only float rounding may differ.
//
// Activations in 7 bits (x_levels = 63, what encoders use: thousands of rows a call, so
// compute-bound): on AVX2, x + 64 is a uint8 in [1, 127] that vpmaddubsw multiplies as it
// is (2 * 127 * 127 < 2^15 again), without the sign trick's two extra instructions per
// multiply; each block's sums start at -64 x (the block's weight sum), which takes the
// shift back out. 4 rows share each weight load. The other paths take the same values
// in their own layout, so the int32 sums are still identical on every path.
#include "linear_common.h"

namespace {

using namespace linear;

constexpr int kGroupBytes = 64;  // one packed block x 4 input channels

// What a tile needs: x rows (quantized, `ldx` bytes apart) and their block scales (`ldxs`
// floats apart); the tile's first packed weight block, with blocks `stride` bytes apart;
// its block scales and block sums, 16 per block and quantization block, `sstride` apart.
struct Tile {
  const int8_t* x;
  int64_t ldx;
  const float* xs;
  int64_t ldxs;
  const int8_t* w;
  int64_t stride;
  const uint16_t* ws;
  const int16_t* wsum;
  int64_t sstride;
  int64_t qblocks;
};

// out[i * kTileN + c] for i < mb, c < kTileN.
using TileFn = void (*)(const Tile& t, int mb, float* out);

void tile_portable(const Tile& t, int mb, float* out) {
  for (int i = 0; i < mb; ++i) {
    const int8_t* xi = t.x + i * t.ldx;
    for (int blk = 0; blk < kTileN / kBlock; ++blk) {
      float acc[kBlock] = {0};
      const int8_t* wb = t.w + blk * t.stride;
      for (int64_t b = 0; b < t.qblocks; ++b) {
        int32_t sums[kBlock] = {0};
        for (int64_t g = b * (kQ / 4); g < (b + 1) * (kQ / 4); ++g) {
          const int8_t* wg = wb + g * kGroupBytes;
          for (int c = 0; c < kBlock; ++c)
            for (int q = 0; q < 4; ++q) sums[c] += int32_t(xi[4 * g + q]) * int32_t(wg[4 * c + q]);
        }
        const float sx = t.xs[i * t.ldxs + b];
        const uint16_t* scales = t.ws + blk * t.sstride + b * kBlock;
        for (int c = 0; c < kBlock; ++c) acc[c] += float(sums[c]) * (half_to_float(scales[c]) * sx);
      }
      std::memcpy(out + i * kTileN + blk * kBlock, acc, sizeof(acc));
    }
  }
}

#if defined(__x86_64__) || defined(__i386__)

// MB rows x one block (16 channels, 2 ymm).
template <int MB>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2_m(const Tile& t, const int8_t* x, const float* xs,
                                                          const int8_t* w, const uint16_t* ws, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < t.qblocks; ++b) {
    __m256i sums[MB][2];
    for (int i = 0; i < MB; ++i) sums[i][0] = sums[i][1] = _mm256_setzero_si256();
    for (int64_t g = b * (kQ / 4); g < (b + 1) * (kQ / 4); ++g) {
      const __m256i w0 = _mm256_loadu_si256((const __m256i*)(w + g * kGroupBytes));
      const __m256i w1 = _mm256_loadu_si256((const __m256i*)(w + g * kGroupBytes + 32));
      for (int i = 0; i < MB; ++i) {
        const __m256i xv = _mm256_set1_epi32(load4(x + i * t.ldx + 4 * g));
        const __m256i ax = _mm256_sign_epi8(xv, xv);
        sums[i][0] = _mm256_add_epi32(sums[i][0], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xv)), ones));
        sums[i][1] = _mm256_add_epi32(sums[i][1], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xv)), ones));
      }
    }
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ws + b * kBlock)));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ws + b * kBlock + 8)));
    for (int i = 0; i < MB; ++i) {
      const __m256 sx = _mm256_set1_ps(xs[i * t.ldxs + b]);
      acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i][0]), _mm256_mul_ps(s0, sx), acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i][1]), _mm256_mul_ps(s1, sx), acc[i][1]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    _mm256_storeu_ps(out + i * kTileN, acc[i][0]);
    _mm256_storeu_ps(out + i * kTileN + 8, acc[i][1]);
  }
}

void tile_avx2(const Tile& t, int mb, float* out) {
  for (int blk = 0; blk < kTileN / kBlock; ++blk) {
    const int8_t* w = t.w + blk * t.stride;
    const uint16_t* ws = t.ws + blk * t.sstride;
    for (int i = 0; i < mb; i += 2) {
      const int8_t* x = t.x + i * t.ldx;
      const float* xs = t.xs + i * t.ldxs;
      float* o = out + i * kTileN + blk * kBlock;
      if (mb - i >= 2)
        tile_avx2_m<2>(t, x, xs, w, ws, o);
      else
        tile_avx2_m<1>(t, x, xs, w, ws, o);
    }
  }
}

// MB rows x one block (16 channels), 7-bit activations stored as x + 64. A quantization
// block's int32 sums stay in registers (8 for 4 rows), its 8 groups unrolled; the empty
// asm after each add pins every row's sums to their own registers, so GCC adds each
// product into them in turn instead of summing the products as a tree, which spilled
// (and, not unrolled, copied every sum once a group). The float accumulators are
// updated once per block and written once.
template <int MB>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2_u7_m(const Tile& t, const int8_t* w, const uint16_t* ws,
                                                           const int16_t* wsum, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < t.qblocks; ++b) {
    const __m256i wsum0 = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i*)(wsum + b * kBlock)));
    const __m256i wsum1 = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i*)(wsum + b * kBlock + 8)));
    const __m256i start0 = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(wsum0, 6));
    const __m256i start1 = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(wsum1, 6));
    __m256i sums[MB][2];
    for (int i = 0; i < MB; ++i) sums[i][0] = start0, sums[i][1] = start1;
    const int8_t* wb = w + b * (kQ / 4) * kGroupBytes;
    const int8_t* xb = t.x + b * kQ;
#pragma GCC unroll 8
    for (int g = 0; g < kQ / 4; ++g) {
      const __m256i w0 = _mm256_loadu_si256((const __m256i*)(wb + g * kGroupBytes));
      const __m256i w1 = _mm256_loadu_si256((const __m256i*)(wb + g * kGroupBytes + 32));
      for (int i = 0; i < MB; ++i) {
        const __m256i xv = _mm256_set1_epi32(load4(xb + i * t.ldx + 4 * g));
        sums[i][0] = _mm256_add_epi32(sums[i][0], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, w0), ones));
        sums[i][1] = _mm256_add_epi32(sums[i][1], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, w1), ones));
        __asm__("" : "+x"(sums[i][0]), "+x"(sums[i][1]));
      }
    }
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ws + b * kBlock)));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ws + b * kBlock + 8)));
    for (int i = 0; i < MB; ++i) {
      const __m256 sx = _mm256_set1_ps(t.xs[i * t.ldxs + b]);
      acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i][0]), _mm256_mul_ps(s0, sx), acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i][1]), _mm256_mul_ps(s1, sx), acc[i][1]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    _mm256_storeu_ps(out + i * kTileN, acc[i][0]);
    _mm256_storeu_ps(out + i * kTileN + 8, acc[i][1]);
  }
}

void tile_avx2_u7(const Tile& t, int mb, float* out) {
  for (int blk = 0; blk < kTileN / kBlock; ++blk) {
    const int8_t* w = t.w + blk * t.stride;
    const uint16_t* ws = t.ws + blk * t.sstride;
    const int16_t* wsum = t.wsum + blk * t.sstride;
    float* o = out + blk * kBlock;
    switch (mb) {
      case 1: tile_avx2_u7_m<1>(t, w, ws, wsum, o); break;
      case 2: tile_avx2_u7_m<2>(t, w, ws, wsum, o); break;
      case 3: tile_avx2_u7_m<3>(t, w, ws, wsum, o); break;
      default: tile_avx2_u7_m<4>(t, w, ws, wsum, o); break;
    }
  }
}

// MB rows x 2 blocks (32 channels): one zmm of int32 sums and one of floats per row and block.
template <int MB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni_m(const Tile& t, float* out) {
  __m512 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < t.qblocks; ++b) {
    __m512i start[2];
    __m512 scale[2];
    for (int j = 0; j < 2; ++j) {
      const int64_t at = j * t.sstride + b * kBlock;
      const __m512i wsum = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i*)(t.wsum + at)));
      start[j] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(wsum, 7));
      scale[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(t.ws + at)));
    }
    __m512i sums[MB][2];
    for (int i = 0; i < MB; ++i) sums[i][0] = start[0], sums[i][1] = start[1];
    for (int64_t g = b * (kQ / 4); g < (b + 1) * (kQ / 4); ++g) {
      const __m512i w0 = _mm512_loadu_si512((const void*)(t.w + g * kGroupBytes));
      const __m512i w1 = _mm512_loadu_si512((const void*)(t.w + t.stride + g * kGroupBytes));
      for (int i = 0; i < MB; ++i) {
        const __m512i xv = _mm512_set1_epi32(load4(t.x + i * t.ldx + 4 * g));  // uint8 (x + 128)
        sums[i][0] = _mm512_dpbusd_epi32(sums[i][0], xv, w0);
        sums[i][1] = _mm512_dpbusd_epi32(sums[i][1], xv, w1);
      }
    }
    for (int i = 0; i < MB; ++i) {
      const __m512 sx = _mm512_set1_ps(t.xs[i * t.ldxs + b]);
      for (int j = 0; j < 2; ++j)
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i][j]), _mm512_mul_ps(scale[j], sx), acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    _mm512_storeu_ps(out + i * kTileN, acc[i][0]);
    _mm512_storeu_ps(out + i * kTileN + 16, acc[i][1]);
  }
}

void tile_vnni(const Tile& t, int mb, float* out) {
  switch (mb) {
    case 1: tile_vnni_m<1>(t, out); break;
    case 2: tile_vnni_m<2>(t, out); break;
    case 3: tile_vnni_m<3>(t, out); break;
    default: tile_vnni_m<4>(t, out); break;
  }
}

#endif

TileFn tile_for(int64_t isa, int64_t x_levels) {
#if defined(__x86_64__) || defined(__i386__)
  if (isa == kAvx512Vnni) return tile_vnni;
  if (isa == kAvx2) return x_levels == 63 ? tile_avx2_u7 : tile_avx2;
#endif
  return tile_portable;
}

// How each path wants the activations' bytes.
RowFormat row_format(int64_t isa, int64_t x_levels) {
  const int offset = isa == kAvx512Vnni ? 128 : isa == kAvx2 && x_levels == 63 ? 64 : 0;
  return RowFormat{int(x_levels), offset};
}

// int8_linear's checks (x made contiguous); returns Kp.
int64_t checked(at::Tensor& x, const at::Tensor& qweight, const at::Tensor& wscale, const at::Tensor& wsum,
                const at::Tensor& bias, int64_t n_out, int64_t isa, int64_t x_levels, const char* who) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, who, ": x must be (M, K) float32");
  TORCH_CHECK(qweight.dim() == 4 && qweight.scalar_type() == at::kChar && qweight.size(2) == kBlock &&
                  qweight.size(3) == 4 && qweight.size(0) % (kTileN / kBlock) == 0 &&
                  qweight.size(1) % (kQ / 4) == 0 && qweight.is_contiguous(),
              who, ": qweight must be packed int8 (Np / 16, Kp / 4, 16, 4), Np and Kp multiples of 32");
  const int64_t blocks = qweight.size(0), kp = 4 * qweight.size(1), qblocks = kp / kQ;
  TORCH_CHECK(wscale.scalar_type() == at::kHalf && wscale.is_contiguous() && wscale.numel() == blocks * qblocks * kBlock,
              who, ": wscale must be float16 (Np / 16, Kp / 32, 16)");
  TORCH_CHECK(wsum.scalar_type() == at::kShort && wsum.is_contiguous() && wsum.numel() == blocks * qblocks * kBlock,
              who, ": wsum must be int16 (Np / 16, Kp / 32, 16)");
  TORCH_CHECK(x.size(1) <= kp && n_out <= blocks * kBlock, who, ": shapes do not match");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == n_out),
              who, ": bias must be float32 (N,)");
  TORCH_CHECK(isa >= kPortable && isa <= best_isa(), who, ": this CPU cannot run isa ", isa);
  TORCH_CHECK(x_levels == 127 || x_levels == 63, who, ": x_levels must be 127 or 63");
  x = x.contiguous();
  return kp;
}

// x (checked) through the packed weights' tiles: into `out`, or only each row's tile maxima.
void run_packed(const at::Tensor& x, int64_t kp, const at::Tensor& qweight, const at::Tensor& wscale,
                const at::Tensor& wsum, const at::Tensor& bias, int64_t n_out, int64_t isa, int64_t x_levels,
                int64_t activation, float* out, const TileMaxima* maxima) {
  const int64_t qblocks = kp / kQ;
  Rows rows = make_rows(x.size(0), kp, /*with_sums=*/false);
  const int8_t* w_ptr = qweight.data_ptr<int8_t>();
  const auto* ws_ptr = reinterpret_cast<const uint16_t*>(wscale.data_ptr<at::Half>());
  const int16_t* wsum_ptr = wsum.data_ptr<int16_t>();
  const TileFn tile = tile_for(isa, x_levels);
  const int64_t stride = kp / 4 * kGroupBytes, sstride = qblocks * kBlock;
  quantize_and_run_tiles(
      x, row_format(isa, x_levels), rows, n_out, bias.numel() ? bias.data_ptr<float>() : nullptr, activation, out,
      [&](int64_t m, int mb, int64_t blk, float* acc) {
        const Tile tl{rows.q + m * kp, kp, rows.scale + m * qblocks, qblocks, w_ptr + blk * stride, stride,
                      ws_ptr + blk * sstride, wsum_ptr + blk * sstride, sstride, qblocks};
        tile(tl, mb, acc);
      },
      NoPrepare{}, Split{}, maxima);
}

}  // namespace

// x: (M, K) float32. qweight: (Np / 16, Kp / 4, 16, 4) int8; wscale: (Np / 16, Kp / 32, 16)
// float16; wsum: the same shape, int16, each block's weight sum. Np % 32 == 0, Kp % 32 == 0,
// Kp >= K. bias: (N,) float32 or empty. Returns (M, N) float32, N = out_features.
// x_levels: 127 (int8 activations) or 63 (7 bits). activation: kNoActivation, or kGelu
// (erf form) applied to each output after the bias. out: (M, N) float32 contiguous to
// write into, or empty to allocate one.
at::Tensor int8_linear(at::Tensor x, at::Tensor qweight, at::Tensor wscale, at::Tensor wsum,
                          at::Tensor bias, int64_t out_features, int64_t isa, int64_t x_levels,
                          int64_t activation, at::Tensor out) {
  const int64_t kp = checked(x, qweight, wscale, wsum, bias, out_features, isa, x_levels, "int8_linear");
  TORCH_CHECK(activation == kNoActivation || activation == kGelu, "int8_linear: unknown activation ", activation);
  out = output_for(x, out_features, out);
  if (x.size(0) == 0) return out;
  run_packed(x, kp, qweight, wscale, wsum, bias, out_features, isa, x_levels, activation, out.data_ptr<float>(),
             nullptr);
  return out;
}

// int8_linear(x, ...).argmax(-1) (int64 (M,)) without writing its outputs: as
// gguf_linear_argmax (linear_common.h's TileMaxima).
at::Tensor int8_linear_argmax(at::Tensor x, at::Tensor qweight, at::Tensor wscale, at::Tensor wsum, at::Tensor bias,
                              int64_t out_features, int64_t isa, int64_t x_levels) {
  const int64_t kp = checked(x, qweight, wscale, wsum, bias, out_features, isa, x_levels, "int8_linear_argmax");
  return argmax_through_maxima(x, out_features, [&](const TileMaxima* maxima) {
    run_packed(x, kp, qweight, wscale, wsum, bias, out_features, isa, x_levels, kNoActivation, nullptr, maxima);
  });
}
