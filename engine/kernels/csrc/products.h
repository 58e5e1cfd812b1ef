// lab.layers' product kinds (engine/kernels/csrc/layer.cpp): the enum and its names, in the order of
// engine/kernels/build.py's PRODUCTS (capabilities() reports the names; a test compares them).
#pragma once
#include <cstdint>

#define LAB_PRODUCTS(X) X(IN_OUT, "in_out") X(LINEAR, "linear") X(PACKED, "packed") X(ONEDNN, "onednn") \
  X(Q4_1, "q4_1") X(Q8_0, "q8_0") X(BF16, "bf16") X(Q4_1_TILES, "q4_1_tiles") X(Q8_0_TILES, "q8_0_tiles") \
  X(BF16_TILES, "bf16_tiles") X(Q4_1_MM, "q4_1_mm") X(Q8_0_MM, "q8_0_mm") X(BF16_MM, "bf16_mm") X(Q4_K, "q4_k") \
  X(Q5_0, "q5_0") X(Q6_K, "q6_k") X(Q4_K_TILES, "q4_k_tiles") X(Q5_0_TILES, "q5_0_tiles") X(Q6_K_TILES, "q6_k_tiles") \
  X(Q4_K_MM, "q4_k_mm") X(Q5_0_MM, "q5_0_mm") X(Q6_K_MM, "q6_k_mm") X(SEGMENTS, "segments") \
  X(FP32_TILES, "fp32_tiles") X(Q4_1_A8, "q4_1_a8") X(Q8_0_A8, "q8_0_a8") X(Q4_K_A8, "q4_k_a8") X(Q5_0_A8, "q5_0_a8") \
  X(Q6_K_A8, "q6_k_a8")

#define LAB_ENUM(kind, name) kind,
enum Product : int64_t { LAB_PRODUCTS(LAB_ENUM) };
#undef LAB_ENUM

#define LAB_NAME(kind, name) name,
constexpr const char* PRODUCT_NAMES[] = {LAB_PRODUCTS(LAB_NAME)};
#undef LAB_NAME
