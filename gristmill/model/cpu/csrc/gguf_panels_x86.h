// The panels of gguf_x86.h (many activation rows): a tile's weight rows packed once,
// then met by every activation row of the chunk, in gguf_blocks.h's float order.
//
// A vector holds kLanes output rows (16 in a zmm on avx512_vnni, 8 in a ymm on avx2),
// 4 codes each: what vpdpbusd (or vpmaddubsw + vpmaddwd) meets with 4 activations
// broadcast, no horizontal sums. A panel is nv (1 or 2) such vectors side by side; its
// blocks are *records* in pass order (below), each holding
//   codes   [8 groups of 4][nv][kLanes][4] bytes (Q8_0's + 128 on avx512_vnni)
//   scale   [nv][kLanes] floats              (per output row: scale[j])
//   min     [nv][kLanes] floats              (Q4_K, Q5_K)
//   lane    [2][nv][kLanes] floats           (Q6_K: lane_scale[2j], lane_scale[2j + 1])
//
// Pass order: gguf_blocks.h keeps eight float accumulators a row (acc[j % 8]), too many
// to hold in registers for a tile of rows. Taken one at a time, pass u over blocks u,
// u + 8, u + 16, ... (each accumulator still sees its blocks in order), a tile holds
// one accumulator per output vector and activation row; the eight are summed at the end
// in gguf_blocks.h's order. The records lie in that order, so a pass reads on.
//
// Included by gguf_x86.h inside its namespace, once per code path.

#if GGUF_VNNI
struct Vec {
  static constexpr int kLanes = 16;
  using I = __m512i;
  using F = __m512;
  static GGUF_TARGET I load(const void* p) { return _mm512_loadu_si512(p); }
  static GGUF_TARGET F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static GGUF_TARGET F halfs(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static GGUF_TARGET I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static GGUF_TARGET F set1f(float v) { return _mm512_set1_ps(v); }
  static GGUF_TARGET F zero() { return _mm512_setzero_ps(); }
  static GGUF_TARGET F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static GGUF_TARGET F add(F a, F b) { return _mm512_add_ps(a, b); }
  static GGUF_TARGET F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static GGUF_TARGET F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static GGUF_TARGET F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static GGUF_TARGET void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  static GGUF_TARGET void store(void* p, I v) { _mm512_storeu_si512(p, v); }
  static GGUF_TARGET F as_f(I v) { return _mm512_castsi512_ps(v); }
  static GGUF_TARGET I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static GGUF_TARGET I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static GGUF_TARGET I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static GGUF_TARGET I bytes(char b) { return _mm512_set1_epi8(b); }
  static GGUF_TARGET I shift16(I v, int n) { return n >= 0 ? _mm512_slli_epi16(v, n) : _mm512_srli_epi16(v, -n); }
  static GGUF_TARGET I srli32(I v, int n) { return _mm512_srli_epi32(v, n); }
  static GGUF_TARGET I slli32(I v, int n) { return _mm512_slli_epi32(v, n); }
  static GGUF_TARGET I srai32(I v, int n) { return _mm512_srai_epi32(v, n); }
  // Lane r: the 4 bytes at base + offset[r].
  static GGUF_TARGET I gather(const uint8_t* base, I offset) { return _mm512_i32gather_epi32(offset, base, 1); }
  // Chunk j: the 16 bytes at p + 4j * stride.
  static GGUF_TARGET I every_fourth(const uint8_t* p, int64_t stride) {
    const auto row = [&](int j) { return _mm_loadu_si128((const __m128i*)(p + 4 * j * stride)); };
    return _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(row(0)), row(1), 1),
                                                 row(2), 2), row(3), 3);
  }
  static GGUF_TARGET I unpacklo32(I a, I b) { return _mm512_unpacklo_epi32(a, b); }
  static GGUF_TARGET I unpackhi32(I a, I b) { return _mm512_unpackhi_epi32(a, b); }
  static GGUF_TARGET I unpacklo64(I a, I b) { return _mm512_unpacklo_epi64(a, b); }
  static GGUF_TARGET I unpackhi64(I a, I b) { return _mm512_unpackhi_epi64(a, b); }
  // Lane r: the fp16 in the low 16 bits of v's lane r, as a float.
  static GGUF_TARGET F half_lo(I v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
  static GGUF_TARGET I lanes_times(int64_t step) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32(int32_t(step)));
  }
  // acc + codes . x, 4 products a lane; codes unsigned (Q8_0's shifted), x signed.
  template <bool kSigned>
  static GGUF_TARGET I dot(I acc, I codes, I x) { return _mm512_dpbusd_epi32(acc, codes, x); }
  // add_runs names these three; with vpdpbusd it takes no 16-bit runs (int16_run: 1)
  static GGUF_TARGET I pairs(I codes, I x) { return _mm512_maddubs_epi16(codes, x); }
  static GGUF_TARGET I add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static GGUF_TARGET I add_pairs(I acc, I p) { return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1))); }
};
#else
struct Vec {
  static constexpr int kLanes = 8;
  using I = __m256i;
  using F = __m256;
  static GGUF_TARGET I load(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static GGUF_TARGET F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static GGUF_TARGET F halfs(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static GGUF_TARGET I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static GGUF_TARGET F set1f(float v) { return _mm256_set1_ps(v); }
  static GGUF_TARGET F zero() { return _mm256_setzero_ps(); }
  static GGUF_TARGET F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static GGUF_TARGET F add(F a, F b) { return _mm256_add_ps(a, b); }
  static GGUF_TARGET F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static GGUF_TARGET F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static GGUF_TARGET F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static GGUF_TARGET void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
  static GGUF_TARGET void store(void* p, I v) { _mm256_storeu_si256((__m256i*)p, v); }
  static GGUF_TARGET F as_f(I v) { return _mm256_castsi256_ps(v); }
  static GGUF_TARGET I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static GGUF_TARGET I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static GGUF_TARGET I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static GGUF_TARGET I bytes(char b) { return _mm256_set1_epi8(b); }
  static GGUF_TARGET I shift16(I v, int n) { return n >= 0 ? _mm256_slli_epi16(v, n) : _mm256_srli_epi16(v, -n); }
  static GGUF_TARGET I srli32(I v, int n) { return _mm256_srli_epi32(v, n); }
  static GGUF_TARGET I slli32(I v, int n) { return _mm256_slli_epi32(v, n); }
  static GGUF_TARGET I srai32(I v, int n) { return _mm256_srai_epi32(v, n); }
  static GGUF_TARGET I gather(const uint8_t* base, I offset) {
    return _mm256_i32gather_epi32((const int*)base, offset, 1);
  }
  static GGUF_TARGET I every_fourth(const uint8_t* p, int64_t stride) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)p)),
                                   _mm_loadu_si128((const __m128i*)(p + 4 * stride)), 1);
  }
  static GGUF_TARGET I unpacklo32(I a, I b) { return _mm256_unpacklo_epi32(a, b); }
  static GGUF_TARGET I unpackhi32(I a, I b) { return _mm256_unpackhi_epi32(a, b); }
  static GGUF_TARGET I unpacklo64(I a, I b) { return _mm256_unpacklo_epi64(a, b); }
  static GGUF_TARGET I unpackhi64(I a, I b) { return _mm256_unpackhi_epi64(a, b); }
  static GGUF_TARGET F half_lo(I v) {
    const __m256i halves = _mm256_packus_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_setzero_si256());
    return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(halves, 0x08)));
  }
  static GGUF_TARGET I lanes_times(int64_t step) {
    return _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(int32_t(step)));
  }
  template <bool kSigned>
  static GGUF_TARGET I dot(I acc, I codes, I x) { return kSigned ? dot_s8(acc, codes, x) : dot_u8(acc, codes, x); }
  // 16-bit lane l: codes[2l] x[2l] + codes[2l + 1] x[2l + 1] (codes unsigned, x signed).
  static GGUF_TARGET I pairs(I codes, I x) { return _mm256_maddubs_epi16(codes, x); }
  static GGUF_TARGET I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  // acc + each 32-bit lane's two 16-bit pair sums.
  static GGUF_TARGET I add_pairs(I acc, I p) { return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1))); }
};
#endif

constexpr int kLanes = Vec::kLanes;

// out[d] lane r: dword d of the 16 bytes at p + r * stride. Loaded so that chunk j of z[i]
// holds row 4j + i, then each 128-bit chunk's 4x4 dwords transposed: loads, where 4
// gathers were slow (pack_as_stored).
GGUF_TARGET inline void dwords4(const uint8_t* p, int64_t stride, Vec::I out[4]) {
  Vec::I z[4];
  for (int i = 0; i < 4; ++i) z[i] = Vec::every_fourth(p + i * stride, stride);
  const Vec::I t0 = Vec::unpacklo32(z[0], z[1]), t1 = Vec::unpackhi32(z[0], z[1]);
  const Vec::I t2 = Vec::unpacklo32(z[2], z[3]), t3 = Vec::unpackhi32(z[2], z[3]);
  out[0] = Vec::unpacklo64(t0, t2);
  out[1] = Vec::unpackhi64(t0, t2);
  out[2] = Vec::unpacklo64(t1, t3);
  out[3] = Vec::unpackhi64(t1, t3);
}

// The codes a panel holds of a format: as decoded, but Q8_0's as unsigned (+ 128) where
// vpdpbusd meets them (its offset then 128).
template <class G>
constexpr int panel_offset() {
  return G::kSigned && GGUF_VNNI ? 128 : G::kOffset;
}

// Floats a record holds per output row besides its 32 codes.
template <class G>
constexpr int record_floats() {
  return 1 + (G::kHasMin ? 1 : 0) + (G::kSplit16 ? 2 : 0);
}

// The bytes of one block's record of nv vectors.
template <class G>
constexpr int64_t record_bytes(int nv) {
  return int64_t(nv) * kLanes * (32 + 4 * record_floats<G>());
}

// Where each pass's records start: start[u] for blocks u, u + 8, ... of `blocks`.
inline void pass_starts(int64_t blocks, int64_t start[8]) {
  int64_t at = 0;
  for (int u = 0; u < 8; ++u) {
    start[u] = at;
    at += u < blocks ? (blocks - u + 7) / 8 : 0;
  }
}

// Compact records, in panels packed once (at load) for Q4_0 and Q8_0: the same records
// with the scales as the file's fp16, and Q4_0's codes two a byte (group g's in the low
// nibble, group g + 4's in the high one): 18 and 34 bytes a row and block, the file's
// own sizes, so that one activation row reads them as fast as the bytes. The panel
// kernels unpack them in registers (Q4_0's codes: an and, or a shift and an and, a
// vector). (Q4_K's would take its d x sc and dmin x m apart again, a record at a time:
// 1.13-1.15x the time of its bytes at one row; docs/performance.md, stop 61.)
template <class G>
constexpr bool kCompact = false;
template <>
constexpr bool kCompact<Q4_0<false>> = true;
template <>
constexpr bool kCompact<Q8_0> = true;

// Codes two a byte in a compact record (Q8_0's: one a byte, as in a panel packed afresh).
template <class G>
constexpr bool kNibbles = std::is_same_v<G, Q4_0<false>>;

template <class G>
constexpr int64_t compact_record_bytes(int nv) {
  return int64_t(nv) * kLanes * ((kNibbles<G> ? 16 : 32) + 2);
}

// A record's bytes, compact or not.
template <class G, bool kOnce>
constexpr int64_t record_size(int nv) {
  return kOnce ? compact_record_bytes<G>(nv) : record_bytes<G>(nv);
}

// Vector v of a record's codes for 4 inputs from 4g.
template <class G, bool kOnce, int NV>
GGUF_TARGET inline Vec::I record_codes(const uint8_t* rec, int g, int v) {
  constexpr int kVecBytes = kLanes * 4;
  if constexpr (kOnce && kNibbles<G>) {
    const Vec::I both = Vec::load(rec + ((g & 3) * NV + v) * kVecBytes);
    return Vec::and_(g < 4 ? both : Vec::shift16(both, -4), Vec::bytes(0x0f));
  } else {
    return Vec::load(rec + (g * NV + v) * kVecBytes);
  }
}

// Vector v of a record's floats `which` (0: scale, 1: minimum; compact: only scales).
template <class G, bool kOnce, int NV>
GGUF_TARGET inline Vec::F record_float(const uint8_t* rec, int which, int v) {
  constexpr int kVecBytes = kLanes * 4;
  if constexpr (kOnce)
    return Vec::halfs(rec + (kNibbles<G> ? 4 : 8) * NV * kVecBytes + v * kLanes * 2);
  else
    return Vec::loadf(reinterpret_cast<const float*>(rec + 8 * NV * kVecBytes) + (which * NV + v) * kLanes);
}

#include "gguf_pack_x86.h"

// Groups of 4 codes a lane whose vpmaddubsw pair sums add up in 16 bits before one
// vpmaddwd widens them (avx2): a pair sum is at most 2 * kCodeMax * 127 (activations in
// [-127, 127]), so Q4_0's and Q4_K's 8 groups (30480), Q5's 4, Q6_K's 2, Q8_0's 1. The
// sums are the same integers, in fewer instructions (vpdpbusd: one a group anyway).
template <class G>
constexpr int int16_run() {
  return GGUF_VNNI || G::kSigned ? 1 : 32767 / (2 * G::kCodeMax * 127);
}

// acc[i][v] + the record's codes of groups [g0, g1) . activation row i's, in runs of
// int16_run groups (> 1: avx2's 4-bit and 5-bit codes, Q6_K's).
template <class G, bool kOnce, int NV, int MR>
GGUF_TARGET inline void add_runs(const uint8_t* rec, const int8_t* x, int64_t ldx, int g0, int g1,
                                 Vec::I acc[MR][NV]) {
  constexpr int kRun = int16_run<G>();
  for (int r = g0; r < g1; r += kRun) {
    Vec::I pairs[MR][NV];
    for (int g = r; g < r + kRun; ++g) {
      Vec::I codes[NV];
      for (int v = 0; v < NV; ++v) codes[v] = record_codes<G, kOnce, NV>(rec, g, v);
      for (int i = 0; i < MR; ++i) {
        const Vec::I xv = Vec::set1(linear::load4(x + i * ldx + 4 * g));
        for (int v = 0; v < NV; ++v)
          pairs[i][v] = g == r ? Vec::pairs(codes[v], xv) : Vec::add16(pairs[i][v], Vec::pairs(codes[v], xv));
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) acc[i][v] = Vec::add_pairs(acc[i][v], pairs[i][v]);
  }
}

// One record's S_j against MR activation rows (x: block j of each, ldx apart; x16: its
// two sums of 16, ld16 apart), as floats (exact: |S_j| < 2^24): s[i][v]. A group at a
// time where int16_run is 1, in the loops as they were before the 16-bit runs (written
// through add_runs' shape, the compiler scheduled avx512_vnni's Q6_K tiles otherwise:
// 1.2x slower at 64 rows).
template <class G, bool kOnce, int NV, int MR>
GGUF_TARGET inline void record_sums(const uint8_t* rec, const int8_t* x, int64_t ldx, const int16_t* x16,
                                    int64_t ld16, Vec::F s[MR][NV]) {
  constexpr int kVecBytes = kLanes * 4, kOffset = panel_offset<G>();
  constexpr bool kSigned = G::kSigned && !GGUF_VNNI, kRuns = int16_run<G>() > 1;
  if constexpr (G::kSplit16) {  // per half: lane_scale * (codes . x - offset * X_half), summed in float
    const float* lane = reinterpret_cast<const float*>(rec + 8 * NV * kVecBytes) + NV * kLanes;
    for (int h = 0; h < 2; ++h) {
      Vec::I acc[MR][NV];
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < NV; ++v) acc[i][v] = Vec::set1(-kOffset * x16[i * ld16 + h]);
      if constexpr (kRuns) {
        add_runs<G, kOnce, NV, MR>(rec, x, ldx, 4 * h, 4 * h + 4, acc);
      } else {
        for (int g = 4 * h; g < 4 * h + 4; ++g) {
          Vec::I codes[NV];
          for (int v = 0; v < NV; ++v) codes[v] = Vec::load(rec + (g * NV + v) * kVecBytes);
          for (int i = 0; i < MR; ++i) {
            const Vec::I xv = Vec::set1(linear::load4(x + i * ldx + 4 * g));
            for (int v = 0; v < NV; ++v) acc[i][v] = Vec::dot<kSigned>(acc[i][v], codes[v], xv);
          }
        }
      }
      for (int v = 0; v < NV; ++v) {
        const Vec::F scale = Vec::loadf(lane + (h * NV + v) * kLanes);
        for (int i = 0; i < MR; ++i)
          s[i][v] = h == 0 ? Vec::mul(Vec::cvt(acc[i][v]), scale) : Vec::fmadd(Vec::cvt(acc[i][v]), scale, s[i][v]);
      }
    }
  } else {
    Vec::I acc[MR][NV];
    for (int i = 0; i < MR; ++i) {
      const Vec::I start = Vec::set1(kOffset == 0 ? 0 : -kOffset * (x16[i * ld16] + x16[i * ld16 + 1]));
      for (int v = 0; v < NV; ++v) acc[i][v] = start;
    }
    if constexpr (kRuns) {
      add_runs<G, kOnce, NV, MR>(rec, x, ldx, 0, 8, acc);
    } else {
      for (int g = 0; g < 8; ++g) {
        Vec::I codes[NV];
        for (int v = 0; v < NV; ++v) codes[v] = record_codes<G, kOnce, NV>(rec, g, v);
        for (int i = 0; i < MR; ++i) {
          const Vec::I xv = Vec::set1(linear::load4(x + i * ldx + 4 * g));
          for (int v = 0; v < NV; ++v) acc[i][v] = Vec::dot<kSigned>(acc[i][v], codes[v], xv);
        }
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) s[i][v] = Vec::cvt(acc[i][v]);
  }
}

// A panel of NV vectors against MR activation rows: out[i * kTileN + c] for its n_rows
// columns c. kFirst: the first rows to meet a panel packed once (kOnce), which come
// from the memory: each record asks for the bytes kAhead on (the records lie in the
// order read), as rows_m does. Without it, one row read Q4_0's and Q8_0's compact
// panels from DRAM 0.9x as fast as their bytes on the avx2 path (1B Q4_0 at batch 1,
// Zen 5 on its avx2 path: 1.09x the tokens a second with it, its own path 1.04x).
template <class G, bool kOnce, int NV, int MR, bool kFirst>
GGUF_TARGET void panel_tile(const uint8_t* panel, int64_t n_rows, int64_t k, const Acts& a, float* out) {
  constexpr int64_t kRec = record_size<G, kOnce>(NV);
  const int64_t blocks = k / 32;
  alignas(64) float passes[8][MR][NV][kLanes];  // each pass's accumulators, summed at the end
  const uint8_t* rec = panel;
  for (int u = 0; u < 8; ++u) {
    Vec::F acc[MR][NV];
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) acc[i][v] = Vec::zero();
    for (int64_t j = u; j < blocks; j += 8, rec += kRec) {
      if constexpr (kFirst)
        for (int64_t o = 0; o < kRec; o += 64) _mm_prefetch((const char*)rec + kAhead + o, kStream);
      Vec::F s[MR][NV];
      record_sums<G, kOnce, NV, MR>(rec, a.q + 32 * j, a.ldq, a.sum16 + 2 * j, a.ld16, s);
      for (int v = 0; v < NV; ++v) {
        const Vec::F sc = record_float<G, kOnce, NV>(rec, 0, v);
        for (int i = 0; i < MR; ++i) acc[i][v] = Vec::fmadd(s[i][v], Vec::mul(sc, Vec::set1f(a.xs[i * a.ldb + j])), acc[i][v]);
        if constexpr (G::kHasMin) {
          const Vec::F min = record_float<G, kOnce, NV>(rec, 1, v);
          for (int i = 0; i < MR; ++i) acc[i][v] = Vec::fnmadd(min, Vec::set1f(a.xss[i * a.ldb + j]), acc[i][v]);
        }
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) Vec::storef(passes[u][i][v], acc[i][v]);
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) {
      Vec::F c[8];
      for (int u = 0; u < 8; ++u) c[u] = Vec::loadf(passes[u][i][v]);
      const Vec::F y = Vec::add(Vec::add(Vec::add(c[0], c[4]), Vec::add(c[2], c[6])),
                                Vec::add(Vec::add(c[1], c[5]), Vec::add(c[3], c[7])));
      alignas(64) float lanes[kLanes];
      Vec::storef(lanes, y);
      const int64_t n = std::min<int64_t>(kLanes, n_rows - v * kLanes);
      std::memcpy(out + i * linear::kTileN + v * kLanes, lanes, n * sizeof(float));
    }
}

// Rows a panel tile meets at once: what the registers hold (zmm: 32; ymm: 16, where
// Q6_K's short 16-bit runs leave room for a third row: 1.07x at 64 rows, the others 0.93-1.0x).
template <class G>
constexpr int kPanelMR = GGUF_VNNI ? 4 : G::kSplit16 ? 3 : 2;

// Activation rows i.. (MR of them) against a panel: the first (i = 0) of a panel packed
// once ask for its bytes ahead.
template <class G, bool kOnce, int NV, int MR>
GGUF_TARGET inline void panel_rows(const uint8_t* panel, int64_t n_rows, int64_t k, const Acts& a, int i, float* out) {
  if constexpr (kOnce)
    if (i == 0) return panel_tile<G, kOnce, NV, MR, true>(panel, n_rows, k, a.from(i), out + i * linear::kTileN);
  panel_tile<G, kOnce, NV, MR, false>(panel, n_rows, k, a.from(i), out + i * linear::kTileN);
}

template <class G, bool kOnce, int NV>
GGUF_TARGET void panel_nv(const uint8_t* panel, int64_t n_rows, int64_t k, const Acts& a, int mb, float* out) {
  int i = 0;
  for (; i + kPanelMR<G> <= mb; i += kPanelMR<G>) panel_rows<G, kOnce, NV, kPanelMR<G>>(panel, n_rows, k, a, i, out);
  switch (mb - i) {
    case 1: panel_rows<G, kOnce, NV, 1>(panel, n_rows, k, a, i, out); break;
    case 2: panel_rows<G, kOnce, NV, 2>(panel, n_rows, k, a, i, out); break;
    case 3: panel_rows<G, kOnce, NV, 3>(panel, n_rows, k, a, i, out); break;
    default: break;
  }
}

// A panel packed by pack_rows (n_rows rows; compact: by pack_compact) against mb
// activation rows.
template <class G, bool kOnce>
void panel(const uint8_t* panel, int64_t n_rows, int64_t k, const Acts& a, int mb, float* out) {
  if (n_rows > kLanes)
    panel_nv<G, kOnce, 2>(panel, n_rows, k, a, mb, out);
  else
    panel_nv<G, kOnce, 1>(panel, n_rows, k, a, mb, out);
}

template <class G>
void pack(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k, uint8_t* dst) {
  pack_rows<G>(w, row_bytes, n_rows, k, dst);
}

// A compact panel (kCompact formats): packed by pack_rows, then each record's scales
// back to the fp16 they were (exactly: they came from it), and Q4_0's codes two a byte.
template <class G>
GGUF_TARGET void pack_compact(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k, uint8_t* dst) {
  constexpr int kVecBytes = kLanes * 4;
  const int nv = n_rows > kLanes ? 2 : 1;
  const int64_t blocks = k / 32, full = record_bytes<G>(nv), compact = compact_record_bytes<G>(nv);
  const int64_t codes = 8 * nv * kVecBytes, half = codes / 2;
  std::vector<uint8_t> panel(blocks * full);
  pack_rows<G>(w, row_bytes, n_rows, k, panel.data());
  for (int64_t r = 0; r < blocks; ++r) {
    const uint8_t* f = panel.data() + r * full;
    uint8_t* c = dst + r * compact;
    if constexpr (kNibbles<G>) {
      for (int64_t b = 0; b < half; ++b) c[b] = uint8_t(f[b] | (f[b + half] << 4));
      c += half;
    } else {
      std::memcpy(c, f, codes);
      c += codes;
    }
    const float* floats = reinterpret_cast<const float*>(f + codes);
    for (int i = 0; i < nv * kLanes; ++i) {
      const uint16_t h = _cvtss_sh(floats[i], 0);
      std::memcpy(c + 2 * i, &h, 2);
    }
  }
}
