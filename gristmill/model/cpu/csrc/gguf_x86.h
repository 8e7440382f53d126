// The x86 kernels of the GGUF formats (gguf_blocks.h), written once and compiled twice
// by gguf_linear.cpp: GGUF_NS avx2 (AVX2 + FMA + F16C) and avx512_vnni (the same with
// vpdpbusd in place of vpmaddubsw + vpmaddwd, and 32 vector registers).
//
// Two ways through a tile, giving the same floats (gguf_blocks.h's order):
// - from the file's bytes (few activation rows: decode): each row's group of 256 weights
//   is loaded into registers once, as codes (unsigned, or Q8_0's signed) and scales, and
//   met by each activation row; a 32-bit lane sums 4 products (a 16-bit pair sum of
//   vpmaddubsw is at most 2 * 63 * 127 < 2^15), and a horizontal-add tree (sum8) leaves
//   lane j holding block j's S_j. avx512_vnni holds a group in zmm registers instead
//   (gguf_decode_avx512.h: half the multiplies and a shorter tree), and each row asks
//   for its bytes ahead of reading them (kAhead).
// - from panels (many rows, gguf_panels_x86.h): the tile's rows are packed once (codes
//   transposed so that each 32-bit lane is one output row), then every activation row
//   meets them, 4 activations broadcast at a time and no horizontal sums.
//
// Expects GGUF_NS, GGUF_TARGET and GGUF_VNNI (0 or 1) defined; undefines them.

namespace gguf {
namespace GGUF_NS {

GGUF_TARGET inline __m256i load(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }

// acc + (unsigned codes . signed x), 4 products a 32-bit lane.
GGUF_TARGET inline __m256i dot_u8(__m256i acc, __m256i codes, __m256i x) {
#if GGUF_VNNI
  return _mm256_dpbusd_epi32(acc, codes, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1)));
#endif
}

// acc + (signed codes . signed x): |codes| times x carrying their sign (2 * 128 * 127 < 2^15).
GGUF_TARGET inline __m256i dot_s8(__m256i acc, __m256i codes, __m256i x) {
  return dot_u8(acc, _mm256_abs_epi8(codes), _mm256_sign_epi8(x, codes));
}

// Lane j: the sum of v[j]'s eight lanes.
GGUF_TARGET inline __m256i sum8(const __m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)): gguf_blocks.h's order.
GGUF_TARGET inline float total(__m256 acc) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// Rows r[0..7] of 8 dwords into columns: out[c] lane i = r[i] dword c.
GGUF_TARGET inline void transpose8(const __m256i r[8], __m256i out[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    out[c] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x20);
    out[c + 4] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x31);
  }
}

// The fp16 scales of 8 blocks `stride` bytes apart, as floats (loaded one by one: a
// gather of them made Q4_0 and Q5_0 at one activation row 1.2-1.5x slower).
GGUF_TARGET inline __m256 block_scales(const uint8_t* p, int64_t stride) {
  __m128i h = _mm_setzero_si128();
  h = _mm_insert_epi16(h, u16_at(p), 0);
  h = _mm_insert_epi16(h, u16_at(p + stride), 1);
  h = _mm_insert_epi16(h, u16_at(p + 2 * stride), 2);
  h = _mm_insert_epi16(h, u16_at(p + 3 * stride), 3);
  h = _mm_insert_epi16(h, u16_at(p + 4 * stride), 4);
  h = _mm_insert_epi16(h, u16_at(p + 5 * stride), 5);
  h = _mm_insert_epi16(h, u16_at(p + 6 * stride), 6);
  h = _mm_insert_epi16(h, u16_at(p + 7 * stride), 7);
  return _mm256_cvtph_ps(h);
}

// 16 values of 4 bits in 16 bytes (low nibbles, then high nibbles), as 32 bytes.
GGUF_TARGET inline __m256i nibbles(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128((const __m128i*)p);
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

// Byte k: 0x10 where bit k of `bits` is set, else 0.
GGUF_TARGET inline __m256i bit_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i mask = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(0x10));
}

// k_scales (gguf_blocks.h) in registers: bytes sc[0..7], then m[0..7]. `s` is read 16
// bytes wide (the 12 bytes of scales, then 4 of the block's codes).
GGUF_TARGET inline __m128i k_scales_x86(const uint8_t* s) {
  const __m128i v = _mm_loadu_si128((const __m128i*)s);  // 32-bit words lo, mid, hi, -
  const __m128i low = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
  const __m128i top = _mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 2);
  return _mm_or_si128(_mm_and_si128(low, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f)),
                      _mm_and_si128(top, _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
}

// A Q4_K / Q5_K block's 8 sub-block scales and mins as floats: d x scale, dmin x min.
GGUF_TARGET inline void k_scale_min_x86(const uint8_t* p, __m256& scale, __m256& min) {
  const __m128i s = k_scales_x86(p + 4);
  const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(int(u32_at(p))));  // d, dmin
  scale = _mm256_mul_ps(_mm256_broadcastss_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(s)));
  min = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(d)),
                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(s, 8))));
}

// -offset x each 32-block's activation sum (lane j), from the sums of each 16.
template <int kOffset>
GGUF_TARGET inline __m256i offset_sums(const int16_t* x16) {
  const __m256i sums = _mm256_madd_epi16(load(x16), _mm256_set1_epi16(1));
  static_assert((kOffset & (kOffset - 1)) == 0, "a power of two: a shift multiplies by it");
  return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, __builtin_ctz(kOffset)));
}

// Each format: load_group(p) (a whole group: 8 blocks, or one super-block) into codes
// q[8] and float `scale` and `min` per block; block_sums(x, x16), each block's S_j (lane
// j) against the group's activations; kOffset, kSplit16 (lane scales per 16: Q6_K),
// kSigned (Q8_0's signed codes) and kCodeMax (the largest code, Q8_0's as |code|) for
// the panels.

struct Q8_0 {
  static constexpr int kBlockSize = 32, kBlockBytes = 34, kOffset = 0, kCodeMax = 128;
  static constexpr bool kHasMin = false, kSplit16 = false, kSigned = true;
  __m256i q[8];
  __m256 scale, min;
  GGUF_TARGET void load_group(const uint8_t* p) {
    for (int j = 0; j < 8; ++j) q[j] = load(p + j * kBlockBytes + 2);
    scale = block_scales(p, kBlockBytes);
  }
  GGUF_TARGET __m256i block_sums(const int8_t* x, const int16_t*) const {
    __m256i v[8];
    for (int j = 0; j < 8; ++j) v[j] = dot_s8(_mm256_setzero_si256(), q[j], load(x + 32 * j));
    return sum8(v);
  }
};

template <bool kFifthBit>
struct Q4_0 {  // and Q5_0
  static constexpr int kBlockSize = 32, kBlockBytes = kFifthBit ? 22 : 18, kOffset = kFifthBit ? 16 : 8;
  static constexpr int kCodeMax = kFifthBit ? 31 : 15;
  static constexpr bool kHasMin = false, kSplit16 = false, kSigned = false;
  __m256i q[8];
  __m256 scale, min;
  GGUF_TARGET void load_group(const uint8_t* p) {
    for (int j = 0; j < 8; ++j) {
      const uint8_t* b = p + j * kBlockBytes;
      q[j] = kFifthBit ? _mm256_or_si256(nibbles(b + 6), bit_bytes(u32_at(b + 2))) : nibbles(b + 2);
    }
    scale = block_scales(p, kBlockBytes);
  }
  GGUF_TARGET __m256i block_sums(const int8_t* x, const int16_t* x16) const {
    __m256i v[8];
    for (int j = 0; j < 8; ++j) v[j] = dot_u8(_mm256_setzero_si256(), q[j], load(x + 32 * j));
    return _mm256_add_epi32(sum8(v), offset_sums<kOffset>(x16));
  }
};

template <bool kFifthBit>
struct Q4_K {  // and Q5_K
  static constexpr int kBlockSize = 256, kBlockBytes = kFifthBit ? 176 : 144, kOffset = 0;
  static constexpr int kCodeMax = kFifthBit ? 31 : 15;
  static constexpr bool kHasMin = true, kSplit16 = false, kSigned = false;
  __m256i q[8];
  __m256 scale, min;
  GGUF_TARGET void load_group(const uint8_t* p) {
    k_scale_min_x86(p, scale, min);
    const uint8_t* qs = p + (kFifthBit ? 48 : 16);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = load(qs + 32 * i);
      q[2 * i] = _mm256_and_si256(v, low4);
      q[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    if (kFifthBit) {
      // bit j of each byte, moved to bit 4 (16-bit shifts: no byte's bit lands on another's bit 4)
      const __m256i qh = load(p + 16), bit4 = _mm256_set1_epi8(0x10);
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
  GGUF_TARGET __m256i block_sums(const int8_t* x, const int16_t*) const {
    __m256i v[8];
    for (int j = 0; j < 8; ++j) v[j] = dot_u8(_mm256_setzero_si256(), q[j], load(x + 32 * j));
    return sum8(v);
  }
};

// Q6_K: codes in [0, 63]; each block's lanes widened by its two 16-wide scales (low 128
// bits: scale 2j, high: 2j + 1), which vpmaddwd applies as it widens.
struct Q6_K {
  static constexpr int kBlockSize = 256, kBlockBytes = 210, kOffset = 32, kCodeMax = 63;
  static constexpr bool kHasMin = false, kSplit16 = true, kSigned = false;
  __m256i q[8];
  __m256 scale, min;
  const uint8_t* scales;  // the 16 int8 lane scales
  GGUF_TARGET void load_group(const uint8_t* p) {
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
    scales = p + 192;
    scale = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(u16_at(p + 208))));
  }
  GGUF_TARGET __m256i block_sums(const int8_t* x, const int16_t* x16) const {
    const __m256i scale16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)scales));
    const __m256i first = _mm256_permute4x64_epi64(scale16, 0x44), second = _mm256_permute4x64_epi64(scale16, 0xee);
    __m256i v[8];
    for (int j = 0; j < 8; ++j) {
      const int b = 4 * (j % 4);  // the byte of scale 2j within its 128-bit half
      const __m256i pick = _mm256_setr_m128i(_mm_set1_epi16(short(b | (b + 1) << 8)),
                                             _mm_set1_epi16(short((b + 2) | (b + 3) << 8)));
      const __m256i lane_scale = _mm256_shuffle_epi8(j < 4 ? first : second, pick);
      v[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], load(x + 32 * j)), lane_scale);
    }
    const __m256i offsets = _mm256_madd_epi16(load(x16), scale16);  // per block: scales . 16-sums
    return _mm256_sub_epi32(sum8(v), _mm256_slli_epi32(offsets, 5));
  }
};

// Bytes that rows_m (and a panel packed once, panel_tile) asks for ahead of where it
// reads (the tile's rows, and a panel's records, lie one after another): the hardware's
// prefetch alone leaves one core short of what the memory gives (Q4_K, 4096 x 4096 from
// DRAM on one thread: 7.2 GB/s without, 9.8 with 4 KiB; 8 and 16 KiB no better). Asked
// for as non-temporal (kStream): each weight is read once a step, and a step streams more
// than the caches hold; hinted so, it no longer pushes out of them what the step reads
// again (the activations, the KV cache, Python's own objects). The bundled 270M at batch
// 1 on a Zen 5: 1.13-1.20x.
constexpr int64_t kAhead = 4096;
constexpr auto kStream = _MM_HINT_NTA;

// n_rows weight rows from `w` (row_bytes apart) against MB activation rows (Acts), from
// the file's bytes: out[i * kTileN + r].
template <class G, int MB>
GGUF_TARGET void rows_m(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k, const Acts& a,
                        float* out) {
  constexpr int64_t kGroupBytes = G::kBlockBytes * (kGroup / G::kBlockSize);
  const int64_t groups = (k + kGroup - 1) / kGroup, full = k / kGroup;
  // A 32-wide type's short last group (its blocks, then the activations' zero padding):
  // read where it lies, on into the next row's bytes, with the scales past its blocks
  // set to 0 (their sums are 0: the padding's); where that would read past the tile, its
  // blocks copied before zeros. A copy a row cost a 640-wide Q5_0 matrix more time than a
  // 768-wide one at one activation row.
  const int64_t tail_bytes = row_bytes - full * kGroupBytes, past = kGroupBytes - tail_bytes;
  const __m256 kept = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
      _mm256_set1_epi32(int(tail_bytes / G::kBlockBytes)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  alignas(32) uint8_t tail[kGroupBytes] = {};
  G g;
  for (int64_t r = 0; r < n_rows; ++r) {
    const uint8_t* row = w + r * row_bytes;
    __m256 acc[MB];
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t gi = 0; gi < groups; ++gi) {
      for (int64_t o = 0; o < kGroupBytes; o += 64) _mm_prefetch((const char*)row + gi * kGroupBytes + kAhead + o, kStream);
      if (gi < full) {
        g.load_group(row + gi * kGroupBytes);
      } else if (G::kBlockSize == 32 && (r + 1) * row_bytes + past <= n_rows * row_bytes) {
        g.load_group(row + gi * kGroupBytes);
        g.scale = _mm256_and_ps(g.scale, kept);
      } else {
        std::memcpy(tail, row + gi * kGroupBytes, tail_bytes);
        g.load_group(tail);
      }
      for (int i = 0; i < MB; ++i) {
        const __m256i s = g.block_sums(a.q + i * a.ldq + gi * kGroup, a.sum16 + i * a.ld16 + gi * 16);
        const __m256 t = _mm256_mul_ps(g.scale, _mm256_loadu_ps(a.xs + i * a.ldb + gi * kGroupBlocks));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), t, acc[i]);
        if (G::kHasMin)
          acc[i] = _mm256_fnmadd_ps(g.min, _mm256_loadu_ps(a.xss + i * a.ldb + gi * kGroupBlocks), acc[i]);
      }
    }
    for (int i = 0; i < MB; ++i) out[i * linear::kTileN + r] = total(acc[i]);
  }
}

template <class G>
void rows(int64_t, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k, const Acts& a, int mb,
          float* out) {
  switch (mb) {
    case 1: rows_m<G, 1>(w, row_bytes, n_rows, k, a, out); break;
    case 2: rows_m<G, 2>(w, row_bytes, n_rows, k, a, out); break;
    case 3: rows_m<G, 3>(w, row_bytes, n_rows, k, a, out); break;
    default: rows_m<G, 4>(w, row_bytes, n_rows, k, a, out); break;
  }
}

#include "gguf_panels_x86.h"

#if GGUF_VNNI
#include "gguf_decode_avx512.h"
#endif

// The format a type's rows from the bytes are read in on this path: zmm registers
// (gguf_decode_avx512.h) on avx512_vnni, the panels' own ymm format otherwise.
template <class G>
struct RowFormat { using T = G; };
#if GGUF_VNNI
template <>
struct RowFormat<Q8_0> { using T = Q8_0Z; };
template <bool k5>
struct RowFormat<Q4_0<k5>> { using T = Q4_0Z<k5>; };
template <bool k5>
struct RowFormat<Q4_K<k5>> { using T = Q4_KZ<k5>; };
template <>
struct RowFormat<Q6_K> { using T = Q6_KZ; };
#endif

// Activation rows from which a part's panels packed once (at load) are read instead of its
// bytes: the compact ones (kCompact: Q8_0's and Q4_0's, the file's size) from one row,
// their part's pages of the file released; the others' are about twice their bytes,
// which a few rows read as fast.
constexpr int kPrepackedRows = 4;

// A format's kernels on this path: rows from the bytes in its RowFormat, panels of G
// (packed once: compact where G is kCompact).
template <class G>
Kernels kernels_of() {
  const Kernels k{rows<typename RowFormat<G>::T>, pack<G>, panel<G, false>, 2 * kLanes, 32 + 4 * record_floats<G>()};
  if constexpr (kCompact<G>)
    return {k.rows, k.pack, k.panel, k.panel_rows, k.panel_block_bytes, pack_compact<G>, panel<G, true>,
            int(compact_record_bytes<G>(1) / kLanes), 1};
  else
    return {k.rows, k.pack, k.panel, k.panel_rows, k.panel_block_bytes, k.pack, k.panel, k.panel_block_bytes,
            kPrepackedRows};
}

// This path's kernels of a format.
inline Kernels kernels_for(int64_t type) {
  switch (type) {
    case kQ8_0: return kernels_of<Q8_0>();
    case kQ4_0: return kernels_of<Q4_0<false>>();
    case kQ5_0: return kernels_of<Q4_0<true>>();
    case kQ4_K: return kernels_of<Q4_K<false>>();
    case kQ5_K: return kernels_of<Q4_K<true>>();
    default: return kernels_of<Q6_K>();
  }
}

}  // namespace GGUF_NS
}  // namespace gguf

#undef GGUF_NS
#undef GGUF_TARGET
#undef GGUF_VNNI
