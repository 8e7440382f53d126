// The quantized linear extension: int8 and 4-bit weight kernels, and the code path this
// CPU runs best, detected at run time (the sources are compiled without -march=native).
#include "linear_common.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "int8 linear layer: block-quantized weights and activations");
  m.def("q4_linear", &q4_linear, "4-bit weight linear layer: block scales and minimums, int8 activations");
  m.def("best_isa", &best_isa, "0 portable, 1 avx2, 2 avx512_vnni: the best this CPU runs");
}
