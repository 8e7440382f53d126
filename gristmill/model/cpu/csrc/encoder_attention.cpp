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

// scores[j] = scale * q . k_j for j < lp (kt: (dim, lp)): 4 vector sums in registers.
__attribute__((target("avx2,fma"))) void scores_avx2(const float* q, const float* kt, int64_t lp, int64_t dim,
                                                     float scale, float* scores) {
  for (int64_t j0 = 0; j0 < lp; j0 += 32) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < dim; ++d) {
      const __m256 qd = _mm256_set1_ps(q[d] * scale);
      const float* kd = kt + d * lp + j0;
      a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd), a0);
      a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd + 8), a1);
      a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd + 16), a2);
      a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kd + 24), a3);
    }
    _mm256_storeu_ps(scores + j0, a0);
    _mm256_storeu_ps(scores + j0 + 8, a1);
    _mm256_storeu_ps(scores + j0 + 16, a2);
    _mm256_storeu_ps(scores + j0 + 24, a3);
  }
}

// out[c] = inv * sum_j p[j] v[j][d0 + c] for c < 32 (vb: (len, dp)), even and odd keys
// summed apart (half the dependency chain).
__attribute__((target("avx2,fma"))) void weighted_sum_avx2(const float* p, const float* vb, int64_t len,
                                                           int64_t dp, int64_t d0, float inv, float* out) {
  __m256 e[4], o[4];
  for (int c = 0; c < 4; ++c) e[c] = o[c] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 1 < len; j += 2) {
    const __m256 p0 = _mm256_set1_ps(p[j]), p1 = _mm256_set1_ps(p[j + 1]);
    const float* v0 = vb + j * dp + d0;
    for (int c = 0; c < 4; ++c) {
      e[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * c), e[c]);
      o[c] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v0 + dp + 8 * c), o[c]);
    }
  }
  if (j < len) {
    const __m256 p0 = _mm256_set1_ps(p[j]);
    for (int c = 0; c < 4; ++c) e[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vb + j * dp + d0 + 8 * c), e[c]);
  }
  const __m256 scale = _mm256_set1_ps(inv);
  for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(_mm256_add_ps(e[c], o[c]), scale));
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
  for (int64_t i = 0; i < len; ++i) {
    const float* qi = h.q + i * h.ld_q;
    float* si = s.data();
#if defined(__x86_64__) || defined(__i386__)
    if (avx2) {
      scores_avx2(qi, kt.data(), lp, dim, scale, si);
      const float max = *std::max_element(si, si + len);
      const float inv = 1.f / exp_shifted(si, len, max, avx2);
      float* oi = h.out + i * h.ld_out;
      for (int64_t d0 = 0; d0 < dp; d0 += kDims) {
        alignas(32) float part[kDims];
        weighted_sum_avx2(si, vb.data(), len, dp, d0, inv, part);
        std::copy_n(part, std::min(kDims, dim - d0), oi + d0);
      }
      continue;
    }
#endif
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
