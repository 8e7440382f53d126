// The code paths of the quantized linear kernels, and which one this CPU runs best.
#pragma once

#include <cstdint>

enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2 };

// 0 portable, 1 avx2, 2 avx512_vnni: the best this CPU runs (asked once, at run time).
int64_t best_isa();
