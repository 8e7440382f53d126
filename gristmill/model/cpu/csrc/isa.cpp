// The code path this CPU runs best, detected at run time (the kernels never assume one),
// capped by GRISTMILL_MAX_ISA where it is set (kernels.py checks its value).
#include "isa.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

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

// GRISTMILL_MAX_ISA's path (kAvx512Vnni where it is unset or names none).
int64_t max_isa() {
  const char* name = std::getenv("GRISTMILL_MAX_ISA");
  if (name == nullptr) return kAvx512Vnni;
  if (std::strcmp(name, "portable") == 0) return kPortable;
  if (std::strcmp(name, "avx2") == 0) return kAvx2;
  return kAvx512Vnni;
}

}  // namespace

int64_t best_isa() {
  static const int64_t isa = std::min(detect_isa(), max_isa());
  return isa;
}
