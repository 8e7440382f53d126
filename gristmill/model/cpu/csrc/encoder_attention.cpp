// An encoder's attention on CPU: every token attends to every token of its own sequence.
// q, k and v are read where the fused q/k/v projection left them (strided views), one
// (sequence, head) at a time, so nothing is gathered into a padded batch first; for the
// short sequences of sentence embeddings, padding and gathering cost more than the
// attention itself. The softmax's exp is vectorized on AVX2 (vector_math.h).
#include "aten_light.h"
#include "isa.h"
#include "parallel.h"
#include "vector_math.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

#if defined(__x86_64__) || defined(__i386__)
using vmath::exp_avx2;

// s[j] = exp(s[j] - max) for j < n; returns their sum.
__attribute__((target("avx2,fma"))) float exp_shifted_avx2(float* s, int64_t n, float max) {
  const __m256 m = _mm256_set1_ps(max);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = 0.f;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  for (float lane : lanes) sum += lane;
  for (; j < n; ++j) sum += (s[j] = std::exp(s[j] - max));
  return sum;
}

// Queries go kQueries at a time: each key or value vector loaded serves all of them, and
// their kQueries x 2 vector sums are independent chains (one alone waits on its FMA).
constexpr int64_t kQueries = 4;

// acc[r] += a[r * stride] * (b0 | b1) for r < kQueries: each query's 16 sums take one
// term (a key's dimension, or a value weighted by its probability).
__attribute__((target("avx2,fma"), always_inline)) inline void add_outer(__m256 (&acc)[kQueries][2], const float* a,
                                                                       int64_t stride, __m256 b0, __m256 b1) {
  for (int r = 0; r < kQueries; ++r) {
    const __m256 ar = _mm256_broadcast_ss(a + r * stride);
    acc[r][0] = _mm256_fmadd_ps(ar, b0, acc[r][0]);
    acc[r][1] = _mm256_fmadd_ps(ar, b1, acc[r][1]);
  }
}

// scores[r * lp + j] = qs_r . k_j for r < kQueries, j < lp (qs: (kQueries, dim), already
// scaled; kt: (dim, lp), lp a multiple of 16).
__attribute__((target("avx2,fma"))) void scores_avx2(const float* qs, const float* kt, int64_t lp, int64_t dim,
                                                     float* scores) {
  for (int64_t j0 = 0; j0 < lp; j0 += 16) {
    __m256 acc[kQueries][2];
    for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; ++d)
      add_outer(acc, qs + d, dim, _mm256_loadu_ps(kt + d * lp + j0), _mm256_loadu_ps(kt + d * lp + j0 + 8));
    for (int r = 0; r < kQueries; ++r) {
      _mm256_storeu_ps(scores + r * lp + j0, acc[r][0]);
      _mm256_storeu_ps(scores + r * lp + j0 + 8, acc[r][1]);
    }
  }
}

// out[r][c] = inv[r] * sum_j p[r * lp + j] v[j][d0 + c] for r < rows, c < 16 (vb: (len,
// dp)); out rows `ld_out` apart.
__attribute__((target("avx2,fma"))) void weighted_sum_avx2(const float* p, int64_t lp, const float* vb, int64_t len,
                                                           int64_t dp, int64_t d0, const float* inv, int rows,
                                                           float* out, int64_t ld_out) {
  __m256 acc[kQueries][2];
  for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < len; ++j)
    add_outer(acc, p + j, lp, _mm256_loadu_ps(vb + j * dp + d0), _mm256_loadu_ps(vb + j * dp + d0 + 8));
  for (int r = 0; r < rows; ++r) {
    const __m256 scale = _mm256_set1_ps(inv[r]);
    _mm256_storeu_ps(out + r * ld_out, _mm256_mul_ps(acc[r][0], scale));
    _mm256_storeu_ps(out + r * ld_out + 8, _mm256_mul_ps(acc[r][1], scale));
  }
}
#endif

float exp_shifted(float* s, int64_t n, float max, bool avx2) {
#if defined(__x86_64__) || defined(__i386__)
  if (avx2) return exp_shifted_avx2(s, n, max);
#endif
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - max));
  return sum;
}

// One (sequence, head): rows [0, len) of q, k, v (`ld` floats apart), out likewise.
struct Head {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  int64_t len, ld_q, ld_k, ld_v, ld_out;
};

constexpr int64_t kKeys = 32;  // keys a query scores at once (4 independent vector sums)
constexpr int64_t kDims = 32;  // output dims a query sums at once

#if defined(__x86_64__) || defined(__i386__)
// attend()'s queries on AVX2, kQueries at a time (kt, vb as attend() makes them).
void attend_avx2(const Head& h, int64_t dim, float scale, const float* kt, const float* vb, int64_t lp, int64_t dp,
                 std::vector<float>& s) {
  const int64_t len = h.len;
  s.resize(kQueries * (lp + dim + 16));
  float* scores = s.data();                 // (kQueries, lp)
  float* qs = scores + kQueries * lp;       // (kQueries, dim): the queries times scale
  float* part = qs + kQueries * dim;        // (kQueries, 16): the last, partial dims
  for (int64_t i0 = 0; i0 < len; i0 += kQueries) {
    const int rows = int(std::min(kQueries, len - i0));
    for (int r = 0; r < kQueries; ++r)
      for (int64_t d = 0; d < dim; ++d) qs[r * dim + d] = r < rows ? h.q[(i0 + r) * h.ld_q + d] * scale : 0.f;
    scores_avx2(qs, kt, lp, dim, scores);
    float inv[kQueries];
    for (int r = 0; r < rows; ++r) {
      float* sr = scores + r * lp;
      inv[r] = 1.f / exp_shifted(sr, len, *std::max_element(sr, sr + len), true);
    }
    float* out = h.out + i0 * h.ld_out;
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {  // (dp, a multiple of 32, holds d0 + 16)
      if (d0 + 16 <= dim) {
        weighted_sum_avx2(scores, lp, vb, len, dp, d0, inv, rows, out + d0, h.ld_out);
        continue;
      }
      weighted_sum_avx2(scores, lp, vb, len, dp, d0, inv, rows, part, 16);
      for (int r = 0; r < rows; ++r) std::copy_n(part + r * 16, dim - d0, out + r * h.ld_out + d0);
    }
  }
}
#endif

void attend(const Head& h, int64_t dim, float scale, bool avx2, std::vector<float>& kt, std::vector<float>& vb,
            std::vector<float>& s) {
  const int64_t len = h.len, lp = (len + kKeys - 1) / kKeys * kKeys, dp = (dim + kDims - 1) / kDims * kDims;
  // Keys transposed (dim, lp), zero padded: a query's scores are then sums of vectors
  // over keys. Values (len, dp), zero padded.
  kt.assign(dim * lp, 0.f);
  vb.assign(len * dp, 0.f);
  s.resize(lp);
  for (int64_t j = 0; j < len; ++j) {
    for (int64_t d = 0; d < dim; ++d) kt[d * lp + j] = h.k[j * h.ld_k + d];
    std::copy_n(h.v + j * h.ld_v, dim, vb.data() + j * dp);
  }
#if defined(__x86_64__) || defined(__i386__)
  if (avx2) return attend_avx2(h, dim, scale, kt.data(), vb.data(), lp, dp, s);
#endif
  for (int64_t i = 0; i < len; ++i) {
    const float* qi = h.q + i * h.ld_q;
    float* si = s.data();
    for (int64_t j0 = 0; j0 < lp; j0 += kKeys) {
      float acc[kKeys] = {0.f};
      for (int64_t d = 0; d < dim; ++d) {
        const float qd = qi[d] * scale;
        const float* kd = kt.data() + d * lp + j0;
#pragma omp simd
        for (int64_t c = 0; c < kKeys; ++c) acc[c] += qd * kd[c];
      }
      std::copy_n(acc, kKeys, si + j0);
    }
    const float max = *std::max_element(si, si + len);
    const float inv = 1.f / exp_shifted(si, len, max, avx2);
    float* oi = h.out + i * h.ld_out;
    for (int64_t d0 = 0; d0 < dp; d0 += kDims) {
      float even[kDims] = {0.f}, odd[kDims] = {0.f};  // two sums: half the dependency chain
      int64_t j = 0;
      for (; j + 1 < len; j += 2) {
        const float p0 = si[j], p1 = si[j + 1];
        const float* v0 = vb.data() + j * dp + d0;
        const float* v1 = v0 + dp;
#pragma omp simd
        for (int64_t c = 0; c < kDims; ++c) {
          even[c] += p0 * v0[c];
          odd[c] += p1 * v1[c];
        }
      }
      if (j < len) {
        const float p0 = si[j];
        const float* v0 = vb.data() + j * dp + d0;
#pragma omp simd
        for (int64_t c = 0; c < kDims; ++c) even[c] += p0 * v0[c];
      }
      for (int64_t c = 0; c < kDims && d0 + c < dim; ++c) oi[d0 + c] = (even[c] + odd[c]) * inv;
    }
  }
}

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 3 && t.stride(2) == 1,
              "encoder_attention: ", name, " must be float32 (tokens, heads, head_dim) with head_dim contiguous");
}

}  // namespace

// q, k, v: (T, heads, head_dim) float32, any row and head strides (views of a fused
// projection). bounds: the sequences' first rows and then T (num_seqs + 1 ascending).
// Returns (T, heads, head_dim) contiguous: softmax(q k^T * scale) v within each sequence.
at::Tensor encoder_attention(at::Tensor q, at::Tensor k, at::Tensor v, std::vector<int64_t> bounds,
                                double scale) {
  check_heads(q, "q");
  check_heads(k, "k");
  check_heads(v, "v");
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), "encoder_attention: q, k, v must have one shape");
  TORCH_CHECK(!bounds.empty() && bounds.front() == 0 && bounds.back() == q.size(0),
              "encoder_attention: bounds must run from 0 to the number of tokens");
  const int64_t heads = q.size(1), dim = q.size(2), num_seqs = int64_t(bounds.size()) - 1;
  for (int64_t i = 0; i < num_seqs; ++i)
    TORCH_CHECK(bounds[i] <= bounds[i + 1], "encoder_attention: bounds must ascend");
  auto out = q.new_empty(q.sizes());
  const bool avx2 = best_isa() >= kAvx2;
  const float fscale = float(scale);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t items = num_seqs * heads;
  // Items longest first (a step's sequences come sorted by length, shortest first, and
  // cost grows with the square of the length), taken by whichever thread is free: the
  // short ones at the end even out the threads' finishing times.
  parallel_items(items, [&](int64_t i) {
    thread_local std::vector<float> kt, vb, s;
    const int64_t w = items - 1 - i;
    const int64_t seq = w / heads, head = w % heads, start = bounds[seq];
    const Head h{qp + start * q.stride(0) + head * q.stride(1), kp + start * k.stride(0) + head * k.stride(1),
                 vp + start * v.stride(0) + head * v.stride(1), op + (start * heads + head) * dim,
                 bounds[seq + 1] - start, q.stride(0), k.stride(0), v.stride(0), heads * dim};
    attend(h, dim, fscale, avx2, kt, vb, s);
  });
  return out;
}
