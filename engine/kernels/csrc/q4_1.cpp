// Q4_1's products (quant.h) and 8-bit products (a8.h), and whether they run in fixed point on this CPU.
#include "a8.h"

LAB_GGUF_OPS(q4_1, Q4_1)
LAB_A8_OPS(q4_1, A8Q4_1)

// Whether Q4_1 runs the integer kernels: built for them and on a CPU with AVX512-VNNI.
bool q4_1_fixed_point() {
#if defined(LAB_VNNI)
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return yes;
#else
  return false;
#endif
}
