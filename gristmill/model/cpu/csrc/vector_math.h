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
// exp of 8 floats (inputs clamped to the float range), a Cephes-style polynomial: within
// 2 ulp of expf.
__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447504f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

// gelu of 8 floats, the arithmetic of gelu() above.
__attribute__((target("avx2,fma"))) inline __m256 gelu_avx2(__m256 x) {
  const __m256 z = _mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), x), _mm256_set1_ps(kSqrtHalf));
  const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_fmadd_ps(z, _mm256_set1_ps(0.5f), _mm256_set1_ps(1.f)));
  __m256 p = _mm256_set1_ps(kErfc[9]);
  for (int i = 8; i >= 0; --i) p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(kErfc[i]));
  const __m256 e = exp_avx2(_mm256_fnmadd_ps(z, z, p));
  const __m256 h = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.5f)), t), e);
  return _mm256_blendv_ps(h, _mm256_sub_ps(x, h), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
}

__attribute__((target("avx2,fma"))) inline void gelu_inplace_avx2(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, gelu_avx2(_mm256_loadu_ps(x + i)));
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
