// The vector path of the paged decode attention (paged_attention.cpp), once per code
// path: avx512 (16 floats a vector) and avx2 (8). Included inside namespace ATTN_NS.
//
// Scores: each (head, key) dot product leaves a vector of partial sums; W of them are
// summed across their lanes at once (V::sums, a transpose of adds), so no dot pays a
// horizontal sum of its own. Values: 4 tokens' rows at a time into each head's output,
// which stays in L1.

#if ATTN_512
struct V {
  static constexpr int W = 16;
  using F = __m512;
  static ATTN_TARGET F zero() { return _mm512_setzero_ps(); }
  static ATTN_TARGET F load(const float* p) { return _mm512_loadu_ps(p); }
  static ATTN_TARGET void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static ATTN_TARGET F set1(float v) { return _mm512_set1_ps(v); }
  static ATTN_TARGET F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static ATTN_TARGET F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  // Lane i: the sum of v[i]'s lanes. Pairs, then quads, within each 128-bit chunk; then
  // the chunks of four vectors transposed and added.
  static ATTN_TARGET F sums(const F v[16]) {
    F s1[8], s2[4];
    for (int i = 0; i < 8; ++i)  // chunk: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
      s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  // chunk L: the sums of chunk L of v[4i .. 4i + 3]
      const __m512d c = _mm512_castps_pd(s1[2 * i]), d = _mm512_castps_pd(s1[2 * i + 1]);
      s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    // u0: [s2_0 (L0 + L2), s2_0 (L1 + L3), s2_1 (L0 + L2), s2_1 (L1 + L3)], u1 the same of s2_2, s2_3
    const F u0 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const F u1 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2], s2[3], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(s2[2], s2[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
  }
};
#else
struct V {
  static constexpr int W = 8;
  using F = __m256;
  static ATTN_TARGET F zero() { return _mm256_setzero_ps(); }
  static ATTN_TARGET F load(const float* p) { return _mm256_loadu_ps(p); }
  static ATTN_TARGET void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static ATTN_TARGET F set1(float v) { return _mm256_set1_ps(v); }
  static ATTN_TARGET F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static ATTN_TARGET F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // Lane i: the sum of v[i]'s lanes (the same steps as the avx512 path's, two chunks).
  static ATTN_TARGET F sums(const F v[8]) {
    F s1[4], s2[2];
    for (int i = 0; i < 4; ++i)
      s1[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i) {
      const __m256d c = _mm256_castps_pd(s1[2 * i]), d = _mm256_castps_pd(s1[2 * i + 1]);
      s2[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(c, d)), _mm256_castpd_ps(_mm256_unpackhi_pd(c, d)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(s2[0], s2[1], 0x20), _mm256_permute2f128_ps(s2[0], s2[1], 0x31));
  }
};
#endif

// W of a cache's elements from p, as floats (float16 and bfloat16 widen exactly).
ATTN_TARGET inline typename V::F load_cache(const float* p) { return V::load(p); }
#if ATTN_512
ATTN_TARGET inline V::F load_cache(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
ATTN_TARGET inline V::F load_cache(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#else
ATTN_TARGET inline V::F load_cache(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
ATTN_TARGET inline V::F load_cache(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif

// n (<= W) partial-sum vectors summed across their lanes, times scale, to s[where[i]].
ATTN_TARGET inline void flush(typename V::F pending[V::W], const int64_t where[V::W], int n, float scale, float* s) {
  alignas(64) float lanes[V::W];
  for (int i = n; i < V::W; ++i) pending[i] = V::zero();
  V::store(lanes, V::mul(V::sums(pending), V::set1(scale)));
  for (int i = 0; i < n; ++i) s[where[i]] = lanes[i];
}

// Sequence b's attention for the query heads of KV heads [kv0, kv1) (head_dim a multiple
// of V::W), a token's keys (values) of those heads read together: they lie side by side.
// T: the cache's element type.
template <class T>
ATTN_TARGET void attend(const Job& job, int64_t b, int64_t kv0, int64_t kv1, Scratch& scratch) {
  constexpr int W = V::W;
  const int64_t d = job.head_dim, group = job.group, chunks = d / W, heads = (kv1 - kv0) * group;
  const int64_t len = job.lens[b], first = job.window > 0 ? std::max<int64_t>(0, len - job.window) : 0;
  const int64_t span = len - first, stride = (span + 7) / 8 * 8;
  const float* q = job.q + (b * job.num_heads + kv0 * group) * d;  // (heads, head_dim)
  float* out = job.out + (b * job.num_heads + kv0 * group) * d;
  std::fill(out, out + heads * d, 0.f);
  if (span <= 0) return;
  const int64_t* table = job.tables + b * job.max_blocks;
  const auto slot = [&](const void* cache, int64_t t) {  // token t's row of KV head kv0
    const int64_t at = table[t / job.block_size] * job.block_size + t % job.block_size;
    return static_cast<const T*>(cache) + (at * job.num_kv_heads + kv0) * d;
  };
  if (int64_t(scratch.scores.size()) < heads * stride) scratch.scores.resize(heads * stride);
  if (int64_t(scratch.inverse.size()) < heads) scratch.inverse.resize(heads);
  float* s = scratch.scores.data();
  float* inverse = scratch.inverse.data();

  // s[h * stride + i] = q_h . k_(first + i) * scale, W dot products summed at once
  typename V::F pending[W];
  int64_t where[W];
  int n = 0;
  for (int64_t i = 0; i < span; ++i) {
    const T* k = slot(job.k, first + i);
    for (int64_t kv = 0, h = 0; kv < kv1 - kv0; ++kv) {
      const T* kh = k + kv * d;
      for (int64_t g = 0; g < group; ++g, ++h) {
        const float* qh = q + h * d;
        typename V::F acc = V::mul(V::load(qh), load_cache(kh));
        for (int64_t c = 1; c < chunks; ++c) acc = V::fmadd(V::load(qh + c * W), load_cache(kh + c * W), acc);
        pending[n] = acc;
        where[n++] = h * stride + i;
        if (n == W) {
          flush(pending, where, n, job.scale, s);
          n = 0;
        }
      }
    }
  }
  if (n > 0) flush(pending, where, n, job.scale, s);

  // softmax numerators in place (8 at a time, the span's padding included), their totals
  for (int64_t h = 0; h < heads; ++h) {
    float* sh = s + h * stride;
    float most = sh[0];
    for (int64_t i = 1; i < span; ++i) most = std::max(most, sh[i]);
    const __m256 shift = _mm256_set1_ps(most);
    for (int64_t i = 0; i < stride; i += 8) {
      __m256 x = _mm256_sub_ps(_mm256_loadu_ps(sh + i), shift);
      vmath::exp_avx2<1>(&x);
      _mm256_storeu_ps(sh + i, x);
    }
    float total = 0.f;
    for (int64_t i = 0; i < span; ++i) total += sh[i];
    inverse[h] = 1.f / total;
  }

  // out_h += p_h,i v_i, 4 tokens at a time (out: heads x head_dim floats, in L1), then / total
  for (int64_t i0 = 0; i0 < span; i0 += 4) {
    const int tn = int(std::min<int64_t>(4, span - i0));
    const T* v[4];
    for (int j = 0; j < tn; ++j) v[j] = slot(job.v, first + i0 + j);
    for (int64_t kv = 0, h = 0; kv < kv1 - kv0; ++kv)
      for (int64_t g = 0; g < group; ++g, ++h) {
        const float* p = s + h * stride + i0;
        float* o = out + h * d;
        for (int64_t c = 0; c < chunks; ++c) {
          typename V::F acc = V::load(o + c * W);
          for (int j = 0; j < 4; ++j)
            if (j < tn) acc = V::fmadd(V::set1(p[j]), load_cache(v[j] + kv * d + c * W), acc);
          V::store(o + c * W, acc);
        }
      }
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t c = 0; c < chunks; ++c) V::store(out + h * d + c * W, V::mul(V::load(out + h * d + c * W), V::set1(inverse[h])));
}
