// Decode attention straight from the paged KV cache on CPU: one query token per
// sequence attends to its cached keys and values through its block table, without
// gathering them into a padded copy first.
#include "aten_light.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

}  // namespace

// q: (batch, num_heads, head_dim) float32, contiguous.
// k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim) float32, contiguous.
// block_tables: (batch, max_blocks) int64; context_lens: (batch,) int64.
// window: keys older than the last `window` positions are masked (0 = no window).
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor context_lens,
                                     double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat,
              "paged_decode_attention takes float32 tensors");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  auto out = q.new_empty(q.sizes());

  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = k_cache.data_ptr<float>();
  const float* v_ptr = v_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // One work item = one sequence and one KV head, with all query heads of its group:
  // each cached key and value row is loaded once and used by every head of the group.
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;                 // (group, span)
    std::vector<float> acc(group * head_dim);  // (group, head_dim)
    std::vector<float> max_score(group), total(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t span = len - first;
      const float* qg = q_ptr + (b * num_heads + kv_head * group) * head_dim;  // (group, head_dim)
      const int64_t* table = tables + b * max_blocks;
      scores.resize(group * span);
      std::fill(max_score.begin(), max_score.end(), -std::numeric_limits<float>::infinity());
      for (int64_t t = first; t < len; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const float* kh = k_ptr + (slot * num_kv_heads + kv_head) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float value = dot(qg + g * head_dim, kh, head_dim) * fscale;
          scores[g * span + (t - first)] = value;
          max_score[g] = std::max(max_score[g], value);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * span;
        float sum = 0.f;
        for (int64_t i = 0; i < span; ++i) {
          s[i] = std::exp(s[i] - max_score[g]);
          sum += s[i];
        }
        total[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = first; t < len; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const float* vh = v_ptr + (slot * num_kv_heads + kv_head) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * span + (t - first)];
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = out_ptr + (b * num_heads + kv_head * group + g) * head_dim;
        const float inv = 1.f / total[g];
        for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[g * head_dim + d] * inv;
      }
    }
  });
  return out;
}
