// Fused fp32 CPU kernels for the steps' small operators (torch.ops.lab.*, registered in ops.cpp). Each replaces
// several ATen calls (and their temporaries) with one pass over the data, vectorized with vec.h's V (AVX-512, AVX2 or
// scalar, as built), parallel over rows (native.h's parallel).
#include "native.h"
#include "ops.h"

// x [T, N] (rows may be strided), w [N] -> x * rsqrt(mean(x^2) + eps) * w, [T, N] contiguous
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check(x, "x");
  check(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "rms_norm: x [T, N] and w [N] are needed");
  const int64_t T = x.size(0), N = x.size(1), xs = x.stride(0);
  at::Tensor out = at::empty({T, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel(0, T, grain_of(N), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(xp + t * xs, wp, N, static_cast<float>(eps), op + t * N);
  });
  return out;
}

// gu [T, 2I] (gate, then up) -> silu(gate) * up, [T, I]
at::Tensor silu_mul(const at::Tensor& gu) {
  check(gu, "gu");
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "silu_mul: gu [T, 2I] is needed");
  const int64_t T = gu.size(0), I = gu.size(1) / 2, gs = gu.stride(0);
  at::Tensor out = at::empty({T, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel(0, T, grain_of(I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_row(gp + t * gs, gp + t * gs + I, I, op + t * I);
  });
  return out;
}

// qk [T, heads, D] in place: x * cos + swap_halves(x) * sin, cos and sin [T, D] (sin's first half negated)
void rotary_(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin) {
  check(qk, "qk");
  check(cos, "cos");
  check(sin, "sin");
  TORCH_CHECK(qk.dim() == 3 && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == qk.size(0) &&
                  cos.size(1) == qk.size(2) && qk.size(2) % 2 == 0,
              "rotary_: qk [T, heads, D], cos and sin [T, D] are needed");
  const int64_t T = qk.size(0), Hd = qk.size(1), D = qk.size(2);
  const int64_t qs = qk.stride(0), hs = qk.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  float* qp = qk.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  parallel(0, T, grain_of(Hd * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cp + t * cs, *s = sp + t * ss;
      for (int64_t j = 0; j < Hd; ++j) rotate_row(qp + t * qs + j * hs, c, s, D, qp + t * qs + j * hs);
    }
  });
}

// dst [N, D] (fp32, or bf16: rounded to nearest even) in place: row rows[i] = src's i-th row, src [T, heads, D] fp32
// (any strides but the last), i = t * heads + j
void write_rows_(at::Tensor dst, const at::Tensor& rows, const at::Tensor& src) {
  TORCH_CHECK(dst.device().is_cpu() && (dst.scalar_type() == at::kFloat || dst.scalar_type() == at::kBFloat16),
              "dst: a float32 or bfloat16 CPU tensor is needed");
  check(src, "src");
  TORCH_CHECK(dst.dim() == 2 && dst.is_contiguous() && src.dim() == 3 && src.size(2) == dst.size(1) &&
                  rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == src.size(0) * src.size(1),
              "write_rows_: dst [N, D] contiguous, rows [T * heads] int64, src [T, heads, D] are needed");
  const int64_t T = src.size(0), Hd = src.size(1), D = src.size(2), N = dst.size(0);
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < T * Hd; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < N, "write_rows_: row ", r[i], " out of range");
  const float* sp = src.data_ptr<float>();
  const auto copy = [&](auto* dp) {
    parallel(0, T * Hd, grain_of(D), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)  // float -> at::BFloat16 rounds to nearest even, as Tensor.to does
        convert_row(sp + (i / Hd) * src.stride(0) + (i % Hd) * src.stride(1), dp + r[i] * D, D);
    });
  };
  if (dst.scalar_type() == at::kBFloat16)
    copy(dst.data_ptr<at::BFloat16>());
  else
    copy(dst.data_ptr<float>());
}

// x [T, N] (rows may be strided) -> each row's index of its first maximum, int64 [T]: torch.argmax(dim=-1)'s
// choice (a NaN counts as the maximum), in two vectorized passes over the row (its maximum, then where it first is)
// instead of argmax's index-tracking loop.
at::Tensor first_argmax(const at::Tensor& x) {
  check(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "first_argmax: x [T, N] with N > 0 is needed");
  const int64_t T = x.size(0), N = x.size(1), xs = x.stride(0);
  at::Tensor out = at::empty({T}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  parallel(0, T, grain_of(N), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* r = xp + t * xs;
      V a[4] = {splat(-INFINITY), splat(-INFINITY), splat(-INFINITY), splat(-INFINITY)};  // four chains of maxima
      int64_t i = 0;
      for (; i + 4 * W <= N; i += 4 * W)
        for (int j = 0; j < 4; ++j) a[j] = maximum(a[j], load(r + i + j * W));  // NaN wins
      for (; i + W <= N; i += W) a[0] = maximum(a[0], load(r + i));
      float m = largest(maximum(maximum(a[0], a[1]), maximum(a[2], a[3])));
      for (; i < N; ++i) m = std::isnan(r[i]) || r[i] > m ? r[i] : m;
      i = 0;
      if (std::isnan(m)) {  // the first NaN is the answer
        while (!std::isnan(r[i])) ++i;
      } else {
        const V mv = splat(m);
        for (; i + W <= N; i += W)
          if (any_equal(load(r + i), mv)) break;
        while (r[i] != m) ++i;  // within the vector found, or the tail
      }
      op[t] = i;
    }
  });
  return out;
}
