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
// Output tiles of 32 rows, split between threads as the other quantized kernels' are
// (quantize_and_run_tiles); within a tile each weight row's groups of 256 are loaded
// once and met by up to 4 activation rows. Code paths, chosen at run time: avx512_vnni
// and avx2 (gguf_x86.h), and portable; all give the same floats.
#include "gguf_blocks.h"

#if defined(__x86_64__) || defined(__i386__)
#define GGUF_NS avx2
#define GGUF_TARGET __attribute__((target("avx2,fma,f16c")))
#define GGUF_VNNI 0
#include "gguf_x86.h"
#define GGUF_NS avx512_vnni
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
using gguf::RowsFn;

struct Part {
  int64_t type, start, rows, row_bytes;
  const uint8_t* data;
};

// The parts of a layout, checked against K; their rows total N.
std::vector<Part> parts_of(const at::Tensor& layout, int64_t k, const char* who) {
  TORCH_CHECK(layout.device().is_cpu() && layout.scalar_type() == at::kLong && layout.dim() == 2 &&
                  layout.size(1) == 3 && layout.is_contiguous(),
              who, ": layout must be a contiguous int64 CPU tensor (P, 3) of [ggml_type, rows, data_ptr]");
  TORCH_CHECK(k > 0, who, ": in_features must be positive");
  const int64_t* l = layout.data_ptr<int64_t>();
  std::vector<Part> parts;
  int64_t start = 0;
  for (int64_t p = 0; p < layout.size(0); ++p, l += 3) {
    const Format f = gguf::format_of(l[0]);
    TORCH_CHECK(f.block_size > 0, who, ": ggml type ", l[0], " is not supported (Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, ",
                "Q4_K = 12, Q5_K = 13, Q6_K = 14 are)");
    TORCH_CHECK(k % f.block_size == 0, who, ": in_features ", k, " is not a multiple of ggml type ", l[0],
                "'s block of ", f.block_size);
    TORCH_CHECK(l[1] >= 0 && (l[1] == 0 || l[2] != 0), who, ": part ", p, " has ", l[1], " rows at address ", l[2]);
    parts.push_back({l[0], start, l[1], k / f.block_size * f.type_size, reinterpret_cast<const uint8_t*>(l[2])});
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

// The same total as the x86 paths' `total`, in the same order.
float row_total(const float acc[kGroupBlocks]) {
  const float a0 = acc[0] + acc[4], a1 = acc[1] + acc[5], a2 = acc[2] + acc[6], a3 = acc[3] + acc[7];
  return (a0 + a2) + (a1 + a3);
}

// The arithmetic of gguf_blocks.h in plain C++: what the x86 paths do lane by lane.
void rows_portable(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k, const Acts& a,
                   int mb, float* out) {
  const int64_t groups = (k + kGroup - 1) / kGroup;
  const Format f = gguf::format_of(type);
  Group g;
  for (int64_t r = 0; r < n_rows; ++r) {
    float acc[kMaxM][4][8] = {}, acc_blocks[kMaxM][kGroupBlocks] = {};
    for (int64_t gi = 0; gi < groups; ++gi) {
      gguf::decode_group(type, w + r * row_bytes, k, gi, g);
      for (int i = 0; i < mb; ++i) {
        const int8_t* x = a.q + i * a.ldq + gi * kGroup;
        const float* xs = a.xs + i * a.ldb + gi * kGroupBlocks;
        const float* xss = a.xss + i * a.ldb + gi * kGroupBlocks;
        const int16_t* x16 = a.sum16 + i * a.ld16 + gi * 16;
        for (int j = 0; j < kGroupBlocks; ++j) {
          const float t = g.scale[j] * xs[j];
          for (int l = 0; l < 8; ++l) {
            int32_t lane = 0;
            for (int e = 32 * j + 4 * l; e < 32 * j + 4 * l + 4; ++e) lane += int32_t(g.code[e]) * int32_t(x[e]);
            lane *= g.lane_scale[2 * j + l / 4];
            acc[i][j % 4][l] = std::fma(float(lane), t, acc[i][j % 4][l]);
          }
          if (f.offset) {
            const int32_t o = -f.offset * (g.lane_scale[2 * j] * x16[2 * j] + g.lane_scale[2 * j + 1] * x16[2 * j + 1]);
            acc_blocks[i][j] = std::fma(float(o), t, acc_blocks[i][j]);
          }
          if (f.has_min) acc_blocks[i][j] = std::fma(-g.min[j], xss[j], acc_blocks[i][j]);
        }
      }
    }
    for (int i = 0; i < mb; ++i) {
      float lanes[8];
      for (int l = 0; l < 8; ++l) lanes[l] = (acc[i][0][l] + acc[i][1][l]) + (acc[i][2][l] + acc[i][3][l]);
      out[i * kTileN + r] = row_total(lanes) + row_total(acc_blocks[i]);
    }
  }
}

RowsFn rows_for(int64_t type, int64_t isa) {
#if defined(__x86_64__) || defined(__i386__)
  if (isa == kAvx512Vnni) return gguf::avx512_vnni::rows_for(type);
  if (isa == kAvx2) return gguf::avx2::rows_for(type);
#endif
  return rows_portable;
}

}  // namespace

// x: (M, K) float32, K = in_features. layout: (P, 3) int64, [ggml_type, rows, data_ptr]
// per part (module comment). bias: (N,) float32 or empty. Returns (M, N) float32, N the
// parts' rows, written into `out` when it is not empty. activation: as int8_linear's.
at::Tensor gguf_linear(at::Tensor x, at::Tensor layout, at::Tensor bias, int64_t in_features, int64_t isa,
                       int64_t activation, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == in_features,
              "gguf_linear: x must be (M, in_features) float32");
  const std::vector<Part> parts = parts_of(layout, in_features, "gguf_linear");
  const int64_t n_out = rows_of(parts), k = in_features;
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == n_out),
              "gguf_linear: bias must be float32 (N,)");
  TORCH_CHECK(isa >= kPortable && isa <= best_isa(), "gguf_linear: this CPU cannot run isa ", isa);
  TORCH_CHECK(activation == kNoActivation || activation == kGelu, "gguf_linear: unknown activation ", activation);
  x = x.contiguous();
  out = output_for(x, n_out, out);
  if (x.size(0) == 0 || n_out == 0) return out;

  const int64_t kp = (k + kGroup - 1) / kGroup * kGroup;  // whole groups: the short one's padding is zeros
  Rows rows = make_rows(x.size(0), kp, /*with_sums=*/true, /*with_sums16=*/true);
  std::vector<RowsFn> fns;
  for (const Part& p : parts) fns.push_back(rows_for(p.type, isa));
  const int64_t qblocks = rows.qblocks, ld16 = kp / 16;
  quantize_and_run_tiles(x, RowFormat{}, rows, n_out, bias.numel() ? bias.data_ptr<float>() : nullptr, activation,
                         out.data_ptr<float>(), [&](int64_t m, int mb, int64_t blk, float* acc) {
                           const Acts acts{rows.q + m * kp, kp, rows.scale + m * qblocks,
                                           rows.scaled_sum + m * qblocks, qblocks, rows.sum16 + m * ld16, ld16};
                           const int64_t n0 = blk * kBlock, width = std::min<int64_t>(kTileN, n_out - n0);
                           for (int64_t c = 0; c < width;) {
                             const Part& p = part_at(parts, n0 + c);
                             const int64_t r0 = n0 + c - p.start, n = std::min(width - c, p.rows - r0);
                             fns[&p - parts.data()](p.type, p.data + r0 * p.row_bytes, p.row_bytes, n, k, acts, mb,
                                                    acc + c);
                             c += n;
                           }
                           for (int i = 0; i < mb; ++i) std::fill(acc + i * kTileN + width, acc + (i + 1) * kTileN, 0.f);
                         });
  return out;
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
