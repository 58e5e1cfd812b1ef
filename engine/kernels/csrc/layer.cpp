// Every decoder layer of a step in one call (torch.ops.lab.layers, registered in ops.cpp), each layer: norm, qkv
// product, rotary, KV writes, attention, o product (+ residual), norm, gate/up product, SiLU x up, down product
// (+ residual), each step the same operator the Python layer loop calls (a decode's rotary, K/V writes and attention
// fused in one, rotary_decode_attention, with the values of the three), so the results are the same bits; only the
// per-operator Python dispatch is gone. Each product is named by its kind (Product, products.h). Each step is
// recorded under its operator's name for the profiler (probe_hardware's split).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/mm.h>
#include <ATen/record_function.h>

#include "layer_weights.h"
#include "native.h"
#include "ops.h"
#include "products.h"

#define NAMED(name) RECORD_FUNCTION("lab::" name, std::vector<c10::IValue>())  // a span the profiler sees

// An operator registered elsewhere (MKL's, oneDNN's), called with its arguments boxed.
static at::Tensor call(const c10::OperatorHandle& op, std::vector<c10::IValue> args) {
  op.callBoxed(&args);
  return args[0].toTensor();
}

static c10::OperatorHandle find(const char* name, const char* overload = "") {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

// y = x W^T (+ bias) (+ residual) as kernels.Dense.product (or the GGUF and bf16 products) computes it: w and aux
// are the layouts that product reads (aux: the [out, in] weight MKL's packed product takes its sizes from; for bf16
// the number of outputs).
static at::Tensor product(int64_t kind, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& aux,
                          const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  switch (kind) {
    case IN_OUT:
    case LINEAR: {
      const at::Tensor W = kind == IN_OUT ? w : w.t();
      if (!bias) return residual ? at::addmm(*residual, x, W) : at::mm(x, W);
      at::Tensor y = at::addmm(*bias, x, W);
      return residual ? y.add_(*residual) : y;
    }
    case PACKED: {
      static const c10::OperatorHandle op = find("mkl::_mkl_linear");
      at::Tensor y = call(op, {x, w, *aux, bias, x.size(0)});
      return residual ? y.add_(*residual) : y;
    }
    case ONEDNN: {
      if (residual) {
        static const c10::OperatorHandle op = find("mkldnn::_linear_pointwise", "binary");
        return call(op, {x, *residual, w, bias, "add"});
      }
      static const c10::OperatorHandle op = find("mkldnn::_linear_pointwise");
      return call(op, {x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), ""});
    }
#define LAB_GGUF_CASES(f, Q)                                                                                   \
  case Q: {                                                                                                    \
    NAMED(#f "_linear");                                                                                       \
    return f##_linear(x, w, bias, residual);                                                                   \
  }                                                                                                            \
  case Q##_TILES: {                                                                                            \
    NAMED(#f "_tiles_linear");                                                                                 \
    return f##_tiles_linear(x, w, bias, residual);                                                             \
  }                                                                                                            \
  case Q##_MM: {                                                                                               \
    NAMED(#f "_mm_linear");                                                                                    \
    return f##_mm_linear(x, w, bias, residual);                                                                \
  }                                                                                                            \
  case Q##_A8: {                                                                                               \
    NAMED(#f "_a8_linear");                                                                                    \
    return f##_a8_linear(x, w, bias, residual);                                                                \
  }
    LAB_GGUF(LAB_GGUF_CASES)  // this library's own GGUF products: called directly, named for the profiler
#undef LAB_GGUF_CASES
    case BF16: {  // aux: the number of outputs, a 0-dim int64 tensor
      NAMED("bf16_linear");
      return bf16_linear(x, w, *aux->const_data_ptr<int64_t>(), bias, residual);
    }
    case BF16_TILES: {
      NAMED("bf16_tiles_linear");
      return bf16_tiles_linear(x, w, *aux->const_data_ptr<int64_t>(), bias, residual);
    }
    case BF16_MM: {
      NAMED("bf16_mm_linear");
      return bf16_mm_linear(x, w, *aux->const_data_ptr<int64_t>(), bias, residual);
    }
    case FP32_TILES: {  // aux: the number of outputs, a 0-dim int64 tensor
      NAMED("fp32_tiles_linear");
      return fp32_tiles_linear(x, w, *aux->const_data_ptr<int64_t>(), bias, residual);
    }
    case SEGMENTS: {  // w: the parts' packed blocks one after another, flat; aux [parts, 3] int64: each part's kind,
                      // outputs and bytes; each part's product gives its columns of y
      const auto t = aux->accessor<int64_t, 2>();
      std::vector<at::Tensor> ys;
      for (int64_t s = 0, n0 = 0, b0 = 0; s < t.size(0); n0 += t[s][1], b0 += t[s][2], ++s) {
        const auto part = [&](const std::optional<at::Tensor>& v, int64_t dim) -> std::optional<at::Tensor> {
          return v ? std::optional<at::Tensor>(v->narrow(dim, n0, t[s][1])) : std::nullopt;
        };
        ys.push_back(product(t[s][0], x, w.narrow(0, b0, t[s][2]).view({t[s][1], -1}), std::nullopt, part(bias, 0),
                             part(residual, 1)));
      }
      return at::cat(ys, 1);
    }
  }
  TORCH_CHECK(false, "layer: unknown product kind ", kind);
}

static bool rounds_x(int64_t kind) { return kind == BF16 || kind == BF16_TILES || kind == BF16_MM; }  // bf16's kinds

// The input of a product of `kind`: a bf16 product's already rounded to bf16 (the rounding it would do itself).
static at::Tensor norm(int64_t kind, const at::Tensor& x, const at::Tensor& w, double eps) {
  NAMED("rms_norm");
  return rounds_x(kind) ? bf16_rms_norm(x, w, eps) : rms_norm(x, w, eps);
}

static at::Tensor silu(int64_t kind, const at::Tensor& gu) {
  NAMED("silu_mul");
  return rounds_x(kind) ? bf16_silu_mul(gu) : silu_mul(gu);
}

// x [T, hidden] -> the layer's output. weights: LAYER_WEIGHTS of them, as layer_weights.h orders them (the norms',
// then (w, aux, bias) of the qkv, o, gate/up and down products); kinds: their LAYER_KINDS product kinds. cos, sin
// [T, D] (sin's first half negated); k_cache, v_cache this layer's cache, rows [T * kv heads] the flat cache rows the
// step's K/V go to. Attention: `spans` given, each token against its own keys (token_attention, `key_rows` on a
// paged cache); else decodes in seats [0, seats) against their first `length` keys (rotary_decode_attention, which
// also rotates and writes them; `bias` [seats, length] additive or none).
static at::Tensor layer(const at::Tensor& x, c10::ArrayRef<Opt> weights, at::IntArrayRef kinds, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& rows, const Opt& spans, const Opt& key_rows, const Opt& bias, int64_t seats,
                        int64_t length, int64_t heads, double eps, double scale) {
  const int64_t T = x.size(0), KV = k_cache.size(1), D = k_cache.size(3);
  const auto p = [&](const LayerProduct& j, const at::Tensor& in, const std::optional<at::Tensor>& residual) {
    return product(kinds[j.kind], in, *weights[j.w], weights[j.aux], weights[j.bias], residual);
  };
  const at::Tensor qkv = p(QKV_PRODUCT, norm(kinds[QKV_KIND], x, *weights[INPUT_NORM], eps), std::nullopt);
  at::Tensor attn;
  if (spans) {
    at::Tensor qk = qkv.narrow(1, 0, (heads + KV) * D).view({T, heads + KV, D});
    {
      NAMED("rotary_");
      rotary_(qk, cos, sin);
    }
    {
      NAMED("write_rows_");
      write_rows_(k_cache.view({-1, D}), rows, qk.narrow(1, heads, KV));
      write_rows_(v_cache.view({-1, D}), rows, qkv.narrow(1, (heads + KV) * D, KV * D).view({T, KV, D}));
    }
    NAMED("token_attention");
    attn = token_attention(qk.narrow(1, 0, heads), k_cache, v_cache, *spans, key_rows, scale);
  } else {  // rotary and the K/V writes inside, by the group that reads them
    NAMED("decode_attention");
    std::optional<at::Tensor> b;
    if (bias) b = bias->view({seats, length});
    attn = rotary_decode_attention(qkv, cos, sin, k_cache, v_cache, rows, b, length, heads, scale);
  }
  const at::Tensor h = p(O_PRODUCT, attn.reshape({T, heads * D}), x);
  const at::Tensor gu = p(GATE_UP_PRODUCT, norm(kinds[GATE_UP_KIND], h, *weights[POST_NORM], eps), std::nullopt);
  return p(DOWN_PRODUCT, silu(kinds[DOWN_KIND], gu), h);
}

// Layer i of the stack: weights[LAYER_WEIGHTS i, LAYER_WEIGHTS (i + 1)), kinds[LAYER_KINDS i, LAYER_KINDS (i + 1)),
// k_caches[i], v_caches[i]; the rest as above.
at::Tensor layers(const at::Tensor& x, const std::vector<Opt>& weights, at::IntArrayRef kinds, const at::Tensor& cos,
                  const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& rows,
                  const Opt& spans, const Opt& key_rows, const Opt& bias, int64_t seats, int64_t length, int64_t heads,
                  double eps, double scale) {
  const size_t L = k_caches.size();
  TORCH_CHECK(v_caches.size() == L && weights.size() == LAYER_WEIGHTS * L && kinds.size() == LAYER_KINDS * L,
              "layers: per layer a K and a V cache, ", LAYER_WEIGHTS, " weights (capabilities()'s layer_weights) and ",
              LAYER_KINDS, " product kinds are needed");
  at::Tensor h = x;
  for (size_t i = 0; i < L; ++i)
    h = layer(h, c10::ArrayRef<Opt>(weights).slice(LAYER_WEIGHTS * i, LAYER_WEIGHTS),
              kinds.slice(LAYER_KINDS * i, LAYER_KINDS), cos, sin, k_caches[i], v_caches[i], rows, spans, key_rows,
              bias, seats, length, heads, eps, scale);
  return h;
}
