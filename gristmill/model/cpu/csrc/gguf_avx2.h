// The AVX2 form of each GGUF format (gguf_blocks.h): a group of 256 weights loaded into
// registers once, as unsigned codes (or Q8_0's signed ones) and its scales, then met by
// each activation row of a tile. vpmaddubsw multiplies the unsigned codes by the int8
// activations (a pair sum is at most 2 * 63 * 127 < 2^15), vpmaddwd widens (by ones, or
// by Q6_K's 16-wide scales), and one horizontal-add tree (sum8) leaves lane j holding
// 32-block j's S_j, the same exact integer the portable path computes; the offsets come
// out as (offset x the activations' block sums). The float step is the portable path's
// operation for operation (one float accumulator per block position, fused multiply-
// adds, one final sum in a fixed order), so both paths give the same floats.
#pragma once

#include "gguf_blocks.h"

#if defined(__x86_64__) || defined(__i386__)

#define GGUF_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace gguf {
namespace avx2 {

// Lane j: the sum of v[j]'s eight lanes.
GGUF_AVX2 inline __m256i sum8(const __m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// (a0 + a4) + (a2 + a6) + ((a1 + a5) + (a3 + a7)): portable's row_total, in its order.
GGUF_AVX2 inline float total(__m256 acc) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// The fp16 scales of 8 blocks `stride` bytes apart, as floats.
GGUF_AVX2 inline __m256 block_scales(const uint8_t* p, int64_t stride) {
  uint16_t h[8];
  for (int j = 0; j < 8; ++j) std::memcpy(h + j, p + j * stride, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h));
}

GGUF_AVX2 inline __m256i load(const int8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
GGUF_AVX2 inline __m256i load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }

// 16 values of 4 bits in 16 bytes (low nibbles, then high nibbles), as 32 bytes.
GGUF_AVX2 inline __m256i nibbles(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128((const __m128i*)p);
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

// Byte k: 0x10 where bit k of `bits` is set, else 0.
GGUF_AVX2 inline __m256i bit_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i mask = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(0x10));
}

// Each 32-block's products, widened by ones: the sums of unsigned codes x activations.
GGUF_AVX2 inline __m256i code_sums(const __m256i q[8], const int8_t* x) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i v[8];
  for (int j = 0; j < 8; ++j) v[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], load(x + 32 * j)), ones);
  return sum8(v);
}

// The activations' sum over each 32-block, from their sums over each 16.
GGUF_AVX2 inline __m256i block_sums(const int16_t* x16) {
  return _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)x16), _mm256_set1_epi16(1));
}

struct Q8_0 {
  static constexpr int kBlockSize = 32, kBlockBytes = 34, kBytes = kBlockBytes;
  static constexpr bool kHasMin = false;
  __m256i q[8];
  __m256 d, min;
  GGUF_AVX2 void load_group(const uint8_t* p) {
    for (int j = 0; j < 8; ++j) q[j] = load(p + j * kBytes + 2);
    d = block_scales(p, kBytes);
  }
  // Signed codes: |q| times x carrying q's sign (2 * 128 * 127 < 2^15).
  GGUF_AVX2 __m256i sums(const int8_t* x, const int16_t*) const {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i v[8];
    for (int j = 0; j < 8; ++j) {
      const __m256i xv = load(x + 32 * j);
      v[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q[j]), _mm256_sign_epi8(xv, q[j])), ones);
    }
    return sum8(v);
  }
};

struct Q4_0 {
  static constexpr int kBlockSize = 32, kBlockBytes = 18, kBytes = kBlockBytes;
  static constexpr bool kHasMin = false;
  __m256i q[8];
  __m256 d, min;
  GGUF_AVX2 void load_group(const uint8_t* p) {
    for (int j = 0; j < 8; ++j) q[j] = nibbles(p + j * kBytes + 2);
    d = block_scales(p, kBytes);
  }
  GGUF_AVX2 __m256i sums(const int8_t* x, const int16_t* x16) const {  // codes q - 8
    return _mm256_sub_epi32(code_sums(q, x), _mm256_slli_epi32(block_sums(x16), 3));
  }
};

struct Q5_0 {
  static constexpr int kBlockSize = 32, kBlockBytes = 22, kBytes = kBlockBytes;
  static constexpr bool kHasMin = false;
  __m256i q[8];
  __m256 d, min;
  GGUF_AVX2 void load_group(const uint8_t* p) {
    for (int j = 0; j < 8; ++j) {
      const uint8_t* b = p + j * kBytes;
      q[j] = _mm256_or_si256(nibbles(b + 6), bit_bytes(u32_at(b + 2)));
    }
    d = block_scales(p, kBytes);
  }
  GGUF_AVX2 __m256i sums(const int8_t* x, const int16_t* x16) const {  // codes q - 16
    return _mm256_sub_epi32(code_sums(q, x), _mm256_slli_epi32(block_sums(x16), 4));
  }
};

// Q4_K, and with kFifthBit Q5_K: integer scales applied to each block's code sums
// (vpmulld, once a row), minimums as floats.
template <bool kFifthBit>
struct QK4 {
  static constexpr int kBlockSize = 256, kBlockBytes = kFifthBit ? 176 : 144;
  static constexpr bool kHasMin = true;
  __m256i q[8], scale;
  __m256 d, min;
  GGUF_AVX2 void load_group(const uint8_t* p) {
    alignas(16) uint8_t sm[16];
    k_scales(p + 4, sm);
    const __m128i s = _mm_load_si128((const __m128i*)sm);
    scale = _mm256_cvtepu8_epi32(s);
    d = _mm256_set1_ps(fp16_at(p));
    min = _mm256_mul_ps(_mm256_set1_ps(fp16_at(p + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(s, 8))));
    const uint8_t* qs = p + (kFifthBit ? 48 : 16);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = load(qs + 32 * i);
      q[2 * i] = _mm256_and_si256(v, low4);
      q[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    if (kFifthBit) {
      const __m256i qh = load(p + 16);
      const __m256i bit4 = _mm256_set1_epi8(0x10);
      // bit j of each byte, moved to bit 4 (16-bit shifts: a byte's bits never cross into the next's kept ones)
      q[0] = _mm256_or_si256(q[0], _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit4));
      q[1] = _mm256_or_si256(q[1], _mm256_and_si256(_mm256_slli_epi16(qh, 3), bit4));
      q[2] = _mm256_or_si256(q[2], _mm256_and_si256(_mm256_slli_epi16(qh, 2), bit4));
      q[3] = _mm256_or_si256(q[3], _mm256_and_si256(_mm256_slli_epi16(qh, 1), bit4));
      q[4] = _mm256_or_si256(q[4], _mm256_and_si256(qh, bit4));
      q[5] = _mm256_or_si256(q[5], _mm256_and_si256(_mm256_srli_epi16(qh, 1), bit4));
      q[6] = _mm256_or_si256(q[6], _mm256_and_si256(_mm256_srli_epi16(qh, 2), bit4));
      q[7] = _mm256_or_si256(q[7], _mm256_and_si256(_mm256_srli_epi16(qh, 3), bit4));
    }
  }
  GGUF_AVX2 __m256i sums(const int8_t* x, const int16_t*) const {
    return _mm256_mullo_epi32(code_sums(q, x), scale);
  }
};

// Q6_K: codes q + 32 in [0, 63]; each 32-block's products widened by its two 16-wide
// scales (low 128 bits: scale 2j, high: 2j + 1), and 32 x (scales . the activations'
// 16-sums) taken out.
struct Q6_K {
  static constexpr int kBlockSize = 256, kBlockBytes = 210;
  static constexpr bool kHasMin = false;
  __m256i q[8], scale[8], scale16;
  __m256 d, min;
  GGUF_AVX2 void load_group(const uint8_t* p) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), high2 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load(p + 64 * h), l1 = load(p + 64 * h + 32), qh = load(p + 128 + 32 * h);
      __m256i* out = q + 4 * h;
      out[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), high2));
      out[1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), high2));
      out[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(qh, high2));
      out[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), high2));
    }
    scale16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 192)));
    const __m256i first = _mm256_permute4x64_epi64(scale16, 0x44), second = _mm256_permute4x64_epi64(scale16, 0xee);
    for (int j = 0; j < 8; ++j) {
      const int b = 4 * (j % 4);  // the byte of scale 2j within its 128-bit half
      const __m256i pick = _mm256_setr_m128i(_mm_set1_epi16(short(b | (b + 1) << 8)),
                                             _mm_set1_epi16(short((b + 2) | (b + 3) << 8)));
      scale[j] = _mm256_shuffle_epi8(j < 4 ? first : second, pick);
    }
    d = _mm256_set1_ps(fp16_at(p + 208));
  }
  GGUF_AVX2 __m256i sums(const int8_t* x, const int16_t* x16) const {
    __m256i v[8];
    for (int j = 0; j < 8; ++j) v[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], load(x + 32 * j)), scale[j]);
    const __m256i offset = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)x16), scale16);
    return _mm256_sub_epi32(sum8(v), _mm256_slli_epi32(offset, 5));
  }
};

}  // namespace avx2
}  // namespace gguf

#endif
