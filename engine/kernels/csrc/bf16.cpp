// Products with bf16 weights for the fused kernels (torch.ops.lab.bf16_*, registered in ops.cpp): x rounded to
// bf16 (nearest even), bf16 x bf16 products summed in fp32, fp32 out. The weight is packed once in tiles of 16 output
// rows, each pair of a row's inputs side by side (a vector holds one pair of 16 rows), so that a lane is an output and
// no sum crosses lanes. Two kernels, one arithmetic: where the CPU has AVX512-BF16 (bf16_native()), vdpbf16ps
// multiplies the pairs; elsewhere (every build) the pairs are widened to fp32 in registers (a shift) and summed with
// FMA, the second of each pair first as vdpbf16ps adds them. A product of two bf16 is exact in fp32, so the two give
// the same sums (tests/test_bf16_cpu.py compares their bits).
#include "native.h"
#include "ops.h"
#include "tiles.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

constexpr int64_t TILES = 3;  // vdpbf16ps kernel: tiles per call (x RB rows: 24 sums in registers; 576 or 960
                              // outputs split evenly over 2 threads, 64 rows into 8 calls)
constexpr int64_t RB = 8;     // and rows of x per call (the widened kernel's: FMA_TILES and FMA_ROWS, vec.h)

// Whether this build multiplies bf16 pairs (AVX-512's: LAB_BF16) and this CPU has the instructions (AVX512-BF16).
bool bf16_native() {
#if defined(LAB_BF16)
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

// x rounded to bf16, nearest even, as AVX512-BF16's conversion rounds: inputs below 2^-126 count as zeros (sign kept),
// a NaN stays a (quiet) NaN.
static inline uint16_t bf16_bits(float x) {  // branch-free: loops over it vectorize
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t nearest = (u + 0x7FFF + ((u >> 16) & 1)) >> 16, zero = (u >> 16) & 0x8000, nan = (u >> 16) | 0x40;
  const uint32_t r = (u & 0x7F800000) == 0 ? zero : nearest;
  return static_cast<uint16_t>((u & 0x7FFFFFFF) > 0x7F800000 ? nan : r);
}

// w [N, K] float -> bf16 [ceil(N/16) * K * 16]: tile i, pair j holds rows 16i..16i+15's inputs 2j, 2j+1 interleaved.
at::Tensor bf16_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.size(1) % 2 == 0, "bf16_pack: w [N, K] with K even is needed");
  const int64_t N = w.size(0), K = w.size(1), tiles = (N + TILE - 1) / TILE;
  const at::Tensor src = w.to(at::kFloat).contiguous();
  at::Tensor out = at::zeros({tiles * TILE * K}, src.options().dtype(at::kBFloat16));
  const float* s = src.data_ptr<float>();
  auto* o = out.data_ptr<at::BFloat16>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      o[(n / TILE) * TILE * K + (k / 2) * TILE * 2 + (n % TILE) * 2 + k % 2] = at::BFloat16(s[n * K + k]);
  return out;
}

// The sums acc of R rows and NT tiles (columns from c0 on) + bias + residual into out rows `os` apart.
template <int R, int NT>
ALWAYS_INLINE void finish(F (&acc)[R][NT], float* out, int64_t os, int64_t c0, int64_t N, const float* bias,
                          const float* res, int64_t rs) {
  for (int t = 0; t < NT; ++t) {
    const int64_t c = c0 + t * TILE, n = std::min<int64_t>(TILE, N - c);
    if (n <= 0) break;
    for (int r = 0; r < R; ++r) {
      float o[TILE];
      store(acc[r][t], o);
      for (int64_t l = 0; l < n; ++l) {
        float y = o[l] + (bias ? bias[c + l] : 0.f);
        if (res) y += res[r * rs + c + l];
        out[r * os + c + l] = y;
      }
    }
  }
}

// Cache lines [j * per, j * per + per) of the `lines` from pf asked into L2 (per: lines per pair of inputs).
ALWAYS_INLINE void fetch(const char* pf, int64_t lines, int64_t per, int64_t j) {
  for (int64_t i = j * per; i < std::min(lines, j * per + per); ++i) __builtin_prefetch(pf + 64 * i, 0, 2);
}

// R rows of x (K each, `xs` apart: fp32 holding bf16 values) against NT tiles starting at w, the pairs widened:
// out rows (`os` apart) at column c0, + bias + residual; meanwhile the `lines` cache lines from pf are asked into
// L2, spread over the loop.
template <int R, int NT>
static void wide_kernel(const void* x, int64_t xs, const uint16_t* w, int64_t K, float* out, int64_t os, int64_t c0,
                        int64_t N, const float* bias, const float* res, int64_t rs, const char* pf, int64_t lines) {
  F acc[R][NT];
  UNROLL for (int r = 0; r < R; ++r) UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = zero();
  const auto* xf = static_cast<const float*>(x);
  const int64_t ts = TILE * K, per = (lines + K / 2 - 1) / (K / 2);  // elements per tile
  for (int64_t j = 0; j < K / 2; ++j) {
    fetch(pf, lines, per, j);
    UNROLL for (int t = 0; t < NT; ++t) {  // the second of each pair first, as vdpbf16ps; one weight vector live
      const F odd = odds(w + t * ts + j * TILE * 2);
      UNROLL for (int r = 0; r < R; ++r) acc[r][t] = fma(xf[r * xs + 2 * j + 1], odd, acc[r][t]);
      const F even = evens(w + t * ts + j * TILE * 2);
      UNROLL for (int r = 0; r < R; ++r) acc[r][t] = fma(xf[r * xs + 2 * j], even, acc[r][t]);
    }
  }
  finish<R, NT>(acc, out, os, c0, N, bias, res, rs);
}

#if defined(LAB_BF16)
// The same with x in bf16 and vdpbf16ps.
template <int R, int NT>
BF16_TARGET static void native_kernel(const void* x, int64_t xs, const uint16_t* w, int64_t K, float* out, int64_t os,
                                      int64_t c0, int64_t N, const float* bias, const float* res, int64_t rs,
                                      const char* pf, int64_t lines) {
  F acc[R][NT];
  UNROLL for (int r = 0; r < R; ++r) UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = zero();
  const auto* xb = static_cast<const uint16_t*>(x);
  const int64_t ts = TILE * K, per = (lines + K / 2 - 1) / (K / 2);
  for (int64_t j = 0; j < K / 2; ++j) {
    fetch(pf, lines, per, j);
    Pairs wv[NT];
    UNROLL for (int t = 0; t < NT; ++t) wv[t] = pairs(w + t * ts + j * TILE * 2);
    UNROLL for (int r = 0; r < R; ++r) {
      const Pairs xv = pair(xb + r * xs + 2 * j);
      UNROLL for (int t = 0; t < NT; ++t) acc[r][t] = dot_pairs(acc[r][t], xv, wv[t]);
    }
  }
  finish<R, NT>(acc, out, os, c0, N, bias, res, rs);
}
#endif

using Kernel = void (*)(const void*, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t, int64_t,
                        const float*, const float*, int64_t, const char*, int64_t);

// The kernel for `rows` rows (at most R) and NT tiles.
template <bool NATIVE, int NT, int R>
static Kernel kernel_for(int64_t rows) {
  if constexpr (R > 1)
    if (rows < R) return kernel_for<NATIVE, NT, R - 1>(rows);
#if defined(LAB_BF16)
  if constexpr (NATIVE) return native_kernel<R, NT>;
#endif
  return wide_kernel<R, NT>;
}

// ... and for nt tiles (at most G).
template <bool NATIVE, int G, int R>
static Kernel pick(int64_t nt, int64_t rows) {
  if constexpr (G > 1)
    if (nt < G) return pick<NATIVE, G - 1, R>(nt, rows);
  return kernel_for<NATIVE, G, R>(rows);
}

// [T, N] bf16 of T rows of N floats rounded: row t is row(t, buf), computed into buf [N] (a thread's own) or read
// in place.
template <typename Row>
static at::Tensor bf16_rows(const at::Tensor& like, int64_t T, int64_t N, const Row& row) {
  at::Tensor out = at::empty({T, N}, like.options().dtype(at::kBFloat16));
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  parallel(0, T, grain_of(N), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(N);
    for (int64_t t = begin; t < end; ++t) {
      const float* x = row(t, buf.data());
      for (int64_t k = 0; k < N; ++k) op[t * N + k] = bf16_bits(x[k]);
    }
  });
  return out;
}

// x [T, N] (rows may be strided), w [N] -> rms_norm's result rounded to bf16 as bf16_linear rounds its x: the same
// values, in one pass.
at::Tensor bf16_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check(x, "x");
  check(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "bf16_rms_norm: x [T, N] and w [N] are needed");
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  const int64_t N = x.size(1), xs = x.stride(0);
  return bf16_rows(x, x.size(0), N, [&](int64_t t, float* o) {
    norm_row(xp + t * xs, wp, N, eps, o);
    return o;
  });
}

// gu [T, 2I] -> silu_mul's result rounded to bf16, in one pass.
at::Tensor bf16_silu_mul(const at::Tensor& gu) {
  check(gu, "gu");
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "bf16_silu_mul: gu [T, 2I] is needed");
  const float* gp = gu.data_ptr<float>();
  const int64_t I = gu.size(1) / 2, gs = gu.stride(0);
  return bf16_rows(gu, gu.size(0), I, [&](int64_t t, float* o) {
    silu_row(gp + t * gs, gp + t * gs + I, I, o);
    return o;
  });
}

// The product's tile groups (g tiles each) over its row blocks (rb rows each), split between the threads: kernel f
// (nt tiles, rows) -> its kernel; x's rows `xs` elements of `size` bytes apart.
template <class Pick>
static void run(const char* xp, int64_t size, int64_t xs, const uint16_t* wp, int64_t K, float* op, int64_t n,
                int64_t T, const float* bp, const float* rp, int64_t rs, int64_t G, int64_t rb, const Pick& kernel) {
  const int64_t tiles = (n + TILE - 1) / TILE, groups = (tiles + G - 1) / G;
  const int64_t blocks = (T + rb - 1) / rb, helpers = std::max<int64_t>(1, blocks - 1);
  parallel(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t t0 = g * G, nt = std::min(G, tiles - t0);
      // The thread's next group of tiles is asked from memory into L2 while this one computes, a share in each row
      // block after the first (the only one: in it): no block then waits on memory for its weights.
      const int64_t next = g + 1 < end ? std::min(G, tiles - t0 - G) * TILE * K * 2 / 64 : 0;  // lines
      const int64_t share = (next + helpers - 1) / helpers;
      const char* pf = reinterpret_cast<const char*>(wp + (t0 + G) * TILE * K);
      for (int64_t r = 0, b = 0; r < T; r += rb, ++b) {
        const int64_t rows = std::min(rb, T - r), k = blocks > 1 ? b - 1 : b;  // k: this block's share
        const int64_t lines = k < 0 ? 0 : std::max<int64_t>(0, std::min(share, next - k * share));
        kernel(nt, rows)(xp + r * xs * size, xs, wp + t0 * TILE * K, K, op + r * n, n, t0 * TILE, n, bp,
                         rp ? rp + r * rs : nullptr, rs, pf + 64 * std::max<int64_t>(0, k) * share, lines);
      }
    }
  });
}

// The checks of a product's arguments: x [T, K] float32 (rows may be strided) or bf16 (contiguous), w bf16_pack's
// for [n, K], bias [n], residual [T, n].
static void check_args(const at::Tensor& x, const at::Tensor& w, int64_t n, const Opt& bias, const Opt& residual) {
  if (x.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "x: a contiguous bfloat16 CPU tensor is needed");
  } else {
    check(x, "x");
  }
  const int64_t K = x.size(1), tiles = (n + TILE - 1) / TILE;
  TORCH_CHECK(x.dim() == 2 && K % 2 == 0 && w.scalar_type() == at::kBFloat16 && w.numel() == tiles * TILE * K,
              "bf16_linear: x [T, K] and w packed by bf16_pack for [n, K] are needed");
  if (bias) TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat, "bias [n]");
  if (residual) check(*residual, "residual");
}

// x [T, K] float32 (rows may be strided; rounded to bf16 here) or bf16 (contiguous) times w (bf16_pack's, n
// outputs) -> [T, n] float32 (+ bias [n]) (+ residual [T, n]).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const Opt& bias, const Opt& residual) {
  check_args(x, w, n, bias, residual);
  const int64_t T = x.size(0), K = x.size(1);
  at::Tensor xb = x;
  if (x.scalar_type() != at::kBFloat16) {
    const float* xf = x.data_ptr<float>();
    const int64_t xs = x.stride(0);
    xb = bf16_rows(x, T, K, [&](int64_t t, float*) { return xf + t * xs; });
  }
  at::Tensor out = at::empty({T, n}, x.options().dtype(at::kFloat));
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const float* rp = residual ? residual->data_ptr<float>() : nullptr;
  const int64_t rs = residual ? residual->stride(0) : 0;
  if (bf16_native()) {
    const char* xp = reinterpret_cast<const char*>(xb.data_ptr<at::BFloat16>());
    run(xp, 2, K, wp, K, op, n, T, bp, rp, rs, TILES, RB,
        [](int64_t nt, int64_t rows) { return pick<true, TILES, RB>(nt, rows); });
    return out;
  }
  // x widened once to fp32 (its bf16 values) for the FMA kernel's broadcasts
  const at::Tensor xf = xb.to(at::kFloat);
  run(reinterpret_cast<const char*>(xf.data_ptr<float>()), 4, K, wp, K, op, n, T, bp, rp, rs, FMA_TILES, FMA_ROWS,
      [](int64_t nt, int64_t rows) { return pick<false, FMA_TILES, FMA_ROWS>(nt, rows); });
  return out;
}

// The same product by the FMA kernel over tiles widened once into cache (tiles.h), each pair's second weight before
// its first and x's pairs swapped to match: the very sums of bf16_linear (the same order), faster where x has many
// rows.
at::Tensor bf16_tiles_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const Opt& bias,
                             const Opt& residual) {
  check_args(x, w, n, bias, residual);
  const int64_t T = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({T, n}, x.options().dtype(at::kFloat));
  static thread_local std::vector<float> xf;  // x's pairs swapped, rounded: kept from call to call (no fresh pages)
  xf.resize(std::max<size_t>(xf.size(), T * K));
  const bool rounded = x.scalar_type() == at::kBFloat16;  // xb: x's bf16, else xp: its floats
  const auto* xb = rounded ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  const float* xp = rounded ? nullptr : x.data_ptr<float>();
  float* fp = xf.data();
  parallel(0, T, grain_of(K), [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> row(K);
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* r = xb ? xb + t * K : row.data();
      if (!xb)
        for (int64_t k = 0; k < K; ++k) row[k] = bf16_bits(xp[t * x.stride(0) + k]);
      auto* o = reinterpret_cast<uint32_t*>(fp + t * K);
      for (int64_t k = 0; k < K; k += 2) {  // x's pairs swapped, widened
        o[k] = static_cast<uint32_t>(r[k + 1]) << 16;
        o[k + 1] = static_cast<uint32_t>(r[k]) << 16;
      }
    }
  });
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const Out a{fp, K, bias ? bias->data_ptr<float>() : nullptr, residual ? residual->data_ptr<float>() : nullptr,
              residual ? residual->stride(0) : 0, out.data_ptr<float>(), n};
  tiled_product(a, T, K, [&](int64_t t, float* o) {
    const uint16_t* p = wp + t * TILE * K;
    for (int64_t j = 0; j < K / 2; ++j) {
      store(odds(p + j * TILE * 2), o + 2 * j * TILE);
      store(evens(p + j * TILE * 2), o + (2 * j + 1) * TILE);
    }
  });
  return out;
}

// The same product by ATen's (MKL's) fp32 GEMM on the pairs widened whole and x rounded: the same products, summed in
// MKL's order (which may depend on the rows beside a row); fastest where x has many rows.
at::Tensor bf16_mm_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const Opt& bias, const Opt& residual) {
  check_args(x, w, n, bias, residual);
  const int64_t T = x.size(0), K = x.size(1), tiles = (n + TILE - 1) / TILE;
  at::Tensor xr = x.scalar_type() == at::kBFloat16 ? x : bf16_rows(x, T, K, [&](int64_t t, float*) {
    return x.data_ptr<float>() + t * x.stride(0);
  });
  at::Tensor W = at::empty({tiles * TILE, K}, x.options().dtype(at::kFloat));
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint32_t*>(W.data_ptr<float>());
  parallel(0, tiles, grain_of(TILE * K), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)  // pair j of row r of tile i at (j * 16 + r) * 2 of the tile
      for (int64_t j = 0; j < K / 2; ++j)
        for (int64_t r = 0; r < TILE; ++r)
          for (int64_t h = 0; h < 2; ++h)
            op[(i * TILE + r) * K + 2 * j + h] = static_cast<uint32_t>(wp[i * TILE * K + (j * TILE + r) * 2 + h]) << 16;
  });
  const at::Tensor Wn = W.narrow(0, 0, n).t(), xf = xr.to(at::kFloat);
  at::Tensor y = bias ? at::addmm(*bias, xf, Wn) : residual ? at::addmm(*residual, xf, Wn) : at::mm(xf, Wn);
  return bias && residual ? y.add_(*residual) : y;
}
