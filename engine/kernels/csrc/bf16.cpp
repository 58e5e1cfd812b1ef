// Products with bf16 weights for the fused kernels (torch.ops.lab.bf16_*, registered in ops.cpp): x rounded to
// bf16 (nearest even), bf16 x bf16 products summed in fp32 (AVX512-BF16's dot products of pairs), fp32 out. The
// weight is packed once in tiles of 16 output rows, each pair of a row's inputs side by side (a vector holds one pair
// of 16 rows), so that a lane is an output and no sum crosses lanes. Where the build (AVX2, scalar) or the CPU has no
// AVX512-BF16 (bf16_native() false) the engine runs torch's bf16 product instead (engine/model/linear.py).
#include "native.h"
#include "ops.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

constexpr int64_t TILES = 3;  // tiles per kernel call (x RB rows: 24 sums in registers; 576 or 960 outputs split
                              // evenly over 2 threads, 64 rows into 8 calls)
constexpr int64_t RB = 8;     // rows of x per kernel call

// Whether this build multiplies bf16 pairs (AVX-512's: LAB_BF16) and this CPU has the instructions (AVX512-BF16).
bool bf16_native() {
#if defined(LAB_BF16)
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
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

#if defined(LAB_BF16)
// R rows of xb (bf16, K each, `xs` apart) against `nt` tiles starting at w: out rows (`os` apart) at column c0;
// meanwhile the `lines` cache lines from pf are asked into L2, spread over the loop.
template <int R, int NT>
BF16_TARGET static void tile_kernel(const uint16_t* xb, int64_t xs, const uint16_t* w, int64_t K, float* out,
                                    int64_t os, int64_t c0, int64_t N, const float* bias, const float* res, int64_t rs,
                                    const char* pf, int64_t lines) {
  F acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = zero();
  const int64_t ts = TILE * K, per = (lines + K / 2 - 1) / (K / 2);  // elements per tile; lines per pair of inputs
  for (int64_t j = 0; j < K / 2; ++j) {
    for (int64_t i = j * per; i < std::min(lines, j * per + per); ++i) __builtin_prefetch(pf + 64 * i, 0, 2);
    Pairs wv[NT];
    for (int t = 0; t < NT; ++t) wv[t] = pairs(w + t * ts + j * TILE * 2);
    for (int r = 0; r < R; ++r) {
      const Pairs xv = pair(xb + r * xs + 2 * j);
      for (int t = 0; t < NT; ++t) acc[r][t] = dot_pairs(acc[r][t], xv, wv[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t c = c0 + t * TILE, n = std::min<int64_t>(TILE, N - c);
    if (n <= 0) break;
    const F b = bias ? load_first(bias + c, n) : zero();
    for (int r = 0; r < R; ++r) {
      F y = add(acc[r][t], b);
      if (res) y = add(y, load_first(res + r * rs + c, n));
      store_first(y, out + r * os + c, n);
    }
  }
}

// K floats at x -> K bf16 at o, nearest even (inputs below 2^-126 count as zeros).
BF16_TARGET static void to_bf16(const float* x, uint16_t* o, int64_t K) {
  for (int64_t k = 0; k < K; k += TILE) round_first(x + k, o + k, K - k);
}

using Kernel = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t, int64_t,
                        const float*, const float*, int64_t, const char*, int64_t);

template <int NT>
static Kernel kernel_for(int64_t rows) {
  switch (rows) {
    case 1: return tile_kernel<1, NT>;
    case 2: return tile_kernel<2, NT>;
    case 3: return tile_kernel<3, NT>;
    case 4: return tile_kernel<4, NT>;
    case 5: return tile_kernel<5, NT>;
    case 6: return tile_kernel<6, NT>;
    case 7: return tile_kernel<7, NT>;
    default: return tile_kernel<8, NT>;
  }
}

// [T, N] bf16 of T rows of N floats rounded: row t is row(t, buf), computed into buf [N] (a thread's own) or read
// in place.
template <typename Row>
static at::Tensor bf16_rows(const at::Tensor& like, int64_t T, int64_t N, const Row& row) {
  at::Tensor out = at::empty({T, N}, like.options().dtype(at::kBFloat16));
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  parallel(0, T, grain_of(N), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(N);
    for (int64_t t = begin; t < end; ++t) to_bf16(row(t, buf.data()), op + t * N, N);
  });
  return out;
}
#endif

// x [T, N] (rows may be strided), w [N] -> rms_norm's result rounded to bf16 as bf16_linear rounds its x: the same
// values, in one pass.
at::Tensor bf16_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check(x, "x");
  check(w, "w");
  TORCH_CHECK(bf16_native(), "bf16_rms_norm: this build or CPU has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "bf16_rms_norm: x [T, N] and w [N] are needed");
#if defined(LAB_BF16)
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  const int64_t N = x.size(1), xs = x.stride(0);
  return bf16_rows(x, x.size(0), N, [&](int64_t t, float* o) {
    norm_row(xp + t * xs, wp, N, eps, o);
    return o;
  });
#else
  return at::Tensor();
#endif
}

// gu [T, 2I] -> silu_mul's result rounded to bf16, in one pass.
at::Tensor bf16_silu_mul(const at::Tensor& gu) {
  check(gu, "gu");
  TORCH_CHECK(bf16_native(), "bf16_silu_mul: this build or CPU has no AVX512-BF16");
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "bf16_silu_mul: gu [T, 2I] is needed");
#if defined(LAB_BF16)
  const float* gp = gu.data_ptr<float>();
  const int64_t I = gu.size(1) / 2, gs = gu.stride(0);
  return bf16_rows(gu, gu.size(0), I, [&](int64_t t, float* o) {
    silu_row(gp + t * gs, gp + t * gs + I, I, o);
    return o;
  });
#else
  return at::Tensor();
#endif
}

// x [T, K] float32 (rows may be strided; rounded to bf16 here) or bf16 (contiguous) times w (bf16_pack's, n
// outputs) -> [T, n] float32 (+ bias [n]) (+ residual [T, n]).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  const bool rounded = x.scalar_type() == at::kBFloat16;
  if (rounded) {
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "x: a contiguous bfloat16 CPU tensor is needed");
  } else {
    check(x, "x");
  }
  TORCH_CHECK(bf16_native(), "bf16_linear: this build or CPU has no AVX512-BF16");
#if defined(LAB_BF16)
  const int64_t T = x.size(0), K = x.size(1), tiles = (n + TILE - 1) / TILE;
  TORCH_CHECK(x.dim() == 2 && K % 2 == 0 && w.scalar_type() == at::kBFloat16 && w.numel() == tiles * TILE * K,
              "bf16_linear: x [T, K] and w packed by bf16_pack for [n, K] are needed");
  if (bias) TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat, "bias [n]");
  if (residual) check(*residual, "residual");
  at::Tensor xb = x;
  if (!rounded) {
    const float* xf = x.data_ptr<float>();
    const int64_t xs = x.stride(0);
    xb = bf16_rows(x, T, K, [&](int64_t t, float*) { return xf + t * xs; });
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  at::Tensor out = at::empty({T, n}, x.options().dtype(at::kFloat));
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const float* rp = residual ? residual->data_ptr<float>() : nullptr;
  const int64_t rs = residual ? residual->stride(0) : 0, groups = (tiles + TILES - 1) / TILES;
  const int64_t blocks = (T + RB - 1) / RB, helpers = std::max<int64_t>(1, blocks - 1);
  parallel(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t t0 = g * TILES, nt = std::min(TILES, tiles - t0);
      // The thread's next group of tiles is asked from memory into L2 while this one computes, a share in each row
      // block after the first (the only one: in it): no block then waits on memory for its weights.
      const int64_t next = g + 1 < end ? std::min(TILES, tiles - t0 - TILES) * TILE * K * 2 / 64 : 0;  // lines
      const int64_t share = (next + helpers - 1) / helpers;
      const char* pf = reinterpret_cast<const char*>(wp + (t0 + TILES) * TILE * K);
      for (int64_t r = 0, b = 0; r < T; r += RB, ++b) {
        const int64_t rows = std::min(RB, T - r), k = blocks > 1 ? b - 1 : b;  // k: this block's share
        const int64_t lines = k < 0 ? 0 : std::max<int64_t>(0, std::min(share, next - k * share));
        const Kernel f = nt == TILES ? kernel_for<TILES>(rows)
                                                                : nt == 2 ? kernel_for<2>(rows) : kernel_for<1>(rows);
        f(xp + r * K, K, wp + t0 * TILE * K, K, op + r * n, n, t0 * TILE, n, bp, rp ? rp + r * rs : nullptr, rs,
          pf + 64 * std::max<int64_t>(0, k) * share, lines);
      }
    }
  });
  return out;
#else
  return at::Tensor();
#endif
}
