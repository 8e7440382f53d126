// GGUF quantized weights x int8 activations on CPU: y = x @ W^T (+ bias), with W's
// blocks read where they lie (the mapped file), never converted.
//
// A layer is one or more *parts* stacked along the output dimension (a fused q/k/v or
// gate/up projection, whose parts may be of different types), given as an int64 layout
// (P, 3): [ggml_type, rows, data_ptr] per part, each part `rows` rows of ggml's block
// bytes, row after row. The weights the kernel multiplies by are gguf.dequantize's
// (gguf_blocks.h: integer codes and scales, float scales); the only rounding besides
// the float accumulation is of the activations, per row in blocks of 32 to int8
// (linear_common.h).
//
// Output tiles of 32 rows, split between threads by quantize_and_run_tiles (kSplit: by
// tiles for longer than the other kernels, which pack nothing per call). Few activation
// rows (decode) read a tile from the file's bytes, each group of 256 weights loaded once
// for up to 4 rows; many rows first pack the tile into panels (Tiles::prepare), which
// every row of the chunk then meets. A part whose panels were packed once (at load:
// gguf_pack_panels, a layout of 5 columns; Q8_0's and Q4_0's compact) has its tiles'
// panels read from there instead, from Kernels::once_from_rows rows (Q8_0, Q4_0: from
// one). Code paths, chosen at run time: avx512_vnni and avx2 (gguf_x86.h), and portable;
// all give the same floats, whichever way a row goes.
#include "gguf_blocks.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#define GGUF_NS avx2
#define GGUF_TARGET __attribute__((target("avx2,fma,f16c")))
#define GGUF_VNNI 0
#include "gguf_x86.h"
#define GGUF_NS avx512_vnni  // 256-bit vpdpbusd: AVX512-VL too, which every AVX512-VNNI CPU has
#define GGUF_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#define GGUF_VNNI 1
#include "gguf_x86.h"
#endif

namespace {

using namespace linear;
using gguf::Acts;
using gguf::Format;
using gguf::Group;
using gguf::kGroup;
using gguf::kGroupBlocks;

struct Part {
  int64_t type, start, rows, row_bytes;
  const uint8_t* data;
  const uint8_t* panels;  // packed once for the call's code path (gguf_pack_panels), or null
};

// The parts of a layout, checked against K; their rows total N. A layout of 5 columns
// adds each part's panels and the code path they were packed for: a call on another path
// reads the part's bytes.
std::vector<Part> parts_of(const at::Tensor& layout, int64_t k, const char* who, int64_t isa = -1) {
  TORCH_CHECK(layout.device().is_cpu() && layout.scalar_type() == at::kLong && layout.dim() == 2 &&
                  (layout.size(1) == 3 || layout.size(1) == 5) && layout.is_contiguous(),
              who, ": layout must be a contiguous int64 CPU tensor (P, 3) of [ggml_type, rows, data_ptr], "
              "or (P, 5) with [panels_ptr, panels_isa] after them");
  TORCH_CHECK(k > 0, who, ": in_features must be positive");
  const int64_t cols = layout.size(1);
  const int64_t* l = layout.data_ptr<int64_t>();
  std::vector<Part> parts;
  int64_t start = 0;
  for (int64_t p = 0; p < layout.size(0); ++p, l += cols) {
    const Format f = gguf::format_of(l[0]);
    TORCH_CHECK(f.block_size > 0, who, ": ggml type ", l[0], " is not supported (Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, ",
                "Q4_K = 12, Q5_K = 13, Q6_K = 14 are)");
    TORCH_CHECK(k % f.block_size == 0, who, ": in_features ", k, " is not a multiple of ggml type ", l[0],
                "'s block of ", f.block_size);
    TORCH_CHECK(l[1] >= 0 && (l[1] == 0 || l[2] != 0), who, ": part ", p, " has ", l[1], " rows at address ", l[2]);
    const bool panels = cols == 5 && l[3] != 0 && l[4] == isa;
    parts.push_back({l[0], start, l[1], k / f.block_size * f.type_size, reinterpret_cast<const uint8_t*>(l[2]),
                     panels ? reinterpret_cast<const uint8_t*>(l[3]) : nullptr});
    start += l[1];
  }
  return parts;
}

int64_t rows_of(const std::vector<Part>& parts) { return parts.empty() ? 0 : parts.back().start + parts.back().rows; }

// The part that holds output row n.
const Part& part_at(const std::vector<Part>& parts, int64_t n) {
  // the last part that starts at or before n (an empty part starts where the next one does)
  return std::upper_bound(parts.begin(), parts.end(), n, [](int64_t v, const Part& p) { return v < p.start; })[-1];
}

// ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)): gguf_blocks.h's order.
float row_total(const float acc[kGroupBlocks]) {
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// gguf_blocks.h's arithmetic in plain C++.
void rows_portable(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k, const Acts& a,
                   int mb, float* out) {
  const int64_t groups = (k + kGroup - 1) / kGroup;
  const Format f = gguf::format_of(type);
  Group g;
  for (int64_t r = 0; r < n_rows; ++r) {
    float acc[kMaxM][kGroupBlocks] = {};
    for (int64_t gi = 0; gi < groups; ++gi) {
      gguf::decode_group(type, w + r * row_bytes, k, gi, g);
      const int blocks = int(std::min<int64_t>(kGroupBlocks, k / 32 - gi * kGroupBlocks));
      for (int i = 0; i < mb; ++i) {
        const int8_t* x = a.q + i * a.ldq + gi * kGroup;
        const float* xs = a.xs + i * a.ldb + gi * kGroupBlocks;
        const float* xss = a.xss + i * a.ldb + gi * kGroupBlocks;
        for (int j = 0; j < blocks; ++j) {
          int32_t s = 0;
          for (int h = 0; h < 2; ++h) {
            int32_t half = 0;
            for (int l = 32 * j + 16 * h; l < 32 * j + 16 * h + 16; ++l) half += (g.code[l] - f.offset) * x[l];
            s += g.lane_scale[2 * j + h] * half;
          }
          const float t = g.scale[j] * xs[j];
          acc[i][j] = std::fma(float(s), t, acc[i][j]);
          if (f.has_min) acc[i][j] = std::fma(-g.min[j], xss[j], acc[i][j]);
        }
      }
    }
    for (int i = 0; i < mb; ++i) out[i * kTileN + r] = row_total(acc[i]);
  }
}

gguf::Kernels kernels_for(int64_t type, int64_t isa) {
#if defined(__x86_64__) || defined(__i386__)
  if (isa == kAvx512Vnni) return gguf::avx512_vnni::kernels_for(type);
  if (isa == kAvx2) return gguf::avx2::kernels_for(type);
#endif
  return {rows_portable, nullptr, nullptr, 0};
}

// Rows of a chunk from which a tile's weights are packed into panels first; fewer read
// them from the file's bytes, decoding them once per 4 rows. With the blocks packed as
// stored, packing costs less than the second pass over the bytes that 5-8 rows take: at
// 8 rows panels are as fast or faster, at 12 rows 1.3-2x (Q4_K, Q6_K, Q8_0 at 2048 and
// 8192 x 2048, 2 threads; docs/performance.md, "Panels packed once").
constexpr int64_t kPanelRows = 8;

// Packing a tile costs about what 16 activation rows' pass over its panels does (Q4_K):
// rows go through the output tiles split between threads (each tile packed once) up to
// 128 rows a thread, and in chunks and items that pack each tile once for 256 rows.
#ifndef GGUF_SPLIT
#define GGUF_SPLIT 128, 1024 * 1024, 256, 4
#endif
constexpr Split kSplit{GGUF_SPLIT};

// The bytes between a part's panels packed once: every panel holds room for panel_rows.
int64_t panel_stride(const gguf::Kernels& kernels, int64_t k) {
  return ((k / 32) * kernels.panel_rows * kernels.once_block_bytes + 63) / 64 * 64;
}

// One call's tiles: the parts and their kernels, and on each thread the runs of the tile
// it last prepared (its panels: the part's own, or packed there).
class Tiles {
 public:
  Tiles(const std::vector<Part>& parts, int64_t isa, int64_t k, int64_t n_out) : parts_(parts), k_(k), n_out_(n_out) {
    for (const Part& p : parts) {
      kernels_.push_back(kernels_for(p.type, isa));
      prepacked_ = prepacked_ || (p.panels != nullptr && kernels_.back().pack_once != nullptr);
    }
  }

  // Before a chunk of `rows` rows passes over tile t: its runs, each from panels where
  // the part has them, else packed here where worth it, else from the bytes.
  void prepare(int64_t t, int64_t rows) const {
    Prepared& prepared = prepared_here();
    prepared.runs.clear();
    const bool pack = rows >= kPanelRows && kernels_[0].pack != nullptr;
    if (!pack && !prepacked_) return;  // every run from the bytes (run's loop)
    const int64_t n0 = t * kTileN, width = std::min<int64_t>(kTileN, n_out_ - n0);
    const int64_t most = kernels_[0].panel_rows, bytes = gguf::panel_bytes(k_, most);
    // runs of up to `most` rows within one part: one more for each part that starts in the tile
    int64_t to_pack = 0;
    for (int64_t c = 0; c < width;) {
      const Part& p = part_at(parts_, n0 + c);
      const int64_t r0 = n0 + c - p.start, n = std::min({width - c, p.rows - r0, most});
      const gguf::Kernels& kernels = kernels_[&p - parts_.data()];
      const uint8_t* panel = nullptr;
      if (prepacked_ && p.panels != nullptr && rows >= kernels.once_from_rows && r0 % most == 0 &&
          n == std::min(most, p.rows - r0))
        panel = p.panels + r0 / most * panel_stride(kernels, k_);
      else if (pack)
        to_pack += 1;
      prepared.runs.push_back({panel, &p, c, r0, n, panel != nullptr});
      c += n;
    }
    if (to_pack == 0) return;
    if (prepared.room.size() < to_pack * bytes + 64) prepared.room.resize(to_pack * bytes + 64);
    uint8_t* room = prepared.room.data() + (-reinterpret_cast<uintptr_t>(prepared.room.data()) & 63);  // whole lines
    for (Run& run : prepared.runs) {
      if (run.panel != nullptr) continue;
      const Part& p = *run.part;
      kernels_[&p - parts_.data()].pack(p.data + run.r0 * p.row_bytes, p.row_bytes, run.rows, k_, room);
      run.panel = room;
      room += bytes;
    }
  }

  // Output rows [n0, n0 + kTileN) of tile `blk * kBlock / kTileN` against mb activation
  // rows; its columns past the last row zeros (the fused activation runs over the tile).
  void run(const Acts& acts, int mb, int64_t blk, float* acc) const {
    const int64_t n0 = blk * kBlock, width = std::min<int64_t>(kTileN, n_out_ - n0);
    const Prepared& prepared = prepared_here();
    if (!prepared.runs.empty()) {
      for (const Run& run : prepared.runs) {
        const Part& p = *run.part;
        const gguf::Kernels& kernels = kernels_[&p - parts_.data()];
        if (run.once)
          kernels.panel_once(run.panel, run.rows, k_, acts, mb, acc + run.column);
        else if (run.panel != nullptr)
          kernels.panel(run.panel, run.rows, k_, acts, mb, acc + run.column);
        else
          kernels.rows(p.type, p.data + run.r0 * p.row_bytes, p.row_bytes, run.rows, k_, acts, mb, acc + run.column);
      }
    } else {
      for (int64_t c = 0; c < width;) {
        const Part& p = part_at(parts_, n0 + c);
        const int64_t r0 = n0 + c - p.start, n = std::min(width - c, p.rows - r0);
        kernels_[&p - parts_.data()].rows(p.type, p.data + r0 * p.row_bytes, p.row_bytes, n, k_, acts, mb, acc + c);
        c += n;
      }
    }
    for (int i = 0; i < mb; ++i) std::fill(acc + i * kTileN + width, acc + (i + 1) * kTileN, 0.f);
  }

 private:
  struct Run {
    const uint8_t* panel;  // null: from the part's bytes
    const Part* part;
    int64_t column, r0, rows;
    bool once;  // panel: the part's own, packed once (Kernels::panel_once reads it)
  };
  struct Prepared {
    std::vector<uint8_t> room;
    std::vector<Run> runs;
  };
  static Prepared& prepared_here() {
    thread_local Prepared prepared;
    return prepared;
  }

  const std::vector<Part>& parts_;
  std::vector<gguf::Kernels> kernels_;
  bool prepacked_ = false;
  int64_t k_, n_out_;
};

// x through a layout's tiles (gguf_linear's arguments, checked): into `out`, or only each
// row's tile maxima.
void run_layout(at::Tensor x, const std::vector<Part>& parts, const float* bias, int64_t k, int64_t isa,
                int64_t activation, float* out, const TileMaxima* maxima) {
  const int64_t n_out = rows_of(parts);
  const int64_t kp = (k + kGroup - 1) / kGroup * kGroup;  // whole groups: the short one's padding is zeros
  Rows rows = make_rows(x.size(0), kp, /*with_sums=*/true, /*with_sums16=*/true);
  const Tiles tiles(parts, isa, k, n_out);
  const int64_t qblocks = rows.qblocks, ld16 = kp / 16;
  quantize_and_run_tiles(
      x, RowFormat{}, rows, n_out, bias, activation, out,
      [&](int64_t m, int mb, int64_t blk, float* acc) {
        const Acts acts{rows.q + m * kp, kp, rows.scale + m * qblocks, rows.scaled_sum + m * qblocks,
                        qblocks, rows.sum16 + m * ld16, ld16};
        tiles.run(acts, mb, blk, acc);
      },
      [&](int64_t t, int64_t chunk_rows) { tiles.prepare(t, chunk_rows); }, kSplit, maxima);
}

// gguf_linear's checks; returns the parts and x made contiguous.
std::vector<Part> checked(at::Tensor& x, const at::Tensor& layout, const at::Tensor& bias, int64_t in_features,
                          int64_t isa, const char* who) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == in_features,
              who, ": x must be (M, in_features) float32");
  std::vector<Part> parts = parts_of(layout, in_features, who, isa);
  TORCH_CHECK(bias.numel() == 0 ||
                  (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == rows_of(parts)),
              who, ": bias must be float32 (N,)");
  TORCH_CHECK(isa >= kPortable && isa <= best_isa(), who, ": this CPU cannot run isa ", isa);
  x = x.contiguous();
  return parts;
}

}  // namespace

// x: (M, K) float32, K = in_features. layout: (P, 3) int64, [ggml_type, rows, data_ptr]
// per part (module comment). bias: (N,) float32 or empty. Returns (M, N) float32, N the
// parts' rows, written into `out` when it is not empty. activation: as int8_linear's.
at::Tensor gguf_linear(at::Tensor x, at::Tensor layout, at::Tensor bias, int64_t in_features, int64_t isa,
                       int64_t activation, at::Tensor out) {
  const std::vector<Part> parts = checked(x, layout, bias, in_features, isa, "gguf_linear");
  TORCH_CHECK(activation == kNoActivation || activation == kGelu, "gguf_linear: unknown activation ", activation);
  const int64_t n_out = rows_of(parts);
  out = output_for(x, n_out, out);
  if (x.size(0) == 0 || n_out == 0) return out;
  run_layout(x, parts, bias.numel() ? bias.data_ptr<float>() : nullptr, in_features, isa, activation,
             out.data_ptr<float>(), nullptr);
  return out;
}

// gguf_linear(x, ...).argmax(-1) (int64 (M,)), without writing the (M, N) outputs: each
// tile's largest value per row, then each row's largest of those (the first index of
// equal values; a NaN counts as the largest). The same floats as gguf_linear's, so the
// same index as torch's argmax of them. For greedy decoding through an LM head, whose N
// (a vocabulary: 262,144 for Gemma 3) makes the outputs 1 MiB a row.
at::Tensor gguf_linear_argmax(at::Tensor x, at::Tensor layout, at::Tensor bias, int64_t in_features, int64_t isa) {
  const std::vector<Part> parts = checked(x, layout, bias, in_features, isa, "gguf_linear_argmax");
  TORCH_CHECK(rows_of(parts) > 0, "gguf_linear_argmax: the layout has no rows");
  return argmax_through_maxima(x, rows_of(parts), [&](const TileMaxima* maxima) {
    run_layout(x, parts, bias.numel() ? bias.data_ptr<float>() : nullptr, in_features, isa, kNoActivation, nullptr,
               maxima);
  });
}

// The (N, K) float32 weights of a layout, from the decode the kernels use: equal to
// gguf.dequantize of the same blocks, bit for bit.
at::Tensor gguf_dequantize(at::Tensor layout, int64_t in_features) {
  const std::vector<Part> parts = parts_of(layout, in_features, "gguf_dequantize");
  const int64_t n_out = rows_of(parts), k = in_features;
  at::Tensor out = layout.new_empty({n_out, k}, layout.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
    Group g;
    for (int64_t n = begin; n < end; ++n) {
      const Part& p = part_at(parts, n);
      const uint8_t* row = p.data + (n - p.start) * p.row_bytes;
      const int offset = gguf::format_of(p.type).offset;
      for (int64_t gi = 0; gi * kGroup < k; ++gi) {
        gguf::decode_group(p.type, row, k, gi, g);
        float* w = o + n * k + gi * kGroup;
        for (int64_t l = 0; l < std::min<int64_t>(kGroup, k - gi * kGroup); ++l)
          w[l] = (g.scale[l / 32] * float(g.lane_scale[l / 16])) * float(g.code[l] - offset) - g.min[l / 32];
      }
    }
  });
  return out;
}

// Asks the kernel for 2 MiB pages under `t`'s whole 2 MiB stretches, before anything is
// written there (Linux; elsewhere, and where transparent huge pages are off, nothing). A
// batch-1 step streams every weight once: over 4 KiB pages a core's reads of them ran at
// ~0.73x the rate over 2 MiB pages (the TLB misses of nested paging on a VM: 302 MB of
// Q4_K, one row, 2 threads: 10.6 against 14.5 GB/s).
static void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(t.data_ptr()) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(t.data_ptr()) + t.nbytes()) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // (advice: its failure is harmless)
#endif
}

// The panels of one part ((rows, row_bytes) uint8 blocks of ggml type `type`) for code
// path `isa`, packed once: panel i holds rows [i * R, (i + 1) * R), R the path's
// panel_rows, at i * stride. What a (P, 5) layout's panels_ptr points to.
at::Tensor gguf_pack_panels(at::Tensor data, int64_t type, int64_t in_features, int64_t isa) {
  const Format f = gguf::format_of(type);
  TORCH_CHECK(f.block_size > 0 && in_features > 0 && in_features % f.block_size == 0,
              "gguf_pack_panels: ggml type ", type, " with ", in_features, " inputs is not supported");
  const int64_t row_bytes = in_features / f.block_size * f.type_size;
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.size(1) == row_bytes && data.is_contiguous(),
              "gguf_pack_panels: data must be contiguous uint8 (rows, ", row_bytes, ")");
  TORCH_CHECK(isa >= kPortable && isa <= best_isa(), "gguf_pack_panels: this CPU cannot run isa ", isa);
  const gguf::Kernels kernels = kernels_for(type, isa);
  TORCH_CHECK(kernels.pack_once != nullptr, "gguf_pack_panels: code path ", isa, " has no panels");
  const int64_t rows = data.size(0), most = kernels.panel_rows, stride = panel_stride(kernels, in_features);
  const int64_t panels = (rows + most - 1) / most;
  at::Tensor out = data.new_empty({panels * stride});
  advise_huge_pages(out);
  const uint8_t* w = data.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      kernels.pack_once(w + i * most * row_bytes, row_bytes, std::min(most, rows - i * most), in_features,
                        o + i * stride);
  });
  return out;
}

// The fewest activation rows that read a part's panels packed once rather than its bytes
// (1: every call reads them, so the part's bytes are not read again; 0 where the path has
// no panels).
int64_t gguf_panels_from_rows(int64_t type, int64_t isa) { return kernels_for(type, isa).once_from_rows; }

// The bytes gguf_pack_panels makes of `rows` rows (0 where the path has no panels).
int64_t gguf_panel_bytes(int64_t type, int64_t rows, int64_t in_features, int64_t isa) {
  const gguf::Kernels kernels = kernels_for(type, isa);
  if (kernels.pack_once == nullptr) return 0;
  return (rows + kernels.panel_rows - 1) / kernels.panel_rows * panel_stride(kernels, in_features);
}
