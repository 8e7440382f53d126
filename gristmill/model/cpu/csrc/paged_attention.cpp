// Decode attention straight from the paged KV cache on CPU: one query token per
// sequence attends to its cached keys and values through its block table, without
// gathering them into a padded copy first.
//
// One work item is one sequence and its KV heads (or a part of them, where the batch is
// small), with all the query heads of each group: a token's cached keys and values of
// those heads, side by side in the cache, are read together, once. Code paths, chosen at run
// time by `isa` (-1: the best this CPU runs): avx512 and avx2 (paged_attention_x86.h)
// where head_dim is a multiple of their vector, else portable. The cache holds float32,
// float16 or bfloat16 (EngineConfig.kv_cache_dtype); each key and value is read as the
// float it stands for, so a cache of narrower floats gives what a float32 cache holding
// the same values gives, bit for bit.
#include "aten_light.h"
#include "isa.h"
#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

struct Job {
  const float* q;
  const void *k, *v;  // the cache's element type: the attend function's T
  const int64_t *tables, *lens;
  float* out;
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, group, window;
  float scale;
};

struct Scratch {
  std::vector<float> scores, inverse, key;
};

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// A key of the cache as floats: the cache's own where it holds float32, else widened
// into `room` (so the dot product's sums are those of a float32 cache).
inline const float* as_floats(const float* row, int64_t, std::vector<float>&) { return row; }
template <class T>
const float* as_floats(const T* row, int64_t d, std::vector<float>& room) {
  room.resize(d);
  for (int64_t j = 0; j < d; ++j) room[j] = float(row[j]);
  return room.data();
}

// The portable path: the same steps, a head at a time.
template <class T>
void attend_portable(const Job& job, int64_t b, int64_t kv0, int64_t kv1, Scratch& scratch) {
  const int64_t d = job.head_dim;
  const int64_t len = job.lens[b], first = job.window > 0 ? std::max<int64_t>(0, len - job.window) : 0;
  const int64_t span = len - first;
  const int64_t* table = job.tables + b * job.max_blocks;
  std::vector<float>& s = scratch.scores;
  s.resize(std::max<int64_t>(span, 1));
  for (int64_t h = kv0 * job.group; h < kv1 * job.group; ++h) {
    const int64_t kv_head = h / job.group;
    const auto row = [&](const void* cache, int64_t t) {
      const int64_t slot = table[t / job.block_size] * job.block_size + t % job.block_size;
      return static_cast<const T*>(cache) + (slot * job.num_kv_heads + kv_head) * d;
    };
    const float* qh = job.q + (b * job.num_heads + h) * d;
    float* o = job.out + (b * job.num_heads + h) * d;
    std::fill(o, o + d, 0.f);
    if (span <= 0) continue;
    for (int64_t i = 0; i < span; ++i) s[i] = dot(qh, as_floats(row(job.k, first + i), d, scratch.key), d) * job.scale;
    const float most = *std::max_element(s.begin(), s.begin() + span);
    float total = 0.f;
    for (int64_t i = 0; i < span; ++i) {
      s[i] = std::exp(s[i] - most);
      total += s[i];
    }
    for (int64_t i = 0; i < span; ++i) {
      const T* vh = row(job.v, first + i);
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) o[j] += s[i] * float(vh[j]);
    }
    const float inv = 1.f / total;
    for (int64_t j = 0; j < d; ++j) o[j] *= inv;
  }
}

}  // namespace

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ATTN_NS attention_avx2
#define ATTN_TARGET __attribute__((target("avx2,fma,f16c")))
#define ATTN_512 0
namespace ATTN_NS {
#include "paged_attention_x86.h"
}
#undef ATTN_NS
#undef ATTN_TARGET
#undef ATTN_512
#define ATTN_NS attention_avx512
#define ATTN_TARGET __attribute__((target("avx2,fma,f16c,avx512f")))
#define ATTN_512 1
namespace ATTN_NS {
#include "paged_attention_x86.h"
}
#undef ATTN_NS
#undef ATTN_TARGET
#undef ATTN_512
#endif

// q: (batch, num_heads, head_dim) float32, contiguous.
// k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim) float32, float16 or
// bfloat16 (both the same), contiguous.
// block_tables: (batch, max_blocks) int64; context_lens: (batch,) int64.
// window: keys older than the last `window` positions are masked (0 = no window).
// isa: the code path (module comment); -1 the best this CPU runs.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor context_lens,
                                     double scale, int64_t window, int64_t isa) {
  const at::ScalarType cache_type = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && v_cache.scalar_type() == cache_type &&
                  (cache_type == at::kFloat || cache_type == at::kHalf || cache_type == at::kBFloat16) &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention takes a contiguous float32 q and float32, float16 or bfloat16 caches");
  TORCH_CHECK(isa <= best_isa(), "paged_decode_attention: this CPU cannot run isa ", isa);
  if (isa < 0) isa = best_isa();
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2);
  auto out = q.new_empty(q.sizes());
  const Job job{q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(),
                block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                num_heads, num_kv_heads, head_dim, k_cache.size(1), block_tables.size(1), num_heads / num_kv_heads,
                window, static_cast<float>(scale)};
  const auto pick = [&](auto element) {
    using T = decltype(element);
    auto attend = &attend_portable<T>;
#if defined(__x86_64__) || defined(__i386__)
    if (isa >= kAvx512Vnni && head_dim % 16 == 0)
      attend = &attention_avx512::attend<T>;
    else if (isa >= kAvx2 && head_dim % 8 == 0)
      attend = &attention_avx2::attend<T>;
#endif
    return attend;
  };
  const auto attend = cache_type == at::kHalf       ? pick(at::Half{})
                      : cache_type == at::kBFloat16 ? pick(at::BFloat16{})
                                                    : pick(float{});
  // A sequence's KV heads split into `parts` items where the batch alone gives each
  // thread fewer than two.
  const int64_t parts = std::clamp<int64_t>((2 * at::get_num_threads() + batch - 1) / std::max<int64_t>(batch, 1), 1,
                                            num_kv_heads);
  at::parallel_for(0, batch * parts, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / parts, part = item % parts;
      attend(job, b, part * num_kv_heads / parts, (part + 1) * num_kv_heads / parts, scratch);
    }
  });
  return out;
}
