// Weight tiles laid out in cache as fp32 (weight k of a tile's 16 rows at o + 16 k, a tile K x 16 floats) times rows
// of x, by an FMA kernel: each row's sum over k in order, whatever the rows beside it. The products whose weights are
// stored otherwise (GGUF blocks dequantized, bf16 pairs widened: quant.h, bf16.cpp) fill a group of tiles into
// the thread's cache once (tile_group) and run it against every row block of x.
#pragma once
#include "native.h"

struct Out {          // one product's: out [T, N] = x [T, K] W^T + bias + residual
  const float* x;     // [T, K] rows xs floats apart
  int64_t xs;
  const float* bias;  // [N] or null
  const float* res;   // [T, N] rows rs floats apart, or null
  int64_t rs;
  float* out;         // [T, N] contiguous
  int64_t N;
};

// The sums of NT tiles (the first at columns 16 i) for rows t0 to t0 + R - 1, plus bias and residual, into a.out
// (a: any operands with bias, res, rs, out and N).
template <int NT, int R, class A>
static inline void finish(const A& a, F (&acc)[NT][R], int64_t i, int64_t t0) {
  float o[NT][R][TILE];
  UNROLL for (int t = 0; t < NT; ++t) UNROLL for (int r = 0; r < R; ++r) store(acc[t][r], o[t][r]);
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < R; ++r) {
      const int64_t n0 = (i + t) * TILE, row = t0 + r;
      for (int64_t l = 0; l < std::min(TILE, a.N - n0); ++l) {
        float v = o[t][r][l];
        if (a.bias) v += a.bias[n0 + l];
        if (a.res) v += a.res[row * a.rs + n0 + l];
        a.out[row * a.N + n0 + l] = v;
      }
    }
}

// NT tiles at o (the first at columns 16 i) times rows t0 to t0 + R - 1 of x.
template <int NT, int R>
static void fma_tiles(const Out& a, const float* o, int64_t K, int64_t i, int64_t t0) {
  F acc[NT][R];
  UNROLL for (int t = 0; t < NT; ++t) UNROLL for (int r = 0; r < R; ++r) acc[t][r] = zero();
  const float* x = a.x + t0 * a.xs;
  for (int64_t k = 0; k < K; ++k) UNROLL for (int t = 0; t < NT; ++t) {
    const F v = floats16(o + (t * K + k) * TILE);
    UNROLL for (int r = 0; r < R; ++r) acc[t][r] = fma(x[r * a.xs + k], v, acc[t][r]);
  }
  finish<NT, R>(a, acc, i, t0);
}

using FmaKernel = void (*)(const Out&, const float*, int64_t, int64_t, int64_t);

template <int G = FMA_TILES, int R = FMA_ROWS>
static FmaKernel fma_kernel_for(int64_t nt, int64_t r) {  // nt tiles (at most G), r rows (at most R)
  if constexpr (G > 1)
    if (nt < G) return fma_kernel_for<G - 1, R>(nt, r);
  if constexpr (R > 1)
    if (r < R) return fma_kernel_for<G, R - 1>(nt, r);
  return fma_tiles<G, R>;
}

// out = x W^T (+ bias + residual) for T rows of x and N outputs: fill(t, o) writes tile t's K x 16 floats at o.
template <class Fill>
static void tiled_product(const Out& a, int64_t T, int64_t K, const Fill& fill) {
  const int64_t tiles = (a.N + TILE - 1) / TILE, G = tile_group(tiles, TILE * K * 4, FMA_TILES);
  parallel(0, (tiles + G - 1) / G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(G * K * TILE);  // a group's weights
    for (int64_t g = begin; g < end; ++g) {
      const int64_t t0 = g * G, nt = std::min<int64_t>(G, tiles - t0);
      for (int64_t t = 0; t < nt; ++t) fill(t0 + t, o.data() + t * K * TILE);
      for (int64_t r = 0; r < T; r += FMA_ROWS)  // a block's rows of x stay in cache over the group's tiles
        for (int64_t s = 0; s < nt; s += FMA_TILES)
          fma_kernel_for(std::min<int64_t>(FMA_TILES, nt - s), std::min<int64_t>(FMA_ROWS, T - r))(
              a, o.data() + s * K * TILE, K, t0 + s, r);
    }
  });
}
