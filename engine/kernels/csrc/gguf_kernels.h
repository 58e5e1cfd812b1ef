// The per-row kernels of the GGUF products (quant.h): NT packed tiles times R rows of x, each block's sum added to
// a row's in one fixed order (fp32: Q::block), or for Q4_1 on a CPU with AVX512-VNNI (built with LAB_VNNI) in fixed
// point: each block's x * 2^e rounded to an integer (e the block's own: |x * 2^e| < 2^30, so an error of at most
// 2^-31 of the block's largest |x|) held in 4 signed bytes, the codes' sums exact in integers (byte dot products),
// then d * 2^-e * sum + m * sum(x) in fp32.
#pragma once
#include "gguf_blocks.h"
#include "tiles.h"

struct Operands {  // one product's: out [T, N] = x [T, K] W^T + bias + residual
  const float* x;     // [T, K] as the kernels read it, scaled for the format: rows t0 to t0 + R - 1 (t0 a multiple
                      // of RMAX, R = RMAX but for the last rows) from t0 * K on, weight k of row t0 + r at k * R + r
  const float* xsum;  // [T, K/QK] each block's sum of x
  const int8_t* xq;   // LAB_VNNI's Q4_1: [T, K/32, LIMBS, 32] each block's x * 2^e, byte l of each (l = 0 the lowest)
  const float* xe;    // and [T, K/32] its 2^-e
  const float* bias;  // [N] or null
  const float* res;   // [T, N] rows rs floats apart, or null
  int64_t rs;
  float* out;  // [T, N] contiguous
  int64_t T, N, Kb;
};

// NT tiles (the first at w, its columns from 16 i on, the next `ts` bytes on) times rows t0 to t0 + R - 1 of x.
template <class Q, int NT, int R>
static void tiles(const Operands& a, const uint8_t* w, int64_t ts, int64_t i, int64_t t0) {
  F acc[NT][R];
  UNROLL for (int t = 0; t < NT; ++t) UNROLL for (int r = 0; r < R; ++r) acc[t][r] = zero();
  const uint8_t* p[NT];
  for (int64_t b = 0; b < a.Kb; ++b) {
    UNROLL for (int t = 0; t < NT; ++t) {  // and the same block of the next NT tiles fetched into L2 meanwhile
      p[t] = w + t * ts + b * TILE * Q::B;
      for (int64_t l = 0; l < TILE * Q::B; l += 64) __builtin_prefetch(p[t] + NT * ts + l, 0, 2);
    }
    float xsum[R];
    UNROLL for (int r = 0; r < R; ++r) xsum[r] = a.xsum[(t0 + r) * a.Kb + b];
    Q::template block<NT, R>(p, a.x + (t0 * a.Kb + b * R) * Q::QK, xsum, acc);
  }
  finish<NT, R>(a, acc, i, t0);
}

using Kernel = void (*)(const Operands&, const uint8_t*, int64_t, int64_t, int64_t);

constexpr int LIMBS = 4;  // LAB_VNNI's Q4_1: signed bytes of a weight's x in fixed point
constexpr int RI = 2;  // and rows of x in one integer kernel at most: 2 rows x 2 tiles x LIMBS sums in registers,
                       // each broadcast byte of x used by two tiles (4 rows, one tile: 5-15% slower at many rows)

#if defined(LAB_VNNI)
// Block xb (32 floats) of x -> its LIMBS x 32 bytes (x * 2^e rounded to the nearest integer X, |X| < 2^30, as
// X = b0 + 2^8 b1 + 2^16 b2 + 2^24 b3, each b a signed byte) at q; returns 2^-e, NaN where x is not finite. e is at
// most 126 (2^-e stays a normal float): a block whose largest |x| is below 2^-96 keeps fewer bits.
VNNI_TARGET static inline float fixed_point(const float* xb, int8_t* q) {
  const F v[2] = {floats16(xb), floats16(xb + 16)};
  const float mx = max_abs(v[0], v[1]);
  if (!std::isfinite(mx)) {
    std::memset(q, 0, LIMBS * QK);
    return std::numeric_limits<float>::quiet_NaN();
  }
  int E;
  std::frexp(mx, &E);  // mx < 2^E
  const int e = std::min(30 - E, 126);
  for (int h = 0; h < 2; ++h) {
    I X = scaled_int(v[h], e);
    for (int l = 0; l < LIMBS; ++l) {
      const I b = l + 1 < LIMBS ? low_byte(X) : X;
      store_bytes(b, q + l * QK + 16 * h);
      X = above_byte(X, b);
    }
  }
  return std::ldexp(1.f, -e);
}

// Q4_1's NT tiles times rows t0 to t0 + R - 1 of x in fixed point: a block's codes (bytes 0-15) times each byte of
// x, 4 products a lane at a time (VNNI), summed exactly in int32 per byte of x (at most 32 * 15 * 128 each), then
// the 4 sums joined in fp32 (2^8-apart pairs exact in int32 first) and d * 2^-e * sum + m * sum(x) added to the row.
template <int NT, int R>
VNNI_TARGET static void int_tiles(const Operands& a, const uint8_t* w, int64_t ts, int64_t i, int64_t t0) {
  F acc[NT][R];
  UNROLL for (int t = 0; t < NT; ++t) UNROLL for (int r = 0; r < R; ++r) acc[t][r] = zero();
  const uint8_t* p[NT];
  for (int64_t b = 0; b < a.Kb; ++b) {
    UNROLL for (int t = 0; t < NT; ++t) {
      p[t] = w + t * ts + b * TILE * Q4_1::B;
      for (int64_t l = 0; l < TILE * Q4_1::B; l += 64) __builtin_prefetch(p[t] + NT * ts + l, 0, 2);
    }
    I s[NT][R][LIMBS];
    UNROLL for (int t = 0; t < NT; ++t) UNROLL for (int r = 0; r < R; ++r) UNROLL for (int l = 0; l < LIMBS; ++l)
      s[t][r][l] = izero();
    UNROLL for (int j = 0; j < 4; ++j) {  // code bytes 4j to 4j + 3 of each row: weights 4j.. (low), 16 + 4j.. (high)
      Codes c[NT];
      UNROLL for (int t = 0; t < NT; ++t) c[t] = codes(p[t] + in_tile(TILE, 4 + 4 * j, 4, 0));
      UNROLL for (int r = 0; r < R; ++r) UNROLL for (int l = 0; l < LIMBS; ++l) {
        const int8_t* xl = a.xq + ((t0 + r) * a.Kb + b) * LIMBS * QK + l * QK;
        const I bl = four(xl + 4 * j), bh = four(xl + 16 + 4 * j);
        UNROLL for (int t = 0; t < NT; ++t) s[t][r][l] = dot4(dot4(s[t][r][l], c[t].lo, bl), c[t].hi, bh);
      }
    }
    UNROLL for (int t = 0; t < NT; ++t) {
      const F d = halves(p[t]), m = halves(p[t] + in_tile(TILE, 2, 2, 0));
      UNROLL for (int r = 0; r < R; ++r) {
        const F sum = limbs(s[t][r]);
        const int64_t xb = (t0 + r) * a.Kb + b;
        acc[t][r] = fma(a.xsum[xb], m, fma(mul(d, a.xe[xb]), sum, acc[t][r]));
      }
    }
  }
  finish<NT, R>(a, acc, i, t0);
}

template <int R = RI>
static Kernel int_kernel_for(int r, bool wide) {
  if constexpr (R > 1)
    if (r < R) return int_kernel_for<R - 1>(r, wide);
  return wide ? int_tiles<std::max(1, ACC / R), R> : int_tiles<1, R>;
}

#endif

// The kernel for r rows of x: as many tiles as ACC allows (wide) or one.
template <class Q, int R = RMAX>
static Kernel kernel_for(int r, bool wide) {
  if constexpr (R > 1)
    if (r < R) return kernel_for<Q, R - 1>(r, wide);
  return wide ? tiles<Q, std::max(1, ACC / R), R> : tiles<Q, 1, R>;
}
