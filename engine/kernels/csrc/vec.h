// The vector layer of every kernel: vec_avx512.h, vec_avx2.h or vec_scalar.h, each compiled only for its own build
// (engine/kernels/build.py's flags choose). Each defines ISA (the build's name) and three vector types with their
// operations:
// - F: one fp32 value of each of a weight tile's TILE rows, a lane each (zero, all, floats16, fma, add, sub, mul,
//   store; fp16 widened: halves; bf16 pairs widened: evens, odds; int8: bytes; bit fields of each row's 4 bytes:
//   Words, bits; Q4_1's codes: Nibbles), a tile kernel's shape (ACC, RMAX) and the FMA kernels' (FMA_TILES, FMA_ROWS);
// - V: W floats, the width of one register (load, splat, store, add, sub, mul, div, fma, neg, maximum, exp, exp_le0;
//   lanes reduced: sum, largest; any_equal; rounded to int8: round_bytes; bf16 widened by load, narrowed by
//   narrow_bf16), and attention's grouped reads (SPLIT_PAIRS: bf16 rows read as evens and odds, split_pairs,
//   split_floats, store_merged; SUM4: four dot products reduced together, sum4);
// - I: 16 int32 lanes, a tile's rows (izero, iall, iadd, isub, imul, ior, ishl, ifield, ifloat; 16 rows' 4 bytes:
//   lanes; int8: ibytes; 4 bytes in every lane: four; 4 byte products a lane summed: dot4 (u8 x s8), dot4s (s8 x s8);
//   short sums: dot4_short, then widened: int16 pairs where the build lacks VNNI, one vpmaddwd a sum rather than one
//   a product, exact while each int16 lane stays within 2^15),
//   the 8-bit products' kernel shape (A8_TILES, A8_ROWS) and their target attribute (A8_TARGET);
// vec_avx512.h also the bf16 dot products (LAB_BF16) and the byte dot products of Q4_1 in fixed point (LAB_VNNI).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

constexpr int64_t TILE = 16;  // rows of a packed weight tile (GGUF and bf16 products): an F's lanes

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")  // loops over a kernel's tiles and rows: its sums stay in registers
#define NO_UNROLL _Pragma("GCC unroll 1")  // a K-quant super-block's outer loop: 256 weights unrolled compile for minutes

#include "vec_avx512.h"
#include "vec_avx2.h"
#include "vec_scalar.h"
