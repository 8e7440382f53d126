// The one Python module of the CPU kernels: the fused float32 ops, the paged decode
// attention, the encoder attention, the decode stack and the quantized linears (q4 only where GRISTMILL_Q4 is 1:
// the build for 4-bit models). The only file that includes pybind11 (torch's casters for
// at::Tensor), so the kernels themselves compile fast.
#include <torch/csrc/utils/pybind.h>

#include "cpu_ops.h"
#include "linear_common.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mask_logits", &mask_logits, "structured output: -inf for the tokens a bitmask row does not allow");
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (CPU, float32)");
  m.def("encoder_attention", &encoder_attention,
        "an encoder's attention within each sequence, from strided q/k/v (CPU, float32)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension");
  m.def("residual_norm", &residual_norm, "x + norm(delta) * w, and the norm of that for the next sublayer");
  m.def("add_layer_norm_", &add_layer_norm_, "LayerNorm of x + delta, over delta: an encoder's residual add and norm");
  m.def("gelu_", &gelu_, "GELU (erf form) in place");
  m.def("qkv_rotary", &qkv_rotary, "split fused qkv into heads, q/k norm, rotary");
  m.def("decode_stack", &decode_stack, "a decode-only step's decoder layers in one call");
  m.def("int8_linear", &int8_linear, "int8 linear layer: block-quantized weights and activations");
  m.def("int8_linear_argmax", &int8_linear_argmax,
        "the argmax of each row of int8_linear's output, without writing that output");
  m.def("gguf_linear", &gguf_linear, "linear layer over GGUF quantized blocks as they lie, int8 activations");
  m.def("gguf_linear_argmax", &gguf_linear_argmax,
        "the argmax of each row of gguf_linear's output, without writing that output");
  m.def("gguf_dequantize", &gguf_dequantize, "the float32 weights of GGUF quantized blocks, as gguf_linear sees them");
  m.def("gguf_pack_panels", &gguf_pack_panels, "a GGUF part's panels for a code path, packed once");
  m.def("gguf_panel_bytes", &gguf_panel_bytes, "the bytes gguf_pack_panels makes of a part");
  m.def("gguf_panels_from_rows", &gguf_panels_from_rows, "the fewest rows that read a part's panels packed once");
#if GRISTMILL_Q4
  m.def("q4_linear", &q4_linear, "4-bit weight linear layer: block scales and minimums, int8 activations");
#endif
  m.def("lora_update_", &lora_update_, "LoRA adapters' updates of one projection, every adapter row of a step");
  m.def("best_isa", &best_isa, "0 portable, 1 avx2, 2 avx512_vnni: the best this CPU runs");
}
