// Products with GGUF weights as stored (gguf_blocks.h's formats, packed in tiles) for the fused kernels
// (torch.ops.lab.*, registered in ops.cpp), fp32 throughout: Q4_1 and Q8_0 add each block's d * sum(x * q)
// (+ m * sum(x)) to a row's sum, its codes' sum taken in one fixed order; Q5_0, Q4_K and Q6_K dequantize each weight
// in registers (the values gguf's dequantization gives) and add x times it to the row's sum in order of k; so a
// result row is the same bits whatever the number of rows T beside it. Each thread reads its tiles once for all T
// rows of x (gguf_kernels.h); the tiles product dequantizes a group of tiles into cache for an FMA kernel (tiles.h);
// the GEMM product dequantizes the whole weight for ATen's.
#pragma once
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>

#include "gguf_kernels.h"
#include "ops.h"

// The checks of a product's arguments: x [T, K] float32 (K a positive multiple of QK), packed w [N, K/QK * B],
// bias [N], residual [T, N].
template <class Q>
static void check_args(const at::Tensor& x, const at::Tensor& w, const Opt& bias, const Opt& residual) {
  check(x, "x");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() &&
                  x.dim() == 2 && w.size(1) == x.size(1) / Q::QK * Q::B && x.size(1) % Q::QK == 0 && x.size(1) > 0,
              "linear: x [T, K] (K a positive multiple of ", Q::QK, ") and packed w uint8 [N, K/", Q::QK, " * ", Q::B,
              "] are needed");
  if (bias) {
    check(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), "linear: bias [N] is needed");
  }
  if (residual) {
    check(*residual, "residual");
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == x.size(0) && residual->size(1) == w.size(0),
                "linear: residual [T, N] is needed");
  }
}

// x [T, K] float32 (rows may be strided), w packed [N, K/32 * B], bias [N], residual [T, N] -> [T, N] float32, each
// group of tiles (tile_group) dequantized once into the thread's cache (d * q (+ m) in fp32: the fp32 copy's values),
// then run against every row of x by an fp32 FMA kernel: a row's sum in order of k (the same bits whatever T).
template <class Q>
static at::Tensor dequantized(const at::Tensor& x, const at::Tensor& w, const Opt& bias, const Opt& residual) {
  check_args<Q>(x, w, bias, residual);
  const int64_t T = x.size(0), N = w.size(0), K = x.size(1), Kb = K / Q::QK, ts = TILE * Kb * Q::B, full = N / TILE;
  at::Tensor out = at::empty({T, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const std::vector<uint8_t> last = N % TILE ? widened_last<Q>(wp, N, Kb) : std::vector<uint8_t>();
  const Out a{x.data_ptr<float>(), x.stride(0), bias ? bias->data_ptr<float>() : nullptr,
              residual ? residual->data_ptr<float>() : nullptr, residual ? residual->stride(0) : 0,
              out.data_ptr<float>(), N};
  tiled_product(a, T, K, [&](int64_t t, float* o) {
    const uint8_t* p = t < full ? wp + t * ts : last.data();
    for (int64_t b = 0; b < Kb; ++b) Q::dequantize(p + b * TILE * Q::B, o + b * Q::QK * TILE);
  });
  return out;
}

// packed w [N, K/32 * B] -> its weights [N, K] float32, as gguf dequantizes them.
template <class Q>
static at::Tensor unpacked(const at::Tensor& w) {
  const int64_t N = w.size(0), Kb = w.size(1) / Q::B, K = Kb * Q::QK, ts = TILE * Kb * Q::B, full = N / TILE;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const std::vector<uint8_t> last = N % TILE ? widened_last<Q>(wp, N, Kb) : std::vector<uint8_t>();
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  parallel(0, (N + TILE - 1) / TILE, grain_of(TILE * K), [&](int64_t begin, int64_t end) {
    float o[Q::QK * TILE];  // a block of the tile's 16 rows, weight k's at o + 16 k
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* p = i < full ? wp + i * ts : last.data();
      for (int64_t b = 0; b < Kb; ++b) {
        Q::dequantize(p + b * TILE * Q::B, o);
        for (int64_t r = 0; r < std::min(TILE, N - i * TILE); ++r)
          for (int64_t k = 0; k < Q::QK; ++k) op[(i * TILE + r) * K + b * Q::QK + k] = o[k * TILE + r];
      }
    }
  });
  return out;
}

// The same product by ATen's (MKL's) GEMM on the weights dequantized whole: fastest where x has many rows (a row's
// sums then in MKL's order, which may depend on the rows beside it).
template <class Q>
static at::Tensor gemm(const at::Tensor& x, const at::Tensor& w, const Opt& bias, const Opt& residual) {
  check_args<Q>(x, w, bias, residual);
  const at::Tensor W = unpacked<Q>(w).t();
  at::Tensor y = bias ? at::addmm(*bias, x, W) : residual ? at::addmm(*residual, x, W) : at::mm(x, W);
  return bias && residual ? y.add_(*residual) : y;
}

// x [T, K] float32 (rows may be strided), w packed [N, K/32 * B], bias [N], residual [T, N] -> [T, N] float32
template <class Q>
static at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const Opt& bias, const Opt& residual) {
  check_args<Q>(x, w, bias, residual);
  const int64_t T = x.size(0), N = w.size(0), K = x.size(1), Kb = K / Q::QK, ts = TILE * Kb * Q::B;
  const bool ints = std::is_same_v<Q, Q4_1> && q4_1_fixed_point();
  const int rmax = ints ? RI : RMAX;  // rows of x per kernel at most
  at::Tensor out = at::empty({T, N}, x.options()), xs = at::empty({2, T, Kb}, x.options()),
             xk = at::empty({ints ? T * Kb * LIMBS * QK / 4 : T * K}, x.options());  // floats, or the bytes of ints
  const float* xp = x.data_ptr<float>();
  float *sp = xs.data_ptr<float>(), *ep = sp + T * Kb, *kp = xk.data_ptr<float>();
  int8_t* qp = reinterpret_cast<int8_t*>(kp);
  parallel(0, T * Kb, grain_of(Q::QK), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // block b of row t
      const int64_t t = i / Kb, b = i % Kb;
      const float* xb = xp + t * x.stride(0) + b * Q::QK;
      sp[i] = reduce_sum(xb, Q::QK);
#if defined(LAB_VNNI)
      if (ints) {
        ep[i] = fixed_point(xb, qp + i * LIMBS * QK);
        continue;
      }
#endif
      const int64_t t0 = t / RMAX * RMAX, rows = std::min<int64_t>(RMAX, T - t0);
      for (int64_t k = 0; k < Q::QK; ++k) kp[t0 * K + (b * Q::QK + k) * rows + t - t0] = xb[k] * Q::scale(k);
    }
  });
  const Operands a{kp, sp, qp, ep, bias ? bias->data_ptr<float>() : nullptr,
                   residual ? residual->data_ptr<float>() : nullptr, residual ? residual->stride(0) : 0,
                   out.data_ptr<float>(), T, N, Kb};
  const auto kernel = [&](int r, bool wide) {
#if defined(LAB_VNNI)
    if constexpr (std::is_same_v<Q, Q4_1>)  // the integer kernels compiled for Q4_1 alone
      if (ints) return int_kernel_for(r, wide);
#endif
    return kernel_for<Q>(r, wide);
  };
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t full = N / TILE;  // whole tiles (a partial last one widened: widened_last)
  parallel(0, (N + TILE - 1) / TILE, grain_of(TILE * K * std::max<int64_t>(1, T)),
           [&](int64_t begin, int64_t end) {
    const std::vector<uint8_t> last = end > full ? widened_last<Q>(wp, N, Kb) : std::vector<uint8_t>();
    for (int64_t g = begin; g < end; g += ACC)  // ACC tiles at a time, kept in cache over all rows of x
      for (int64_t t = 0; t < T; t += rmax) {
        const int r = std::min<int64_t>(rmax, T - t), nt = std::max(1, ACC / r);
        for (int64_t i = g; i < std::min(end, g + ACC);) {
          if (i + nt <= std::min({end, g + ACC, full})) {
            kernel(r, true)(a, wp + i * ts, ts, i, t);
            i += nt;
          } else {
            kernel(r, false)(a, i < full ? wp + i * ts : last.data(), ts, i, t);
            ++i;
          }
        }
      }
  });
  return out;
}

// Each format's operators (ops.h's LAB_GGUF), defined in the format's own file (compiled apart, in parallel):
// pack, and the per-row, tiles and GEMM products.
#define LAB_GGUF_OPS(f, Q)                                                                                \
  at::Tensor f##_pack(const at::Tensor& blocks) { return pack<Q>(blocks); }                               \
  at::Tensor f##_linear(const at::Tensor& x, const at::Tensor& w, const Opt& bias, const Opt& residual) {  \
    return linear<Q>(x, w, bias, residual);                                                               \
  }                                                                                                       \
  at::Tensor f##_tiles_linear(const at::Tensor& x, const at::Tensor& w, const Opt& bias, const Opt& residual) { \
    return dequantized<Q>(x, w, bias, residual);                                                          \
  }                                                                                                       \
  at::Tensor f##_mm_linear(const at::Tensor& x, const at::Tensor& w, const Opt& bias, const Opt& residual) { \
    return gemm<Q>(x, w, bias, residual);                                                                 \
  }
