// GGUF's quantized block formats (ggml's, as the `gguf` package's quants.py defines
// them), decoded into one form that the portable kernel and the dequantization share.
//
// A *group* is 256 weights of one row: one super-block of a K type (Q4_K, Q5_K, Q6_K),
// or 8 blocks of a 32-wide type (Q8_0, Q4_0, Q5_0; a row's last group may hold fewer,
// the rest zeros). Decoded, every format reads
//   w[k] = (scale[k / 32] * lane_scale[k / 16]) * (code[k] - offset) - min[k / 32]
// with integer codes as stored (Q8_0's signed, the others' unsigned: Q4_0's offset is 8,
// Q5_0's 16, Q6_K's 32), integer 16-wide scales (Q6_K's; else 1), and float scales and
// minimums (d, times Q4_K's and Q5_K's 6-bit scale, dmin times their 6-bit minimum: both
// exact in float32). That is gguf.dequantize's order of operations, and every product is
// exact (at most 11 + 8 + 6 bits), so the only rounding is the subtraction of the
// minimum, made once, as gguf makes it.
//
// A linear layer meets activations quantized per 32 values (linear_common.h). Per row
// and 32-block j it takes the exact integer
//   S_j = sum_k lane_scale[k / 16] * (code[k] - offset) * x_q[k]
// (under 2^24 for every format, Q6_K's 32 * 128 * 32 * 127 the largest, so float(S_j)
// is exact) and, with t_j = scale[j] * x_scale[j],
//   acc[j % 8] = fma(float(S_j), t_j, acc[j % 8]);  acc[j % 8] = fma(-min[j], x_scale[j] * sum x_q, acc[j % 8])
// then y = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)). Every path
// (portable; x86, from the file's bytes or from packed panels) makes these float
// operations in this order, so all give the same floats, whatever the batch around a row.
#pragma once

#include "linear_common.h"

#include <type_traits>
#include <vector>

namespace gguf {

// ggml's numbering (gguf.GGMLQuantizationType).
enum Type : int64_t { kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

constexpr int kGroup = 256;      // weights a group
constexpr int kGroupBlocks = 8;  // 32-wide blocks a group

struct Format {
  int block_size = 0;  // weights a block
  int type_size = 0;   // bytes a block
  int offset = 0;      // taken from every code
  bool has_min = false;
};

// The format of a ggml type; block_size 0 for a type these kernels do not take.
inline Format format_of(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18, 8, false};
    case kQ5_0: return {32, 22, 16, false};
    case kQ8_0: return {32, 34, 0, false};
    case kQ4_K: return {256, 144, 0, true};
    case kQ5_K: return {256, 176, 0, true};
    case kQ6_K: return {256, 210, 32, false};
    default: return {};
  }
}

// The bytes of one group.
inline int64_t group_bytes(const Format& f) { return f.type_size * (kGroup / f.block_size); }

struct Group {
  int16_t code[kGroup];
  int16_t lane_scale[16];
  float scale[kGroupBlocks];
  float min[kGroupBlocks];
};

inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return linear::half_to_float(h);
}

inline uint16_t u16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_K's and Q5_K's 12 bytes of 6-bit scales and minimums: sc[0..7] then m[0..7].
// Bytes 0-3 hold sc 0-3 (and the top bits of sc 4-7), 4-7 hold m 0-3 (and the top bits
// of m 4-7), 8-11 the low 4 bits of sc 4-7 and of m 4-7; done four bytes at a time.
inline void k_scales(const uint8_t* s, uint8_t out[16]) {
  const uint32_t lo = u32_at(s), mid = u32_at(s + 4), hi = u32_at(s + 8);
  const uint32_t words[4] = {lo & 0x3f3f3f3fu, (hi & 0x0f0f0f0fu) | ((lo >> 2) & 0x30303030u),
                             mid & 0x3f3f3f3fu, ((hi >> 4) & 0x0f0f0f0fu) | ((mid >> 2) & 0x30303030u)};
  std::memcpy(out, words, 16);
}

// One group of a 32-wide type from `blocks` (<= 8) blocks at `p`; the rest are zeros.
inline void decode_32(int64_t type, const uint8_t* p, int blocks, Group& g) {
  const Format f = format_of(type);
  for (int s = 0; s < 16; ++s) g.lane_scale[s] = 1;
  for (int j = 0; j < kGroupBlocks; ++j) {
    int16_t* q = g.code + 32 * j;
    g.min[j] = 0.f;
    if (j >= blocks) {
      g.scale[j] = 0.f;
      std::fill(q, q + 32, int16_t(0));
      continue;
    }
    const uint8_t* b = p + j * f.type_size;
    g.scale[j] = fp16_at(b);
    if (type == kQ8_0) {
      for (int k = 0; k < 32; ++k) q[k] = int8_t(b[2 + k]);
    } else if (type == kQ4_0) {  // value k < 16: low nibble of byte k; k >= 16: high nibble of byte k - 16
      for (int k = 0; k < 16; ++k) {
        q[k] = b[2 + k] & 15;
        q[k + 16] = b[2 + k] >> 4;
      }
    } else {  // Q5_0: as Q4_0, and bit k of the 32-bit qh is value k's fifth bit
      const uint32_t qh = u32_at(b + 2);
      for (int k = 0; k < 16; ++k) {
        q[k] = (b[6 + k] & 15) | (((qh >> k) & 1) << 4);
        q[k + 16] = (b[6 + k] >> 4) | (((qh >> (k + 16)) & 1) << 4);
      }
    }
  }
}

// Q4_K: d, dmin, 12 bytes of scales, then 128 bytes: 32-blocks 2i and 2i + 1 are the low
// and high nibbles of bytes 32i..32i+31. Q5_K adds 32 bytes before those: bit j of byte l
// is value l's fifth bit in 32-block j.
inline void decode_k4(int64_t type, const uint8_t* b, Group& g) {
  const float d = fp16_at(b), dmin = fp16_at(b + 2);
  uint8_t sm[16];
  k_scales(b + 4, sm);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = type == kQ5_K ? b + 48 : b + 16;
  for (int s = 0; s < 16; ++s) g.lane_scale[s] = 1;
  for (int j = 0; j < kGroupBlocks; ++j) {
    g.scale[j] = d * float(sm[j]);
    g.min[j] = dmin * float(sm[8 + j]);
    for (int l = 0; l < 32; ++l) {
      int v = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
      if (type == kQ5_K) v |= ((qh[l] >> j) & 1) << 4;
      g.code[32 * j + l] = int16_t(v);
    }
  }
}

// Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (one per 16 values),
// d. 32-block j = 4h + t (h: which half of the 256, t < 4) takes value l's low bits from
// nibble t / 2 of low byte 64h + 32(t % 2) + l, its high bits from bits 2t, 2t + 1 of
// high byte 32h + l.
inline void decode_q6_k(const uint8_t* b, Group& g) {
  const float d = fp16_at(b + 208);
  for (int s = 0; s < 16; ++s) g.lane_scale[s] = int8_t(b[192 + s]);
  for (int j = 0; j < kGroupBlocks; ++j) {
    const int h = j / 4, t = j % 4;
    g.scale[j] = d;
    g.min[j] = 0.f;
    for (int l = 0; l < 32; ++l) {
      const int low = (b[64 * h + 32 * (t % 2) + l] >> (4 * (t / 2))) & 15;
      const int high = (b[128 + 32 * h + l] >> (2 * t)) & 3;
      g.code[32 * j + l] = int16_t(low | (high << 4));
    }
  }
}

// Group `index` of a row of `k` weights at `row`.
inline void decode_group(int64_t type, const uint8_t* row, int64_t k, int64_t index, Group& g) {
  const Format f = format_of(type);
  const uint8_t* p = row + index * group_bytes(f);
  if (f.block_size == 32) {
    const int64_t blocks = std::min<int64_t>(kGroupBlocks, k / 32 - index * kGroupBlocks);
    decode_32(type, p, int(blocks), g);
  } else if (type == kQ6_K) {
    decode_q6_k(p, g);
  } else {
    decode_k4(type, p, g);
  }
}

// A tile's activation rows, quantized (linear_common.h's Rows, from the tile's first row).
struct Acts {
  const int8_t* q;
  int64_t ldq;
  const float* xs;   // block scales, ldb a row
  const float* xss;  // block scale x block sum
  int64_t ldb;
  const int16_t* sum16;  // sums of each 16, ld16 a row
  int64_t ld16;

  // The rows from row i on.
  Acts from(int i) const { return {q + i * ldq, ldq, xs + i * ldb, xss + i * ldb, ldb, sum16 + i * ld16, ld16}; }
};

// n_rows weight rows of ggml type `type` from `w` (row_bytes apart, k weights a row)
// against mb (<= kMaxM) activation rows: out[i * kTileN + r].
using RowsFn = void (*)(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k,
                        const Acts& a, int mb, float* out);

// n_rows (<= Kernels::panel_rows) weight rows from `w` (row_bytes apart) laid out afresh
// at `dst` (panel_bytes) for many activation rows: a *panel* (gguf_panels_x86.h).
using PackFn = void (*)(const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k, uint8_t* dst);
// A panel of n_rows rows against mb activation rows: out[i * kTileN + r].
using PanelFn = void (*)(const uint8_t* panel, int64_t n_rows, int64_t k, const Acts& a, int mb, float* out);

// A code path's kernels of one format; pack and panel null where the path has no panels.
struct Kernels {
  RowsFn rows;
  PackFn pack;
  PanelFn panel;
  int panel_rows;        // rows a panel holds
  int panel_block_bytes;  // bytes a panel holds a row and 32-block
  // Panels packed once (gguf_pack_panels), compact for Q8_0 and Q4_0 (the file's size):
  // how they are packed and read, their bytes a row and 32-block, and the fewest
  // activation rows that read them rather than the part's bytes.
  PackFn pack_once = nullptr;
  PanelFn panel_once = nullptr;
  int once_block_bytes = 0;
  int once_from_rows = 0;
};

// Room for a panel of `rows` rows of K weights: 32 codes and at most 3 floats a row and
// 32-block (rounded up to whole cache lines).
inline int64_t panel_bytes(int64_t k, int64_t rows) { return ((k / 32) * rows * 44 + 63) / 64 * 64; }

}  // namespace gguf
