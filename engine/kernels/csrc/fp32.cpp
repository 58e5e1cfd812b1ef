// Products with fp32 weights packed once in tiles of 16 output rows (weight k of a tile's rows at 16 k: tiles.h's
// layout), for steps of few rows (torch.ops.lab.fp32_tiles_linear, registered in ops.cpp): each output's sum over k in
// order by FMA, whatever the rows beside it. A decode step reads its weights once from memory, each thread its own
// share of the tiles, front to back.
#include "native.h"
#include "ops.h"
#include "tiles.h"

#include <ATen/ops/zeros.h>

// w [N, K] -> [ceil(N / 16) * K * 16] floats: tile i holds rows 16 i .. 16 i + 15, weight k of its rows at 16 k
// (rows past N zero).
at::Tensor fp32_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "fp32_pack: w [N, K] is needed");
  const int64_t N = w.size(0), K = w.size(1), tiles = (N + TILE - 1) / TILE;
  const at::Tensor src = w.to(at::kFloat).contiguous();
  at::Tensor out = at::zeros({tiles * TILE * K}, src.options());
  const float* s = src.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) o[(n / TILE) * TILE * K + k * TILE + n % TILE] = s[n * K + k];
  return out;
}

// x [T, K] float32 (rows may be strided) times w (fp32_pack's, n outputs) -> [T, n] (+ bias [n]) (+ residual [T, n]).
at::Tensor fp32_tiles_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const Opt& bias,
                             const Opt& residual) {
  check(x, "x");
  check(w, "w");
  const int64_t T = x.size(0), K = x.size(1), tiles = (n + TILE - 1) / TILE;
  TORCH_CHECK(x.dim() == 2 && w.numel() == tiles * TILE * K, "fp32_tiles_linear: x [T, K] and w packed by fp32_pack "
              "for [n, K] are needed");
  if (bias) TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat, "bias [n]");
  if (residual) check(*residual, "residual");
  at::Tensor out = at::empty({T, n}, x.options());
  const Out a{x.data_ptr<float>(), x.stride(0), bias ? bias->data_ptr<float>() : nullptr,
              residual ? residual->data_ptr<float>() : nullptr, residual ? residual->stride(0) : 0,
              out.data_ptr<float>(), n};
  const float* wp = w.data_ptr<float>();
  const int64_t G = FMA_TILES, groups = (tiles + G - 1) / G;
  parallel(0, groups, 1, [&](int64_t begin, int64_t end) {  // each thread's groups in memory order: one stream
    for (int64_t g = begin; g < end; ++g)
      for (int64_t r = 0; r < T; r += FMA_ROWS)  // a group's tiles stay in cache over the row blocks
        fma_kernel_for(std::min(G, tiles - g * G), std::min<int64_t>(FMA_ROWS, T - r))(a, wp + g * G * TILE * K, K,
                                                                                       g * G, r);
  });
  return out;
}
