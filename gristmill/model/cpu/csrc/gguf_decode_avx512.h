// The formats' groups in zmm registers, for reading tiles from the file's bytes on
// avx512_vnni (gguf_x86.h's rows_m): each vector q[k] holds 32-blocks 2k (low 256 bits)
// and 2k + 1 (high), so a group takes 4 vpdpbusd where ymm takes 8, and one reduction
// (sum4) leaves lane j of a ymm holding S_j. The same integers as the ymm formats', and
// the same scale, min and float steps.
//
// Included by gguf_x86.h inside its namespace, on avx512_vnni only.

// Lane j: block j's S_j, from v[k] holding blocks 2k (lanes 0-7) and 2k + 1 (8-15).
GGUF_TARGET inline __m256i sum4(const __m512i v[4]) {
  // chunks [2k, 2k, 2k + 1, 2k + 1] -> one chunk a block: [0, 1, 2, 3] and [4, 5, 6, 7]
  const __m512i s1 = _mm512_add_epi32(_mm512_shuffle_i32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_i32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i s2 = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2], v[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_i32x4(v[2], v[3], _MM_SHUFFLE(3, 1, 3, 1)));
  // chunk c: [c, c + 4, c, c + 4] partial sums, then [c, c + 4] whole
  const __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi32(s1, s2), _mm512_unpackhi_epi32(s1, s2));
  const __m512i u = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, u));
}

// 4 activation bytes of each lane against `codes` (unsigned), for each 64 of x.
GGUF_TARGET inline __m256i dot_group(const __m512i q[4], const int8_t* x) {
  __m512i v[4];
  for (int k = 0; k < 4; ++k) v[k] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[k], _mm512_loadu_si512(x + 64 * k));
  return sum4(v);
}

// Each half's 16-bit lanes shifted left by its own count (negative: right).
GGUF_TARGET inline __m512i shift_halves(__m512i v, int low, int high) {
  if (low >= 0 && high >= 0)
    return _mm512_sllv_epi16(v, _mm512_inserti64x4(_mm512_set1_epi16(short(low)), _mm256_set1_epi16(short(high)), 1));
  return _mm512_srlv_epi16(v, _mm512_inserti64x4(_mm512_set1_epi16(short(-low)), _mm256_set1_epi16(short(-high)), 1));
}

GGUF_TARGET inline __m512i both_halves(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p));
}

// Q8_0: codes + 128 (vpdpbusd's unsigned side), the 128 x each block's activation sum
// taken back out.
struct Q8_0Z {
  static constexpr int kBlockSize = 32, kBlockBytes = 34;
  static constexpr bool kHasMin = false;
  __m512i q[4];
  __m256 scale, min;
  GGUF_TARGET void load_group(const uint8_t* p) {
    const __m512i flip = _mm512_set1_epi8(char(0x80));
    for (int k = 0; k < 4; ++k) {
      const uint8_t* b = p + 2 * k * kBlockBytes + 2;
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(load(b)), load(b + kBlockBytes), 1);
      q[k] = _mm512_xor_si512(both, flip);
    }
    scale = block_scales(p, kBlockBytes);
  }
  GGUF_TARGET __m256i block_sums(const int8_t* x, const int16_t* x16) const {
    return _mm256_add_epi32(dot_group(q, x), offset_sums<128>(x16));
  }
};

// Q4_0, Q5_0: a block's 16 bytes of nibbles in two 128-bit chunks, low nibbles then high.
template <bool kFifthBit>
struct Q4_0Z {
  static constexpr int kBlockSize = 32, kBlockBytes = kFifthBit ? 22 : 18, kOffset = kFifthBit ? 16 : 8;
  static constexpr bool kHasMin = false;
  __m512i q[4];
  __m256 scale, min;
  GGUF_TARGET void load_group(const uint8_t* p) {
    constexpr int kCodes = kFifthBit ? 6 : 2;
    const __m512i nibble_shift = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4), low4 = _mm512_set1_epi8(0x0f);
    for (int k = 0; k < 4; ++k) {
      const uint8_t* b = p + 2 * k * kBlockBytes;
      const __m512i bytes = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(b + kCodes))),
                                                        0xff00, _mm_loadu_si128((const __m128i*)(b + kBlockBytes + kCodes)));
      q[k] = _mm512_and_si512(_mm512_srlv_epi64(bytes, nibble_shift), low4);
      if (kFifthBit) {  // bit l of a block's 32-bit qh: value l's fifth bit
        const uint64_t bits = u32_at(b + 2) | uint64_t(u32_at(b + kBlockBytes + 2)) << 32;
        q[k] = _mm512_or_si512(q[k], _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(0x10)));
      }
    }
    scale = block_scales(p, kBlockBytes);
  }
  GGUF_TARGET __m256i block_sums(const int8_t* x, const int16_t* x16) const {
    return _mm256_add_epi32(dot_group(q, x), offset_sums<kOffset>(x16));
  }
};

// Q4_K, Q5_K: 32 bytes of nibbles hold blocks 2k (low) and 2k + 1 (high): both halves
// of q[k] from one broadcast, shifted by 0 and 4.
template <bool kFifthBit>
struct Q4_KZ {
  static constexpr int kBlockSize = 256, kBlockBytes = kFifthBit ? 176 : 144;
  static constexpr bool kHasMin = true;
  __m512i q[4];
  __m256 scale, min;
  GGUF_TARGET void load_group(const uint8_t* p) {
    k_scale_min_x86(p, scale, min);
    const uint8_t* qs = p + (kFifthBit ? 48 : 16);
    const __m512i low4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    const __m512i qh = kFifthBit ? both_halves(p + 16) : _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k) {
      q[k] = _mm512_and_si512(shift_halves(both_halves(qs + 32 * k), 0, -4), low4);
      if (kFifthBit)  // bits 2k, 2k + 1 of each byte to bit 4
        q[k] = _mm512_or_si512(q[k], _mm512_and_si512(shift_halves(qh, 4 - 2 * k, 3 - 2 * k), bit4));
    }
  }
  GGUF_TARGET __m256i block_sums(const int8_t* x, const int16_t*) const { return dot_group(q, x); }
};

// vpshufb's indices that put byte i in the high byte of each of 4 16-bit lanes (low: 0).
constexpr int64_t pick_high(int i) { return int64_t(0x0100010001000100ull * uint64_t(i) | 0x0080008000800080ull); }

// Q6_K: 64 low bytes hold blocks 4h, 4h + 1 (low nibbles) and 4h + 2, 4h + 3 (high); a
// block's lanes are widened by their 16-wide scales (one a 128-bit chunk) as vpmaddwd
// widens them.
struct Q6_KZ {
  static constexpr int kBlockSize = 256, kBlockBytes = 210;
  static constexpr bool kHasMin = false;
  __m512i q[4], lane_scale[4];
  __m256 scale, min;
  const uint8_t* scales;
  GGUF_TARGET void load_group(const uint8_t* p) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), high2 = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m512i low = _mm512_loadu_si512(p + 64 * h), high = both_halves(p + 128 + 32 * h);
      q[2 * h] = _mm512_or_si512(_mm512_and_si512(low, low4), _mm512_and_si512(shift_halves(high, 4, 2), high2));
      q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), low4),
                                     _mm512_and_si512(shift_halves(high, 0, -2), high2));
    }
    // scale 4k + c to every 16-bit lane of chunk c: its byte to each lane's high byte, then sign-extended
    scales = p + 192;
    const __m512i all = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)scales));
    for (int k = 0; k < 4; ++k) {
      const __m512i pick = _mm512_set_epi64(pick_high(4 * k + 3), pick_high(4 * k + 3), pick_high(4 * k + 2),
                                            pick_high(4 * k + 2), pick_high(4 * k + 1), pick_high(4 * k + 1),
                                            pick_high(4 * k), pick_high(4 * k));
      lane_scale[k] = _mm512_srai_epi16(_mm512_shuffle_epi8(all, pick), 8);
    }
    scale = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(u16_at(p + 208))));
  }
  GGUF_TARGET __m256i block_sums(const int8_t* x, const int16_t* x16) const {
    __m512i v[4];
    for (int k = 0; k < 4; ++k)
      v[k] = _mm512_madd_epi16(_mm512_maddubs_epi16(q[k], _mm512_loadu_si512(x + 64 * k)), lane_scale[k]);
    const __m256i scale16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)scales));
    const __m256i offsets = _mm256_madd_epi16(load(x16), scale16);  // per block: scales . 16-sums
    return _mm256_sub_epi32(sum4(v), _mm256_slli_epi32(offsets, 5));
  }
};
