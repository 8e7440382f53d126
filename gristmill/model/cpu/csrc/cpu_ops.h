// The CPU float32 ops (fused_ops.cpp, paged_attention.cpp, encoder_attention.cpp),
// declared for the decode stack (decode_stack.cpp), which runs them layer after layer.
#pragma once

#include "aten_light.h"

#include <vector>

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double offset, double eps);
std::vector<at::Tensor> residual_norm(at::Tensor x, at::Tensor delta, at::Tensor delta_weight,
                                         at::Tensor out_weight, double offset, double eps);
at::Tensor add_layer_norm_(at::Tensor x, at::Tensor delta, at::Tensor weight, at::Tensor bias, double eps);
at::Tensor gelu_(at::Tensor x);
std::vector<at::Tensor> qkv_rotary(at::Tensor q_in, at::Tensor k_in, at::Tensor v_in,
                                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                      at::Tensor q_weight, at::Tensor k_weight, double offset, double eps,
                                      at::Tensor cos, at::Tensor sin, at::Tensor positions);
at::Tensor encoder_attention(at::Tensor q, at::Tensor k, at::Tensor v, std::vector<int64_t> bounds,
                                double scale);
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor context_lens,
                                     double scale, int64_t window, int64_t isa);
at::Tensor decode_stack(at::Tensor x, at::Tensor positions, at::Tensor slot_mapping,
                           at::Tensor block_tables, at::Tensor context_lens,
                           std::vector<at::Tensor> tensors, std::vector<int64_t> ints,
                           std::vector<double> scales, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t activation, double norm_offset, double eps,
                           std::vector<at::Tensor> lora, std::vector<int64_t> lora_bounds, at::Tensor lora_rows,
                           at::Tensor lora_group_slots, at::Tensor lora_group_starts);
// y[rows of each group] += (x A_slot^T) B_slot^T, part by part: every adapter row of a
// step's projection in one call (lora_update.cpp).
void lora_update_(at::Tensor y, at::Tensor x, at::Tensor a_t, at::Tensor b_t, at::Tensor parts_used,
                  at::Tensor rows, at::Tensor group_slots, at::Tensor group_starts, std::vector<int64_t> bounds);
void mask_logits(at::Tensor logits, at::Tensor bitmask, std::vector<int64_t> rows);
