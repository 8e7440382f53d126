// What the quantized linear kernels share: the run-time choice of code path, the
// quantization of activations (per row, in blocks of 32 input channels, to int8 with a
// float scale), and the loop over output tiles. int8_linear.cpp and q4_linear.cpp each
// add their weight layout and their tile code; bindings.cpp binds them.
#pragma once

#include "aten_light.h"
#include "isa.h"
#include "parallel.h"
#include "vector_math.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>


at::Tensor int8_linear(at::Tensor x, at::Tensor qweight, at::Tensor wscale, at::Tensor wsum,
                          at::Tensor bias, int64_t out_features, int64_t isa, int64_t x_levels,
                          int64_t activation, at::Tensor out);
at::Tensor q4_linear(at::Tensor x, at::Tensor qweight, at::Tensor wscale, at::Tensor wmin,
                        at::Tensor bias, int64_t out_features, int64_t isa, int64_t activation, at::Tensor out);
// GGUF blocks as they lie in the file (gguf_linear.cpp): layout (P, 3) int64, one row
// [ggml_type, rows, data_ptr] per part of the output dimension, or (P, 5) with each
// part's panels packed once (gguf_pack_panels) and the code path they are for.
at::Tensor gguf_linear(at::Tensor x, at::Tensor layout, at::Tensor bias, int64_t in_features, int64_t isa,
                       int64_t activation, at::Tensor out);
at::Tensor gguf_linear_argmax(at::Tensor x, at::Tensor layout, at::Tensor bias, int64_t in_features, int64_t isa);
at::Tensor int8_linear_argmax(at::Tensor x, at::Tensor qweight, at::Tensor wscale, at::Tensor wsum, at::Tensor bias,
                              int64_t out_features, int64_t isa, int64_t x_levels);
at::Tensor gguf_dequantize(at::Tensor layout, int64_t in_features);
at::Tensor gguf_pack_panels(at::Tensor data, int64_t type, int64_t in_features, int64_t isa);
int64_t gguf_panel_bytes(int64_t type, int64_t rows, int64_t in_features, int64_t isa);
int64_t gguf_panels_from_rows(int64_t type, int64_t isa);

namespace linear {

constexpr int kBlock = 16;  // output channels per packed block
constexpr int kTileN = 32;  // output channels per tile (2 blocks)
constexpr int kMaxM = 4;    // activation rows per tile
constexpr int kQ = 32;      // input channels per quantization block

// What the output step applies after the bias (qlinear.py's FUSED_ACTIVATIONS).
enum Activation : int64_t { kNoActivation = 0, kGelu = 1 };

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
// when asked, each block's scale x (sum of its quantized values), which q4's block
// minimum meets, and the sum of each 16 quantized values (GGUF's offsets and 16-wide
// sub-blocks meet them; exact integers, the format's offset taken out). The memory is the calling thread's, kept between calls (make_rows): a
// fresh megabyte-sized buffer a call costs page faults.
struct Rows {
  int8_t* q = nullptr;
  float* scale = nullptr;
  float* scaled_sum = nullptr;  // null unless asked for
  int16_t* sum16 = nullptr;     // kp / 16 a row; null unless asked for
  int64_t kp = 0, qblocks = 0;
};

// How activations are quantized: to integers in [-levels, levels] (127: int8; 63: 7 bits,
// which the AVX2 path multiplies as unsigned bytes without the sign trick), each byte
// holding value + offset (128: the vpdpbusd layout; 64: 7 bits as uint8 in [1, 127]).
// Padding holds `offset` (a zero value).
struct RowFormat {
  int levels = 127;
  int offset = 0;
};

// One block of `n` <= kQ values (the rest of the block's bytes are padding): its scale,
// and the sum of its quantized values.
inline float quantize_block(const float* x, int64_t n, RowFormat f, int8_t* q, int32_t* sum) {
  float absmax = 0.f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  const float inv = absmax > 0.f ? float(f.levels) / absmax : 0.f;
  int32_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int v = std::clamp(int(std::nearbyint(x[i] * inv)), -f.levels, f.levels);
    total += v;
    q[i] = int8_t(uint8_t(v + f.offset));
  }
  for (int64_t i = n; i < kQ; ++i) q[i] = int8_t(uint8_t(f.offset));
  *sum = total;
  return absmax / float(f.levels);
}

#if defined(__x86_64__) || defined(__i386__)
// quantize_block for a whole block (n == kQ) in AVX2, bit for bit the same: the same
// absmax, the same float products, rounded to nearest even as nearbyint does.
__attribute__((target("avx2"))) inline float quantize_block_avx2(const float* x, RowFormat f, int8_t* q,
                                                                   int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float absmax = _mm_cvtss_f32(m4);
  const float inv = absmax > 0.f ? float(f.levels) / absmax : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i hi = _mm256_set1_epi32(f.levels), lo = _mm256_set1_epi32(-f.levels);
  __m256i r[4];
  __m256i total = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_max_epi32(lo, _mm256_min_epi32(hi, _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vinv))));
    total = _mm256_add_epi32(total, r[j]);
  }
  // packs interleave 128-bit lanes: dwords come out as a0 b0 c0 d0 a1 b1 c1 d1 (4 values each)
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)q, _mm256_add_epi8(ordered, _mm256_set1_epi8(char(f.offset))));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  *sum = _mm_cvtsi128_si32(t);
  return absmax / float(f.levels);
}
#endif

// Room for x's rows quantized; with `with_sums`, each block's scale x (sum of its
// values) too (q4's minimums meet it); with `with_sums16`, the sums of each 16 values.
// Valid until this thread's next make_rows.
inline Rows make_rows(int64_t m_total, int64_t kp, bool with_sums, bool with_sums16 = false) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> scale, scaled_sum;
  thread_local std::vector<int16_t> sum16;
  auto room = [](auto& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    return v.data();
  };
  Rows rows;
  rows.kp = kp;
  rows.qblocks = kp / kQ;
  rows.q = room(q, m_total * kp);
  rows.scale = room(scale, m_total * rows.qblocks);
  if (with_sums) rows.scaled_sum = room(scaled_sum, m_total * rows.qblocks);
  if (with_sums16) rows.sum16 = room(sum16, m_total * (kp / 16));
  return rows;
}

// Quantizes rows [begin, end) of x (M, K) float32 into `rows`.
inline void quantize_rows(const at::Tensor& x, RowFormat format, Rows& rows, int64_t begin, int64_t end) {
  const int64_t k = x.size(1), kp = rows.kp, qblocks = rows.qblocks;
  const bool avx2 = best_isa() >= kAvx2, with_sums = rows.scaled_sum != nullptr;
  const float* x_ptr = x.data_ptr<float>();
  for (int64_t m = begin; m < end; ++m) {
    const float* xr = x_ptr + m * k;
    int8_t* q = rows.q + m * kp;
    for (int64_t b0 = 0; b0 < kp; b0 += kQ) {
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(kQ, k - b0));
      int32_t sum;
      float scale;
#if defined(__x86_64__) || defined(__i386__)
      if (avx2 && n == kQ)
        scale = quantize_block_avx2(xr + b0, format, q + b0, &sum);
      else
#endif
        scale = quantize_block(xr + b0, n, format, q + b0, &sum);
      rows.scale[m * qblocks + b0 / kQ] = scale;
      if (with_sums) rows.scaled_sum[m * qblocks + b0 / kQ] = scale * float(sum);
      if (rows.sum16)
        for (int half = 0; half < 2; ++half) {
          int32_t s16 = 0;  // |s16| <= 16 * 127
          for (int i = 16 * half; i < 16 * half + 16; ++i)
            s16 += format.offset ? int(uint8_t(q[b0 + i])) - format.offset : int(q[b0 + i]);
          rows.sum16[m * (kp / 16) + b0 / 16 + half] = int16_t(s16);
        }
    }
  }
}

// `out` when given (checked: contiguous float32 (M, N)), else a new (M, N) tensor.
inline at::Tensor output_for(const at::Tensor& x, int64_t n_out, at::Tensor out) {
  if (out.numel() == 0) return x.new_empty({x.size(0), n_out});
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == n_out,
              "quantized linear: out must be contiguous float32 (M, N)");
  return out;
}

// What a kernel does with a tile before its rows pass over it: nothing, unless it lays
// the tile's weights out afresh once for the chunk's rows (gguf_linear.cpp).
struct NoPrepare {
  void operator()(int64_t /*tile*/, int64_t /*rows*/) const {}
};

// Rows a thread must have before the rows, not the output tiles, are split between threads.
constexpr int64_t kRowsPerThread = 32;

// How a call's work is split: rows_per_thread and rows_per_item as kRowsPerThread and
// kRowsPerItem; chunk_bytes, the bytes of quantized rows that pass over each tile in
// turn (kept in L2 meanwhile). A kernel
// that lays each tile out afresh (prepare) pays for that once a chunk and once a thread
// that splits rows, so it splits tiles for longer and takes larger chunks.
struct Split {
  int64_t rows_per_thread = kRowsPerThread;
  int64_t chunk_bytes = 256 * 1024;
  int64_t rows_per_item = 64;  // kRowsPerItem
  int64_t tiles_per_item = 0;  // > 0: split tiles as items the threads take in turn (parallel_items)
};

// Where a call keeps only each row's largest output (greedy decoding's argmax): per row
// and output tile, the tile's largest value and its output channel, (M, n_tiles) each.
// Every cell is written by the one thread that ran that tile for that row, however the
// call is split; `argmax_of_maxima` then reads each row's tiles in order.
struct TileMaxima {
  float* value;
  int64_t* index;
  int64_t n_tiles;
};

// The largest of v[0, n) (n > 0) and where it is (the first of equal ones; a NaN counts
// as the largest, the first NaN winning, as torch's argmax has it).
inline std::pair<float, int64_t> maximum_of_portable(const float* v, int64_t n) {
  float most = v[0];
  int64_t at = 0;
  for (int64_t c = 1; c < n && !std::isnan(most); ++c)
    if (v[c] > most || std::isnan(v[c])) most = v[c], at = c;
  return {most, at};
}

#if defined(__x86_64__) || defined(__i386__)
// The largest of v's 8 lanes (none a NaN).
__attribute__((target("avx2"))) inline float lanes_max(__m256 v) {
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
}

// The same: the largest value and whether any is a NaN, 8 lanes at a time, then the
// first lane equal to it (or the first NaN). With no NaN, vmaxps is exact and == finds
// the first of equal values (-0 and +0 equal, as for `>` above).
__attribute__((target("avx2"))) inline std::pair<float, int64_t> maximum_of_avx2(const float* v, int64_t n) {
  if (n < 8) return maximum_of_portable(v, n);
  __m256 most = _mm256_loadu_ps(v), nan = _mm256_cmp_ps(most, most, _CMP_UNORD_Q);
  int64_t c = 8;
  for (; c + 8 <= n; c += 8) {
    const __m256 x = _mm256_loadu_ps(v + c);
    most = _mm256_max_ps(most, x);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(nan) != 0) return maximum_of_portable(v, n);  // (rare: the first NaN)
  float best = lanes_max(most);
  for (int64_t t = c; t < n; ++t) {  // the tail
    if (std::isnan(v[t])) return maximum_of_portable(v, n);
    best = std::max(best, v[t]);
  }
  const __m256 b = _mm256_set1_ps(best);
  for (int64_t i = 0; i + 8 <= n; i += 8)
    if (const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), b, _CMP_EQ_OQ)))
      return {best, i + __builtin_ctz(hit)};
  for (int64_t i = n / 8 * 8;; ++i)
    if (v[i] == best) return {best, i};
}
#endif

inline std::pair<float, int64_t> maximum_of(const float* v, int64_t n, bool avx2) {
#if defined(__x86_64__) || defined(__i386__)
  if (avx2) return maximum_of_avx2(v, n);
#endif
  return maximum_of_portable(v, n);
}

// A tile's maxima for its mb rows (acc: kTileN floats a row, `width` of them outputs n0
// on): one call a tile, the whole-tile case in registers (through maximum_of_avx2's loops
// instead, the 270M's LM head at 64 rows took 1.12x the time).
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2"))) inline void keep_tile_maxima_avx2(const float* acc, int mb, int64_t width,
                                                                   int64_t n0, float* value, int64_t* index,
                                                                   int64_t stride) {
  static_assert(kTileN == 32, "a whole tile is 4 vectors of 8");
  for (int i = 0; i < mb; ++i) {
    const float* v = acc + i * kTileN;
    if (width == kTileN) {
      const __m256 a = _mm256_loadu_ps(v), b = _mm256_loadu_ps(v + 8), c = _mm256_loadu_ps(v + 16),
                   d = _mm256_loadu_ps(v + 24);
      const __m256 nan = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)),
                                      _mm256_or_ps(_mm256_cmp_ps(c, c, _CMP_UNORD_Q), _mm256_cmp_ps(d, d, _CMP_UNORD_Q)));
      if (_mm256_movemask_ps(nan) == 0) {
        const float best = lanes_max(_mm256_max_ps(_mm256_max_ps(a, b), _mm256_max_ps(c, d)));
        const __m256 all = _mm256_set1_ps(best);
        const uint32_t hits = uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(a, all, _CMP_EQ_OQ))) |
                              uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(b, all, _CMP_EQ_OQ))) << 8 |
                              uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(c, all, _CMP_EQ_OQ))) << 16 |
                              uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(d, all, _CMP_EQ_OQ))) << 24;
        value[i * stride] = best, index[i * stride] = n0 + __builtin_ctz(hits);
        continue;
      }
    }
    const auto [most, at] = maximum_of_avx2(v, width);
    value[i * stride] = most, index[i * stride] = n0 + at;
  }
}
#endif

inline void keep_tile_maxima(const float* acc, int mb, int64_t width, int64_t n0, float* value, int64_t* index,
                             int64_t stride, bool avx2) {
#if defined(__x86_64__) || defined(__i386__)
  if (avx2) return keep_tile_maxima_avx2(acc, mb, width, n0, value, index, stride);
#endif
  for (int i = 0; i < mb; ++i) {
    const auto [most, at] = maximum_of_portable(acc + i * kTileN, width);
    value[i * stride] = most, index[i * stride] = n0 + at;
  }
}

// Row r's argmax over its tiles' maxima (their channels), rows [m0, m1).
inline void argmax_of_maxima(const TileMaxima& maxima, int64_t m0, int64_t m1, int64_t* out) {
  const bool avx2 = best_isa() >= kAvx2;
  for (int64_t r = m0; r < m1; ++r) {
    const int64_t tile = maximum_of(maxima.value + r * maxima.n_tiles, maxima.n_tiles, avx2).second;
    out[r] = maxima.index[r * maxima.n_tiles + tile];
  }
}

// Rows [m0, m1) through tiles [t0, t1): tile(m, mb, block, acc) for every tile of kTileN
// output channels (starting at packed block `block`) and every run of up to kMaxM rows;
// the tile fills acc[i * kTileN + c], which lands in out (plus bias, then the
// activation: applied here, the output is written once, while it is in L1), or, given
// `maxima`, only its largest value per row does. Rows go in
// chunks that stay in L2 while every weight tile passes over them; prepare(t, rows) is
// called on tile t before a chunk of `rows` rows passes over it, on the same thread.
template <typename TileCall, typename Prepare = NoPrepare>
void run_tiles(int64_t m0, int64_t m1, int64_t t0, int64_t t1, int64_t n_out, int64_t kp, const float* bias,
               int64_t activation, float* out, const TileCall& tile, const Prepare& prepare = Prepare{},
               Split split = Split{}, const TileMaxima* maxima = nullptr) {
  const bool avx2 = best_isa() >= kAvx2;
  const int64_t m_chunk = std::max<int64_t>(kMaxM, (split.chunk_bytes / kp) / kMaxM * kMaxM);
  float acc[kMaxM * kTileN];
  for (int64_t c0 = m0; c0 < m1; c0 += m_chunk) {
    const int64_t c1 = std::min(m1, c0 + m_chunk);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileN;
      const int64_t width = std::min<int64_t>(kTileN, n_out - n0);
      prepare(t, c1 - c0);
      for (int64_t m = c0; m < c1; m += kMaxM) {
        const int mb = int(std::min<int64_t>(kMaxM, c1 - m));
        tile(m, mb, n0 / kBlock, acc);
        if (bias)
          for (int i = 0; i < mb; ++i)
            for (int64_t c = 0; c < width; ++c) acc[i * kTileN + c] += bias[n0 + c];
        // the whole tile at once, padded columns too (zero weights: finite, never written)
        if (activation == kGelu) vmath::gelu_inplace(acc, mb * kTileN, avx2);
        if (maxima != nullptr) {
          const int64_t at = m * maxima->n_tiles + t;
          keep_tile_maxima(acc, mb, width, n0, maxima->value + at, maxima->index + at, maxima->n_tiles, avx2);
          continue;
        }
        for (int i = 0; i < mb; ++i) std::memcpy(out + (m + i) * n_out + n0, acc + i * kTileN, width * sizeof(float));
      }
    }
  }
}

// Rows a thread takes at most at a time when the rows are split (parallel_items): small
// enough that a thread that loses its core holds the others up little, large enough that
// each pass of the weights (from L3: 0.6 MB for 1536 x 384) serves many rows. The items
// are as many per thread, and of one size: 64 rows on 2 threads make 2 items of 32 (one
// item of 64 ran on one thread), 192 rows make 4 of 48 (3 of 64 gave one thread twice
// the other's rows).
constexpr int64_t kRowsPerItem = 64;

// The rows of one item when m_total rows are split between `threads` threads.
inline int64_t item_rows(int64_t m_total, int64_t threads, int64_t rows_per_item = kRowsPerItem) {
  const int64_t per_thread = (m_total + threads - 1) / threads;
  const int64_t items = (per_thread + rows_per_item - 1) / rows_per_item * threads;
  const int64_t rows = (m_total + items - 1) / items;
  return (rows + kMaxM - 1) / kMaxM * kMaxM;
}

// x (M, K) quantized into `rows` (made by make_rows) and through every tile (run_tiles).
// Many rows (prefill, encoders): the rows go in items of up to kRowsPerItem, which the
// threads take as they finish one; each item is quantized and passed through every
// weight tile by the thread that took it, so no thread waits for another between the
// two. Few rows (decode): the output tiles are split between threads instead, so each
// reads only its share of the weights.
template <typename TileCall, typename Prepare = NoPrepare>
void quantize_and_run_tiles(const at::Tensor& x, RowFormat format, Rows& rows, int64_t n_out, const float* bias,
                            int64_t activation, float* out, const TileCall& tile, const Prepare& prepare = Prepare{},
                            Split split = Split{}, const TileMaxima* maxima = nullptr) {
  const int64_t m_total = x.size(0), kp = rows.kp;
  const int64_t n_tiles = (n_out + kTileN - 1) / kTileN;
  const int64_t threads = at::get_num_threads();
  if (m_total >= split.rows_per_thread * threads) {
    static_assert(kRowsPerItem % kMaxM == 0, "items hold whole runs of kMaxM rows");
    const int64_t rows_per_item = item_rows(m_total, threads, split.rows_per_item);
    parallel_items((m_total + rows_per_item - 1) / rows_per_item, [&](int64_t item) {
      const int64_t m0 = item * rows_per_item, m1 = std::min(m_total, m0 + rows_per_item);
      quantize_rows(x, format, rows, m0, m1);
      run_tiles(m0, m1, 0, n_tiles, n_out, kp, bias, activation, out, tile, prepare, split, maxima);
    });
    return;
  }
  at::parallel_for(0, m_total, 16, [&](int64_t begin, int64_t end) { quantize_rows(x, format, rows, begin, end); });
  if (split.tiles_per_item > 0) {
    parallel_items((n_tiles + split.tiles_per_item - 1) / split.tiles_per_item, [&](int64_t item) {
      const int64_t t0 = item * split.tiles_per_item, t1 = std::min(n_tiles, t0 + split.tiles_per_item);
      run_tiles(0, m_total, t0, t1, n_out, kp, bias, activation, out, tile, prepare, split, maxima);
    });
    return;
  }
  at::parallel_for(0, n_tiles, 4, [&](int64_t t_begin, int64_t t_end) {
    run_tiles(0, m_total, t_begin, t_end, n_out, kp, bias, activation, out, tile, prepare, split, maxima);
  });
}

// The argmax of each row of a kernel's (M, n_out) outputs, int64 (M,), without writing
// them: run(maxima) makes the kernel's quantize_and_run_tiles call with `maxima`.
template <typename Run>
at::Tensor argmax_through_maxima(const at::Tensor& x, int64_t n_out, const Run& run) {
  const int64_t m = x.size(0), n_tiles = (n_out + kTileN - 1) / kTileN;
  at::Tensor ids = x.new_empty({m}, x.options().dtype(at::kLong));
  if (m == 0 || n_out == 0) return ids;
  at::Tensor value = x.new_empty({m, n_tiles}), index = x.new_empty({m, n_tiles}, x.options().dtype(at::kLong));
  const TileMaxima maxima{value.data_ptr<float>(), index.data_ptr<int64_t>(), n_tiles};
  run(&maxima);
  int64_t* out = ids.data_ptr<int64_t>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) { argmax_of_maxima(maxima, begin, end, out); });
  return ids;
}

}  // namespace linear
