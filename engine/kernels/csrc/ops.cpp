// torch.ops.lab: every operator's schema and its CPU kernel (the kernels in the files ops.h names; their fake
// shapes, for torch.compile's tracing, in engine/kernels/build.py), and capabilities(): what this build runs.
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "layer_weights.h"
#include "native.h"
#include "ops.h"
#include "products.h"

// (the instruction set the build is compiled for: AVX512, AVX2 or scalar; whether Q4_1's integer products
// (AVX512-VNNI) and the bf16 dot products (AVX512-BF16) run here; lab.layers' product kinds, in enum order; the
// names of a layer's weights lab.layers takes, in order)
static std::tuple<std::string, bool, bool, std::vector<std::string>, std::vector<std::string>> capabilities() {
  return {ISA, q4_1_fixed_point(), bf16_native(), {std::begin(PRODUCT_NAMES), std::end(PRODUCT_NAMES)},
          {std::begin(LAYER_WEIGHT_NAMES), std::end(LAYER_WEIGHT_NAMES)}};
}

TORCH_LIBRARY(lab, m) {
  m.def("capabilities() -> (str isa, bool q4_1_vnni, bool bf16_dot, str[] products, str[] layer_weights)",
        capabilities);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("first_argmax(Tensor x) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("rotary_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  m.def("write_rows_(Tensor(a!) dst, Tensor rows, Tensor src) -> ()");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale) -> Tensor");
  m.def("token_attention(Tensor q, Tensor k, Tensor v, Tensor spans, Tensor? rows, float scale) -> Tensor");
  m.def("rotary_decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor rows, Tensor? bias, int length, int heads, float scale) -> Tensor");
#define LAB_GGUF_DEF(f, Q)                                                                  \
  m.def(#f "_pack(Tensor blocks) -> Tensor");                                               \
  m.def(#f "_linear(Tensor x, Tensor w, Tensor? bias, Tensor? residual) -> Tensor");        \
  m.def(#f "_tiles_linear(Tensor x, Tensor w, Tensor? bias, Tensor? residual) -> Tensor");  \
  m.def(#f "_mm_linear(Tensor x, Tensor w, Tensor? bias, Tensor? residual) -> Tensor");   \
  m.def(#f "_a8_pack(Tensor blocks) -> Tensor");                                            \
  m.def(#f "_a8_linear(Tensor x, Tensor w, Tensor? bias, Tensor? residual) -> Tensor");
  LAB_GGUF(LAB_GGUF_DEF)
#undef LAB_GGUF_DEF
  m.def("bf16_mm_linear(Tensor x, Tensor w, int n, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("q8_0_rows(Tensor w, Tensor ids) -> Tensor");
  m.def("q8_0_a8_rows(Tensor w, Tensor ids) -> Tensor");
  m.def("bf16_pack(Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor w, int n, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("bf16_tiles_linear(Tensor x, Tensor w, int n, Tensor? bias, Tensor? residual) -> Tensor");  // same sums
  m.def("bf16_rms_norm(Tensor x, Tensor w, float eps) -> Tensor");  // rms_norm and silu_mul rounded to bf16
  m.def("bf16_silu_mul(Tensor gu) -> Tensor");
  m.def("fp32_pack(Tensor w) -> Tensor");
  m.def("fp32_tiles_linear(Tensor x, Tensor w, int n, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("layers(Tensor x, Tensor?[] weights, int[] kinds, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor rows, Tensor? spans, Tensor? key_rows, Tensor? bias, int seats, int length, "
        "int heads, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(lab, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("first_argmax", first_argmax);
  m.impl("silu_mul", silu_mul);
  m.impl("rotary_", rotary_);
  m.impl("write_rows_", write_rows_);
  m.impl("decode_attention", decode_attention);
  m.impl("token_attention", token_attention);
  m.impl("rotary_decode_attention", rotary_decode_attention);
#define LAB_GGUF_IMPL(f, Q)                         \
  m.impl(#f "_pack", f##_pack);                     \
  m.impl(#f "_linear", f##_linear);                 \
  m.impl(#f "_tiles_linear", f##_tiles_linear);     \
  m.impl(#f "_mm_linear", f##_mm_linear);         \
  m.impl(#f "_a8_pack", f##_a8_pack);             \
  m.impl(#f "_a8_linear", f##_a8_linear);
  LAB_GGUF(LAB_GGUF_IMPL)
#undef LAB_GGUF_IMPL
  m.impl("bf16_mm_linear", bf16_mm_linear);
  m.impl("q8_0_rows", q8_0_rows);
  m.impl("q8_0_a8_rows", q8_0_a8_rows);
  m.impl("bf16_pack", bf16_pack);
  m.impl("bf16_linear", bf16_linear);
  m.impl("bf16_tiles_linear", bf16_tiles_linear);
  m.impl("bf16_rms_norm", bf16_rms_norm);
  m.impl("bf16_silu_mul", bf16_silu_mul);
  m.impl("fp32_pack", fp32_pack);
  m.impl("fp32_tiles_linear", fp32_tiles_linear);
  m.impl("layers", layers);
}

TORCH_LIBRARY_IMPL(lab, MkldnnCPU, m) { m.impl("layers", layers); }  // weights in oneDNN's layout select this key
