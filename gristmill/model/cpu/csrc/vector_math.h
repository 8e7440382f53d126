// Vectorized float math the CPU kernels share: exp (the encoder attention's softmax) and
// GELU in its erf form (BERT's MLP; the int8 linear applies it as it writes its output).
#pragma once

#include "isa.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>

namespace vmath {

// erfc(z) for z >= 0 as t * exp(-z^2 + P(t)), t = 1 / (1 + z / 2): the Chebyshev fit of
// Numerical Recipes (erfcc), relative error under 1.2e-7 for every z >= 0. GELU needs
// 1 + erf(u), which for u < 0 is erfc(|u|) itself: a small negative output keeps its
// relative precision, where 1 + erf(u) spelled out would cancel.
constexpr float kErfc[10] = {-1.26551223f, 1.00002368f, 0.37409196f, 0.09678418f, -0.18628806f,
                             0.27886807f, -1.13520398f, 1.48851587f, -0.82215223f, 0.17087277f};
constexpr float kSqrtHalf = 0.70710678118654752f;

// gelu(x) = x / 2 * (1 + erf(x / sqrt(2))) = x - h for x > 0 and h for x <= 0, where
// h = x / 2 * erfc(|x| / sqrt(2)).
inline float gelu(float x) {
  const float z = std::fabs(x) * kSqrtHalf;
  const float t = 1.f / (1.f + 0.5f * z);
  float p = kErfc[9];
  for (int i = 8; i >= 0; --i) p = p * t + kErfc[i];
  const float h = 0.5f * x * t * std::exp(p - z * z);
  return x > 0.f ? x - h : h;
}

#if defined(__x86_64__) || defined(__i386__)
// Each function below works on N vectors of 8 floats, one step for all N before the
// next: a single vector's exp or GELU is one long chain of dependent instructions (about
// 90 cycles for GELU), and N independent chains side by side keep the core busy while
// each waits. The arithmetic of every float is the same for any N.

// exp of N x 8 floats in place (inputs clamped to the float range), a Cephes-style
// polynomial: within 2 ulp of expf.
template <int N>
__attribute__((target("avx2,fma"))) inline void exp_avx2(__m256* x) {
  __m256 n[N], r[N], p[N];
  for (int j = 0; j < N; ++j) {
    x[j] = _mm256_max_ps(_mm256_min_ps(x[j], _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447504f));
    n[j] = _mm256_round_ps(_mm256_mul_ps(x[j], _mm256_set1_ps(1.44269504088896341f)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  for (int j = 0; j < N; ++j) {
    r[j] = _mm256_fnmadd_ps(n[j], _mm256_set1_ps(0.693359375f), x[j]);
    r[j] = _mm256_fnmadd_ps(n[j], _mm256_set1_ps(-2.12194440e-4f), r[j]);
  }
  constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
  for (int j = 0; j < N; ++j) p[j] = _mm256_set1_ps(kPoly[0]);
  for (int k = 1; k < 6; ++k)
    for (int j = 0; j < N; ++j) p[j] = _mm256_fmadd_ps(p[j], r[j], _mm256_set1_ps(kPoly[k]));
  for (int j = 0; j < N; ++j) {
    p[j] = _mm256_fmadd_ps(p[j], _mm256_mul_ps(r[j], r[j]), _mm256_add_ps(r[j], _mm256_set1_ps(1.f)));
    const __m256i exponent =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n[j]), _mm256_set1_epi32(127)), 23);
    x[j] = _mm256_mul_ps(p[j], _mm256_castsi256_ps(exponent));
  }
}

__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  exp_avx2<1>(&x);
  return x;
}

// gelu of N x 8 floats in place, the arithmetic of gelu() above.
template <int N>
__attribute__((target("avx2,fma"))) inline void gelu_avx2(__m256* x) {
  __m256 z[N], t[N], p[N];
  for (int j = 0; j < N; ++j) {
    z[j] = _mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), x[j]), _mm256_set1_ps(kSqrtHalf));
    t[j] = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_fmadd_ps(z[j], _mm256_set1_ps(0.5f), _mm256_set1_ps(1.f)));
    p[j] = _mm256_set1_ps(kErfc[9]);
  }
  for (int i = 8; i >= 0; --i)
    for (int j = 0; j < N; ++j) p[j] = _mm256_fmadd_ps(p[j], t[j], _mm256_set1_ps(kErfc[i]));
  for (int j = 0; j < N; ++j) p[j] = _mm256_fnmadd_ps(z[j], z[j], p[j]);
  exp_avx2<N>(p);
  for (int j = 0; j < N; ++j) {
    const __m256 h = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(x[j], _mm256_set1_ps(0.5f)), t[j]), p[j]);
    x[j] = _mm256_blendv_ps(h, _mm256_sub_ps(x[j], h), _mm256_cmp_ps(x[j], _mm256_setzero_ps(), _CMP_GT_OQ));
  }
}

__attribute__((target("avx2,fma"))) inline void gelu_inplace_avx2(float* x, int64_t n) {
  constexpr int kVectors = 4;
  int64_t i = 0;
  for (; i + 8 * kVectors <= n; i += 8 * kVectors) {
    __m256 v[kVectors];
    for (int j = 0; j < kVectors; ++j) v[j] = _mm256_loadu_ps(x + i + 8 * j);
    gelu_avx2<kVectors>(v);
    for (int j = 0; j < kVectors; ++j) _mm256_storeu_ps(x + i + 8 * j, v[j]);
  }
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    gelu_avx2<1>(&v);
    _mm256_storeu_ps(x + i, v);
  }
  for (; i < n; ++i) x[i] = gelu(x[i]);
}
#endif

// x[i] = gelu(x[i]) for i < n; `avx2`: best_isa() >= kAvx2, asked once by the caller.
inline void gelu_inplace(float* x, int64_t n, bool avx2) {
#if defined(__x86_64__) || defined(__i386__)
  if (avx2) return gelu_inplace_avx2(x, n);
#endif
  for (int64_t i = 0; i < n; ++i) x[i] = gelu(x[i]);
}

}  // namespace vmath
