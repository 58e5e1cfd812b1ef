// The vector layer of every kernel: vec_avx512.h, vec_avx2.h or vec_scalar.h, as the build's flags choose
// (CPU_CAPABILITY_AVX512 or CPU_CAPABILITY_AVX2, set by engine/kernels/build.py; neither: scalar). Each defines ISA
// (the build's name), F (one fp32 value of each of a weight tile's TILE rows, a lane each) with its arithmetic and
// loads (bf16 pairs widened: evens, odds; bit fields of each row's 4 bytes: Words, bits), a tile kernel's shape and
// the FMA kernels' (FMA_TILES, FMA_ROWS); vec_avx512.h also the bf16 dot products (LAB_BF16) and the byte dot
// products of Q4_1 in fixed point (LAB_VNNI).
#pragma once
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

constexpr int64_t TILE = 16;  // rows of a packed weight tile (GGUF and bf16 products): an F's lanes

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")  // loops over a kernel's tiles and rows: its sums stay in registers
#define NO_UNROLL _Pragma("GCC unroll 1")  // a K-quant super-block's outer loop: 256 weights unrolled compile for minutes

#if defined(CPU_CAPABILITY_AVX512)
#include "vec_avx512.h"
#elif defined(CPU_CAPABILITY_AVX2)
#include "vec_avx2.h"
#else
#include "vec_scalar.h"
#endif
