// The LoRA update of one projection for every adapter row of a step, in one call (as
// Punica's SGMV: rows grouped by adapter slot, each group against its own slot's A and B):
// y[row, part p] += (x[row] A_slot^T)[p's rank columns] B_slot,p^T.
//
// In torch this is a gather, two matmuls and a scatter per slot and part, each call's
// fixed cost far above its arithmetic (a rank-16 update of a 640-wide row is ~40k
// multiply-adds); here a step's whole update of a projection is one call. Rows go in
// tiles of up to 4 of one slot, so a slot's A and B are read once per tile, not per row.
//
// Each output element is summed in one fixed order (over the input, then over the rank,
// then added to y) whatever the tile and the group around it: a row's update is the same
// bits whether it runs alone or among other adapters' rows.
#include "cpu_ops.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// a * b + c, rounded once wherever the CPU has FMA: the same rounding in the vector
// loops and the scalar tails, which the compiler would otherwise contract as it likes.
inline float madd(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

constexpr int kTileRows = 4;
constexpr int kRankCols = 16;  // h columns a tile computes at once
constexpr int kOutCols = 32;   // y columns a tile updates at once

struct Tile {
  int64_t slot, first, count;  // rows[first, first + count), all of one slot
};

// h[r][0:W] = x[r] . a_t[:, 0:W] for the tile's rows; a_t is (in, J) at the tile's columns.
template <int Rows, int W>
void h_tile(const float* const* x, const float* a_t, int64_t j_stride, int64_t in, float* const* h) {
  float acc[Rows][W] = {};
  for (int64_t k = 0; k < in; ++k) {
    const float* a = a_t + k * j_stride;
    for (int r = 0; r < Rows; ++r) {
      const float xv = x[r][k];
#pragma omp simd
      for (int l = 0; l < W; ++l) acc[r][l] = madd(xv, a[l], acc[r][l]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int l = 0; l < W; ++l) h[r][l] = acc[r][l];
}

// y[r][0:W] += h[r][0:rank] . b_t[0:rank, 0:W]; b_t is (rank, out) at the tile's columns.
template <int Rows, int W>
void y_tile(const float* const* h, int64_t rank, const float* b_t, int64_t out, float* const* y) {
  float acc[Rows][W] = {};
  for (int64_t t = 0; t < rank; ++t) {
    const float* b = b_t + t * out;
    for (int r = 0; r < Rows; ++r) {
      const float hv = h[r][t];
#pragma omp simd
      for (int l = 0; l < W; ++l) acc[r][l] = madd(hv, b[l], acc[r][l]);
    }
  }
  for (int r = 0; r < Rows; ++r)
#pragma omp simd
    for (int l = 0; l < W; ++l) y[r][l] += acc[r][l];
}

// The tile kernel for `rows` rows (1..kTileRows) and width W.
template <template <int, int> class Kernel, int W, typename... Args>
void by_rows(int rows, Args... args) {
  switch (rows) {
    case 1: Kernel<1, W>::run(args...); break;
    case 2: Kernel<2, W>::run(args...); break;
    case 3: Kernel<3, W>::run(args...); break;
    default: Kernel<4, W>::run(args...); break;
  }
}

template <int Rows, int W>
struct HTile {
  static void run(const float* const* x, const float* a_t, int64_t j_stride, int64_t in, float* const* h) {
    h_tile<Rows, W>(x, a_t, j_stride, in, h);
  }
};

template <int Rows, int W>
struct YTile {
  static void run(const float* const* h, int64_t rank, const float* b_t, int64_t out, float* const* y) {
    y_tile<Rows, W>(h, rank, b_t, out, y);
  }
};

// Columns [begin, end) in widths Full, then 8, then 1: fn(column, width).
template <typename Fn>
void in_widths(int64_t begin, int64_t end, int64_t full, const Fn& fn) {
  int64_t c = begin;
  for (; c + full <= end; c += full) fn(c, full);
  for (; c + 8 <= end; c += 8) fn(c, 8);
  for (; c < end; ++c) fn(c, 1);
}

}  // namespace

void lora_update_(at::Tensor y, at::Tensor x, at::Tensor a_t, at::Tensor b_t, at::Tensor parts_used,
                  at::Tensor rows, at::Tensor group_slots, at::Tensor group_starts, std::vector<int64_t> bounds) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_update_: x (n, in) and y (n, out)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && a_t.scalar_type() == at::kFloat &&
                  b_t.scalar_type() == at::kFloat, "lora_update_: float32 tensors only");
  TORCH_CHECK(y.stride(1) == 1, "lora_update_: y's rows must be contiguous");
  TORCH_CHECK(a_t.dim() == 3 && b_t.dim() == 3 && a_t.is_contiguous() && b_t.is_contiguous(),
              "lora_update_: a_t (slots, in, parts * rank) and b_t (slots, rank, out), contiguous");
  const int64_t num_parts = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t n = x.size(0), in = x.size(1), out = y.size(1), j_width = a_t.size(2), rank = b_t.size(1);
  const int64_t num_slots = a_t.size(0);
  TORCH_CHECK(num_parts >= 1 && bounds[0] == 0 && bounds[num_parts] == out && j_width == num_parts * rank &&
                  a_t.size(1) == in && b_t.size(2) == out && b_t.size(0) == num_slots,
              "lora_update_: shapes of a_t ", a_t.sizes(), ", b_t ", b_t.sizes(), " do not fit x ", x.sizes(),
              " and y ", y.sizes());
  x = x.contiguous();
  parts_used = parts_used.contiguous();
  rows = rows.contiguous();
  group_slots = group_slots.contiguous();
  group_starts = group_starts.contiguous();
  TORCH_CHECK(parts_used.scalar_type() == at::kBool && parts_used.numel() == num_slots * num_parts,
              "lora_update_: parts_used (slots, parts) bool");
  TORCH_CHECK(rows.scalar_type() == at::kLong && group_slots.scalar_type() == at::kLong &&
                  group_starts.scalar_type() == at::kLong && group_starts.numel() == group_slots.numel() + 1,
              "lora_update_: int64 rows, group_slots (groups,), group_starts (groups + 1,)");
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* slot_of = group_slots.data_ptr<int64_t>();
  const int64_t* start_of = group_starts.data_ptr<int64_t>();
  const bool* used = parts_used.data_ptr<bool>();
  const int64_t m = rows.numel();
  TORCH_CHECK(start_of[0] == 0 && start_of[group_slots.numel()] == m, "lora_update_: groups must cover rows");
  for (int64_t i = 0; i < m; ++i) TORCH_CHECK(row_of[i] >= 0 && row_of[i] < n, "lora_update_: row out of range");

  std::vector<Tile> tiles;
  for (int64_t g = 0; g < group_slots.numel(); ++g) {
    TORCH_CHECK(slot_of[g] >= 0 && slot_of[g] < num_slots && start_of[g] <= start_of[g + 1],
                "lora_update_: bad group ", g);
    for (int64_t first = start_of[g]; first < start_of[g + 1]; first += kTileRows)
      tiles.push_back({slot_of[g], first, std::min<int64_t>(kTileRows, start_of[g + 1] - first)});
  }
  // (tile, part) pairs whose part the tile's slot updates: the units of work
  std::vector<std::pair<int64_t, int64_t>> work;
  for (int64_t t = 0; t < static_cast<int64_t>(tiles.size()); ++t)
    for (int64_t p = 0; p < num_parts; ++p)
      if (used[tiles[t].slot * num_parts + p]) work.emplace_back(t, p);
  if (work.empty()) return;

  auto h = x.new_empty({m, j_width});  // (adapter rows, parts * rank), in `rows` order
  const float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* ap = a_t.data_ptr<float>();
  const float* bp = b_t.data_ptr<float>();
  const int64_t y_stride = y.stride(0);

  // h = x A^T for each tile's rows and part
  parallel_items(static_cast<int64_t>(work.size()), [&](int64_t i) {
    const Tile& tile = tiles[work[i].first];
    const int64_t part = work[i].second;
    const float* x_rows[kTileRows];
    float* h_rows[kTileRows];
    for (int r = 0; r < tile.count; ++r) x_rows[r] = xp + row_of[tile.first + r] * in;
    const float* a_slot = ap + tile.slot * in * j_width;
    in_widths(part * rank, (part + 1) * rank, kRankCols, [&](int64_t col, int64_t width) {
      for (int r = 0; r < tile.count; ++r) h_rows[r] = hp + (tile.first + r) * j_width + col;
      const int rows_n = static_cast<int>(tile.count);
      if (width == kRankCols) by_rows<HTile, kRankCols>(rows_n, x_rows, a_slot + col, j_width, in, h_rows);
      else if (width == 8) by_rows<HTile, 8>(rows_n, x_rows, a_slot + col, j_width, in, h_rows);
      else by_rows<HTile, 1>(rows_n, x_rows, a_slot + col, j_width, in, h_rows);
    });
  });
  // y += h B^T, part by part: part p's columns of y from its rank columns of h
  parallel_items(static_cast<int64_t>(work.size()), [&](int64_t i) {
    const Tile& tile = tiles[work[i].first];
    const int64_t part = work[i].second;
    const float* h_rows[kTileRows];
    float* y_rows[kTileRows];
    for (int r = 0; r < tile.count; ++r) h_rows[r] = hp + (tile.first + r) * j_width + part * rank;
    const float* b_slot = bp + tile.slot * rank * out;
    in_widths(bounds[part], bounds[part + 1], kOutCols, [&](int64_t col, int64_t width) {
      for (int r = 0; r < tile.count; ++r) y_rows[r] = yp + row_of[tile.first + r] * y_stride + col;
      const int rows_n = static_cast<int>(tile.count);
      if (width == kOutCols) by_rows<YTile, kOutCols>(rows_n, h_rows, rank, b_slot + col, out, y_rows);
      else if (width == 8) by_rows<YTile, 8>(rows_n, h_rows, rank, b_slot + col, out, y_rows);
      else by_rows<YTile, 1>(rows_n, h_rows, rank, b_slot + col, out, y_rows);
    });
  });
}
