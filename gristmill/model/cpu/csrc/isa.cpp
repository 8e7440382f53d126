// The code path this CPU runs best, detected at run time (the kernels never assume one).
#include "isa.h"

namespace {

int64_t detect_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni"))
    return kAvx512Vnni;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return kAvx2;
#endif
  return kPortable;
}

}  // namespace

int64_t best_isa() {
  static const int64_t isa = detect_isa();
  return isa;
}
