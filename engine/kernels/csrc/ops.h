// Every operator of torch.ops.lab, as its kernel file defines it (registered in ops.cpp), and what the build runs.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

using Opt = std::optional<at::Tensor>;

// native.cpp: the steps' small fp32 operators
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& gu);
void rotary_(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin);
void write_rows_(at::Tensor dst, const at::Tensor& rows, const at::Tensor& src);
at::Tensor first_argmax(const at::Tensor& x);

// decode_attention.cpp
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Opt& bias,
                            double scale);
at::Tensor rotary_decode_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                   const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& rows,
                                   const Opt& bias, int64_t length, int64_t heads, double scale);
at::Tensor token_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& spans,
                           const Opt& rows, double scale);

// q4_1.cpp, q8_0.cpp, q4_k.cpp, q5_0.cpp, q6_k.cpp (their kernels in quant.h): the GGUF block formats' products,
// X(name, format): for each, name_pack (blocks as stored -> tiles), name_linear (per row of x), name_tiles_linear
// (tiles dequantized into cache), name_mm_linear (ATen's GEMM); and the 8-bit products (a8.h): name_a8_pack (their
// packing), name_a8_linear (x quantized to 8 bits per block, integer sums)
#define LAB_GGUF(X) X(q4_1, Q4_1) X(q8_0, Q8_0) X(q4_k, Q4_K) X(q5_0, Q5_0) X(q6_k, Q6_K)
#define LAB_GGUF_DECLARE(f, Q)                                                                                \
  at::Tensor f##_pack(const at::Tensor& blocks);                                                              \
  at::Tensor f##_linear(const at::Tensor& x, const at::Tensor& w, const Opt& bias, const Opt& residual);       \
  at::Tensor f##_tiles_linear(const at::Tensor& x, const at::Tensor& w, const Opt& bias, const Opt& residual); \
  at::Tensor f##_mm_linear(const at::Tensor& x, const at::Tensor& w, const Opt& bias, const Opt& residual);    \
  at::Tensor f##_a8_pack(const at::Tensor& blocks);                                                           \
  at::Tensor f##_a8_linear(const at::Tensor& x, const at::Tensor& w, const Opt& bias, const Opt& residual);
LAB_GGUF(LAB_GGUF_DECLARE)
#undef LAB_GGUF_DECLARE
at::Tensor bf16_mm_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const Opt& bias, const Opt& residual);
at::Tensor q8_0_rows(const at::Tensor& w, const at::Tensor& ids);
at::Tensor q8_0_a8_rows(const at::Tensor& w, const at::Tensor& ids);  // of Q8_0's 8-bit packing
bool q4_1_fixed_point();  // Q4_1's products run in fixed point (built with LAB_VNNI, on a CPU with AVX512-VNNI)

// bf16.cpp: bf16 products
at::Tensor bf16_pack(const at::Tensor& w);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const Opt& bias, const Opt& residual);
at::Tensor bf16_tiles_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const Opt& bias,
                             const Opt& residual);
at::Tensor bf16_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor bf16_silu_mul(const at::Tensor& gu);
bool bf16_native();  // the bf16 products run here (built for AVX-512, on a CPU with AVX512-BF16)

// fp32.cpp: fp32 products on weights packed in tiles
at::Tensor fp32_pack(const at::Tensor& w);
at::Tensor fp32_tiles_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const Opt& bias,
                             const Opt& residual);

// layer.cpp: every decoder layer of a step
at::Tensor layers(const at::Tensor& x, const std::vector<Opt>& weights, at::IntArrayRef kinds, const at::Tensor& cos,
                  const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& rows,
                  const Opt& spans, const Opt& key_rows, const Opt& bias, int64_t seats, int64_t length, int64_t heads,
                  double eps, double scale);
