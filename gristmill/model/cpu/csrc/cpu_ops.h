// The CPU float32 ops of the cpu_ops extension (fused_ops.cpp, paged_attention.cpp),
// declared for the decode stack (decode_stack.cpp), which runs them layer after layer.
#pragma once

#include <torch/extension.h>

#include <vector>

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double offset, double eps);
std::vector<torch::Tensor> residual_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor delta_weight,
                                         torch::Tensor out_weight, double offset, double eps);
std::vector<torch::Tensor> qkv_rotary(torch::Tensor q_in, torch::Tensor k_in, torch::Tensor v_in,
                                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                      torch::Tensor q_weight, torch::Tensor k_weight, double offset, double eps,
                                      torch::Tensor cos, torch::Tensor sin, torch::Tensor positions);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale, int64_t window);
torch::Tensor decode_stack(torch::Tensor x, torch::Tensor positions, torch::Tensor slot_mapping,
                           torch::Tensor block_tables, torch::Tensor context_lens,
                           std::vector<torch::Tensor> tensors, std::vector<int64_t> ints,
                           std::vector<double> scales, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t activation, double norm_offset, double eps);
void mask_logits(torch::Tensor logits, torch::Tensor bitmask, std::vector<int64_t> rows);
