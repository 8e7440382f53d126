// Packing a panel (gguf_panels_x86.h): kLanes weight rows at a time, a group (256
// weights) at a time, into the records of one vector.
//
// Whole groups of kLanes rows (nearly all of a layer) are transposed as they lie: a row's
// 32 bytes of packed codes go to 8 columns of 4 bytes (one vector each, a lane per
// row), and the codes are unpacked there, once for all the rows (Q4_K's two blocks a
// byte: one transpose for both). Scales are gathered straight into lanes and decoded
// there. The rest (a part's last rows, a 32-wide type's short last group) go through
// each format's load_group (gguf_x86.h) and are transposed decoded: slower, the same
// bytes.
//
// Included by gguf_panels_x86.h inside its namespace, once per code path.

// Where vector v's records of group gi go: a record per block, in pass order.
struct Records {
  static constexpr int kVecBytes = kLanes * 4;
  uint8_t* record[kGroupBlocks];  // block b's
  int nv, v;
  int64_t gi;

  Records(uint8_t* dst, const int64_t start[8], int64_t bytes, int nv, int v, int64_t gi) : nv(nv), v(v), gi(gi) {
    for (int b = 0; b < kGroupBlocks; ++b) {
      const int64_t j = gi * kGroupBlocks + b;
      record[b] = dst + (start[j % 8] + j / 8) * bytes;
    }
  }
  // Block b's codes for 4 inputs from 4g.
  GGUF_TARGET void codes(int b, int g, Vec::I c) const { Vec::store(record[b] + (g * nv + v) * kVecBytes, c); }
  // Block b's floats: 0 its scale, then min (Q4_K) or lane scales (Q6_K).
  GGUF_TARGET void floats(int b, int which, Vec::F f) const {
    Vec::storef(reinterpret_cast<float*>(record[b] + 8 * nv * kVecBytes) + (which * nv + v) * kLanes, f);
  }
};

#if GGUF_VNNI
// kLanes rows of 8 dwords (row r at src + r * stride) into columns: out[c] lane r = row
// r's dword c. Rows r and r + 8 share a zmm; each 256-bit half is transposed as
// transpose8 does, the last step across 128-bit lanes by vpermt2q.
GGUF_TARGET inline void transpose_rows(const uint8_t* src, int64_t stride, __m512i out[8]) {
  __m512i r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i)
    r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(load(src + i * stride)), load(src + (i + 8) * stride), 1);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int c = 0; c < 4; ++c) {
    out[c] = _mm512_permutex2var_epi64(u[c], first, u[c + 4]);
    out[c + 4] = _mm512_permutex2var_epi64(u[c], second, u[c + 4]);
  }
}
#else
GGUF_TARGET inline void transpose_rows(const uint8_t* src, int64_t stride, __m256i out[8]) {
  __m256i r[8];
  for (int i = 0; i < 8; ++i) r[i] = load(src + i * stride);
  transpose8(r, out);
}
#endif

// Whole groups as they lie: rows at `rows` (row_bytes apart), `lanes` = Vec::lanes_times(row_bytes).
// A format without one packs every group decoded (pack_decoded).
template <class G>
constexpr bool kPacksAsStored = false;
template <bool kFifthBit>
constexpr bool kPacksAsStored<Q4_K<kFifthBit>> = true;
template <>
constexpr bool kPacksAsStored<Q6_K> = true;
template <>
constexpr bool kPacksAsStored<Q8_0> = true;
template <bool kFifthBit>
constexpr bool kPacksAsStored<Q4_0<kFifthBit>> = true;

// Q4_K, Q5_K: d, dmin and the 12 bytes of scales are 4 dwords loaded into lanes and
// decoded there (k_scales); block pair 2i, 2i + 1 from one transpose of its 32 bytes.
template <bool kFifthBit>
GGUF_TARGET void pack_as_stored(Q4_K<kFifthBit>, const uint8_t* rows, int64_t row_bytes, Vec::I lanes,
                                const Records& out) {
  const uint8_t* b = rows + out.gi * Q4_K<kFifthBit>::kBlockBytes;
  Vec::I words[4];
  dwords4(b, row_bytes, words);
  const Vec::I head = words[0], lo = words[1], mid = words[2], hi = words[3];
  const Vec::F d = Vec::half_lo(head), dmin = Vec::half_lo(Vec::srli32(head, 16));
  const Vec::I six = Vec::set1(63), four = Vec::set1(15), top2 = Vec::set1(0x30);
  for (int j = 0; j < 8; ++j) {
    Vec::I sc, m;
    if (j < 4) {
      sc = Vec::and_(Vec::srli32(lo, 8 * j), six);
      m = Vec::and_(Vec::srli32(mid, 8 * j), six);
    } else {  // low 4 bits from hi, top 2 from bits 6-7 of lo's (mid's) byte j - 4
      const int s = 8 * (j - 4);
      sc = Vec::or_(Vec::and_(Vec::srli32(hi, s), four), Vec::and_(Vec::srli32(lo, s + 2), top2));
      m = Vec::or_(Vec::and_(Vec::srli32(hi, s + 4), four), Vec::and_(Vec::srli32(mid, s + 2), top2));
    }
    out.floats(j, 0, Vec::mul(d, Vec::cvt(sc)));
    out.floats(j, 1, Vec::mul(dmin, Vec::cvt(m)));
  }
  const Vec::I low4 = Vec::bytes(0x0f), bit4 = Vec::bytes(0x10);
  Vec::I fifth[8];
  if (kFifthBit) transpose_rows(b + 16, row_bytes, fifth);  // bit j of a byte: block j's
  const uint8_t* qs = b + (kFifthBit ? 48 : 16);
  for (int i = 0; i < 4; ++i) {
    Vec::I cols[8];
    transpose_rows(qs + 32 * i, row_bytes, cols);
    for (int c = 0; c < 8; ++c) {
      Vec::I even = Vec::and_(cols[c], low4), odd = Vec::and_(Vec::shift16(cols[c], -4), low4);
      if (kFifthBit) {  // (16-bit shifts: no byte's bit lands on another's bit 4)
        even = Vec::or_(even, Vec::and_(Vec::shift16(fifth[c], 4 - 2 * i), bit4));
        odd = Vec::or_(odd, Vec::and_(Vec::shift16(fifth[c], 3 - 2 * i), bit4));
      }
      out.codes(2 * i, c, even);
      out.codes(2 * i + 1, c, odd);
    }
  }
}

// Q6_K: the 16 lane scales are 4 dwords loaded into lanes, d gathered; block 4h + t
// takes its low bits from one transpose of low bytes (two blocks a transpose), its high
// bits from one of high bytes (four blocks a transpose).
inline GGUF_TARGET void pack_as_stored(Q6_K, const uint8_t* rows, int64_t row_bytes, Vec::I lanes, const Records& out) {
  const uint8_t* b = rows + out.gi * Q6_K::kBlockBytes;
  const Vec::F d = Vec::half_lo(Vec::srli32(Vec::gather(b + 206, lanes), 16));  // (bytes 206-209: within the block)
  Vec::I scales[4];
  dwords4(b + 192, row_bytes, scales);
  for (int j = 0; j < 8; ++j) {
    out.floats(j, 0, d);
    for (int h = 0; h < 2; ++h) {  // lane scale 2j + h: byte (2j + h) % 4 of dword (2j + h) / 4, signed
      const int s = 2 * j + h;
      out.floats(j, 1 + h, Vec::cvt(Vec::srai32(Vec::slli32(scales[s / 4], 24 - 8 * (s % 4)), 24)));
    }
  }
  const Vec::I low4 = Vec::bytes(0x0f), high2 = Vec::bytes(0x30);
  for (int h = 0; h < 2; ++h) {
    Vec::I high[8];
    transpose_rows(b + 128 + 32 * h, row_bytes, high);
    for (int p = 0; p < 2; ++p) {
      Vec::I low[8];
      transpose_rows(b + 64 * h + 32 * p, row_bytes, low);
      for (int c = 0; c < 8; ++c) {
        // t = p: low nibbles, high bits 2p, 2p + 1; t = p + 2: high nibbles, bits 2p + 4, 2p + 5
        out.codes(4 * h + p, c, Vec::or_(Vec::and_(low[c], low4), Vec::and_(Vec::shift16(high[c], 4 - 2 * p), high2)));
        out.codes(4 * h + p + 2, c, Vec::or_(Vec::and_(Vec::shift16(low[c], -4), low4),
                                             Vec::and_(Vec::shift16(high[c], -2 * p), high2)));
      }
    }
  }
}

// Q8_0: each block's 32 codes one transpose (shifted to unsigned where panels take them
// so), its d gathered.
inline GGUF_TARGET void pack_as_stored(Q8_0, const uint8_t* rows, int64_t row_bytes, Vec::I lanes, const Records& out) {
  const uint8_t* b = rows + out.gi * 8 * Q8_0::kBlockBytes;
  const Vec::I flip = Vec::bytes(panel_offset<Q8_0>() == 128 ? char(0x80) : 0);
  for (int j = 0; j < 8; ++j) {
    const uint8_t* block = b + j * Q8_0::kBlockBytes;
    out.floats(j, 0, Vec::half_lo(Vec::gather(block, lanes)));
    Vec::I cols[8];
    transpose_rows(block + 2, row_bytes, cols);
    for (int c = 0; c < 8; ++c) out.codes(j, c, Vec::xor_(cols[c], flip));
  }
}

// Q4_0, Q5_0: a block's d and each 4 bytes of its nibbles gathered into lanes (the block
// is 18 or 22 bytes: no row of it transposes whole); bytes 4c..4c + 3 hold values
// 4c..4c + 3 (low nibbles) and 16 + 4c.. (high). Q5_0's fifth bits: bits 4c..4c + 3 of
// qh spread to bit 4 of each byte (shifted copies that overlap nowhere, so or = sum).
template <bool kFifthBit>
GGUF_TARGET void pack_as_stored(Q4_0<kFifthBit>, const uint8_t* rows, int64_t row_bytes, Vec::I lanes,
                                const Records& out) {
  constexpr int kBytes = Q4_0<kFifthBit>::kBlockBytes, kCodes = kFifthBit ? 6 : 2;
  const uint8_t* b = rows + out.gi * 8 * kBytes;
  const Vec::I low4 = Vec::bytes(0x0f), four = Vec::set1(0xf), ones = Vec::set1(0x01010101);
  const auto fifth = [&](Vec::I qh, int bit) {  // bits bit..bit + 3 of each lane to bit 4 of its 4 bytes
    const Vec::I t = Vec::and_(Vec::srli32(qh, bit), four);
    const Vec::I spread = Vec::or_(Vec::or_(t, Vec::slli32(t, 7)), Vec::or_(Vec::slli32(t, 14), Vec::slli32(t, 21)));
    return Vec::slli32(Vec::and_(spread, ones), 4);
  };
  for (int j = 0; j < 8; ++j) {
    const uint8_t* block = b + j * kBytes;
    out.floats(j, 0, Vec::half_lo(Vec::gather(block, lanes)));
    const Vec::I qh = kFifthBit ? Vec::gather(block + 2, lanes) : Vec::set1(0);
    for (int c = 0; c < 4; ++c) {
      const Vec::I q = Vec::gather(block + kCodes + 4 * c, lanes);
      Vec::I low = Vec::and_(q, low4), high = Vec::and_(Vec::shift16(q, -4), low4);
      if (kFifthBit) {
        low = Vec::or_(low, fifth(qh, 4 * c));
        high = Vec::or_(high, fifth(qh, 16 + 4 * c));
      }
      out.codes(j, c, low);
      out.codes(j, 4 + c, high);
    }
  }
}

// A group's worth of decoded rows, row after row, before they are transposed into records.
struct Decoded {
  alignas(64) uint8_t codes[kLanes][kGroup];
  alignas(64) float scale[kLanes][kGroupBlocks];
  alignas(64) float min[kLanes][kGroupBlocks];
  alignas(64) float lane[kLanes][16];  // Q6_K's lane scales
};

// Row r from group gi of `row` through load_group (nullptr: a padding row, zero weights).
template <class G>
GGUF_TARGET inline void decode_row(const uint8_t* row, int64_t row_bytes, int64_t gi, int64_t full, Decoded& s, int r) {
  constexpr int64_t kGroupBytes = G::kBlockBytes * (kGroup / G::kBlockSize);
  if (row == nullptr) {
    std::memset(s.codes[r], panel_offset<G>() == 128 ? 0x80 : 0, kGroup);
    std::memset(s.scale[r], 0, sizeof(s.scale[r]));
    std::memset(s.min[r], 0, sizeof(s.min[r]));
    std::memset(s.lane[r], 0, sizeof(s.lane[r]));
    return;
  }
  G g;
  if (gi < full) {
    g.load_group(row + gi * kGroupBytes);
  } else {  // a 32-wide type's short last group: its blocks, then zeros
    alignas(32) uint8_t tail[kGroupBytes] = {};
    std::memcpy(tail, row + gi * kGroupBytes, row_bytes - gi * kGroupBytes);
    g.load_group(tail);
  }
  const __m256i flip = _mm256_set1_epi8(panel_offset<G>() == 128 ? char(0x80) : 0);
  for (int j = 0; j < 8; ++j) _mm256_store_si256((__m256i*)(s.codes[r] + 32 * j), _mm256_xor_si256(g.q[j], flip));
  _mm256_store_ps(s.scale[r], g.scale);
  if constexpr (G::kHasMin) _mm256_store_ps(s.min[r], g.min);
  if constexpr (G::kSplit16) {
    const __m128i ls = _mm_loadu_si128((const __m128i*)g.scales);
    _mm256_store_ps(s.lane[r], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ls)));
    _mm256_store_ps(s.lane[r] + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(ls, 8))));
  }
}

// Group gi of n_rows (<= kLanes; the rest padding) rows decoded, then transposed.
template <class G>
GGUF_TARGET void pack_decoded(const uint8_t* rows, int64_t row_bytes, int64_t n_rows, int64_t full, int in_group,
                              const Records& out) {
  Decoded s;
  for (int r = 0; r < kLanes; ++r) decode_row<G>(r < n_rows ? rows + r * row_bytes : nullptr, row_bytes, out.gi, full, s, r);
  Vec::I cols[8], mins[8], lanes_lo[8], lanes_hi[8];
  for (int b = 0; b < in_group; ++b) {
    transpose_rows(&s.codes[0][32 * b], kGroup, cols);
    for (int g = 0; g < 8; ++g) out.codes(b, g, cols[g]);
  }
  transpose_rows((const uint8_t*)s.scale, sizeof(s.scale[0]), cols);
  if (G::kHasMin) transpose_rows((const uint8_t*)s.min, sizeof(s.min[0]), mins);
  if (G::kSplit16) {
    transpose_rows((const uint8_t*)s.lane, sizeof(s.lane[0]), lanes_lo);         // lane scales 0..7
    transpose_rows((const uint8_t*)&s.lane[0][8], sizeof(s.lane[0]), lanes_hi);  // 8..15
  }
  for (int b = 0; b < in_group; ++b) {
    out.floats(b, 0, Vec::as_f(cols[b]));
    if (G::kHasMin) out.floats(b, 1, Vec::as_f(mins[b]));
    if (G::kSplit16) {  // lane scales 2b, 2b + 1: columns of the low or high half
      const Vec::I* half = b < 4 ? lanes_lo : lanes_hi;
      out.floats(b, 1, Vec::as_f(half[(2 * b) % 8]));
      out.floats(b, 2, Vec::as_f(half[(2 * b + 1) % 8]));
    }
  }
}

// Groups ahead of the one being packed that pack_rows asks the memory for. It reads a
// group of every row at a time: n_rows streams of a group each (144 bytes for Q4_K),
// too short for the hardware's prefetch to follow, so each load waited on the memory
// (panels packed afresh each step, 1B and 4B Q4_K_M at batch 16, Zen 5: 1.2x the
// tokens a second with 1-6 groups ahead, 2 chosen; 64 rows 1.06x).
constexpr int64_t kPackAhead = 2;

// Each of n_rows rows' group at `group` (row_bytes apart) asked for, to L1.
template <int64_t kGroupBytes>
inline void prefetch_group(const uint8_t* group, int64_t row_bytes, int64_t n_rows) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const char* p = reinterpret_cast<const char*>(group + r * row_bytes);
    for (int64_t o = 0; o < kGroupBytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
    _mm_prefetch(p + kGroupBytes - 1, _MM_HINT_T0);  // (a group need not start a cache line)
  }
}

// n_rows (<= 2 * kLanes) weight rows from `w` (row_bytes apart) into a panel at `dst`.
template <class G>
GGUF_TARGET void pack_rows(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k, uint8_t* dst) {
  constexpr int64_t kGroupBytes = G::kBlockBytes * (kGroup / G::kBlockSize);
  const int nv = n_rows > kLanes ? 2 : 1;
  const int64_t blocks = k / 32, groups = (k + kGroup - 1) / kGroup, full = k / kGroup;
  int64_t start[8];
  pass_starts(blocks, start);
  const Vec::I lanes = Vec::lanes_times(row_bytes);
  for (int64_t gi = 0; gi < groups; ++gi) {
    // past the last whole group, the first of the rows after these (the next tile's,
    // packed next; a hint only: nothing is read where they end)
    const int64_t ahead = gi + kPackAhead;
    prefetch_group<kGroupBytes>(ahead < full ? w + ahead * kGroupBytes : w + n_rows * row_bytes + (ahead - full) * kGroupBytes,
                                row_bytes, n_rows);
    const int in_group = int(std::min<int64_t>(kGroupBlocks, blocks - gi * kGroupBlocks));
    for (int v = 0; v < nv; ++v) {
      const Records out{dst, start, record_bytes<G>(nv), nv, v, gi};
      const uint8_t* rows = w + v * kLanes * row_bytes;
      const int64_t here = std::min<int64_t>(kLanes, n_rows - v * kLanes);
      if constexpr (kPacksAsStored<G>) {
        if (here == kLanes && gi < full) {
          pack_as_stored(G{}, rows, row_bytes, lanes, out);
          continue;
        }
      }
      pack_decoded<G>(rows, row_bytes, here, full, in_group, out);
    }
  }
}
