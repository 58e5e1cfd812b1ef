// Products with GGUF weights as stored, in blocks (Q4_1, Q8_0, Q5_0 of 32 weights; Q4_K, Q6_K super-blocks of 256)
// for the fused kernels (torch.ops.lab.*, registered in ops.cpp): the weights repacked once in tiles of 16 rows,
// each block's rows side by side, so that a vector holds one weight of 16 output rows and no sum ever crosses lanes.
// fp32 throughout: Q4_1 and Q8_0 add each block's d * sum(x * q) (+ m * sum(x)) to a row's sum, its codes' sum taken
// in one fixed order; Q5_0, Q4_K and Q6_K dequantize each weight in registers (the values gguf's dequantization gives)
// and add x times it to the row's sum in order of k; so a result row is the same bits whatever the number of rows T
// beside it. Each thread reads its tiles once for all T rows of x.
// Q4_1 on a CPU with AVX512-VNNI (built with LAB_VNNI): each block's x in fixed point (x * 2^e rounded to an integer,
// e the block's own: |x * 2^e| < 2^30, so an error of at most 2^-31 of the block's largest |x|) held in 4 signed
// bytes, the codes' sums exact in integers (byte dot products), then d * 2^-e * sum + m * sum(x) in fp32 as above.
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>

#include <cstring>

#pragma once
#include "native.h"
#include "ops.h"
#include "tiles.h"

constexpr int64_t QK = 32;  // weights per block of Q4_1 and Q8_0 (each format: Q::QK)

// A tile's block, `rows` rows: field after field (d, m, codes...), each field's rows side by side. A row's field j
// (width bytes, at offset `off` of the row's block as GGUF stores it) lies at `rows * off + r * width`.
static inline int64_t in_tile(int64_t rows, int64_t off, int64_t width, int64_t r) { return rows * off + r * width; }



// Q4_1: a row's block is d (fp16), m (fp16), 16 bytes of codes (byte i: weight i in its low nibble, i + 16 in its
// high); a weight is d * q + m. In a tile: d, m, then the codes 4 bytes (a field) at a time. A code comes out of
// its 4 bytes as q * 2^(4j) (j = 0 to 3, its place in a 16-bit half), so x comes scaled by 2^(12 - 4j) and d by
// 2^-12 (both exact, for |x| < 2^116): the sum of a block is 2^12 times the plain one, bit for bit, and d * sum the
// same product.
struct Q4_1 {
  static constexpr int64_t QK = ::QK, B = 20;  // weights and bytes of a row's block
  static constexpr int FIELDS = 6;
  static constexpr int64_t width(int j) { return j < 2 ? 2 : 4; }
  static constexpr float scale(int64_t k) {  // of weight k of a block: 2^(12 - 4j)
    return k < 16 ? (k % 2 ? 16.f : 4096.f) : (k % 2 ? 1.f : 256.f);
  }
  // acc[t][r] += the block's products of tile t (its block at p[t]) with row r of x (x [32, R]: the block's weights
  // of the R rows, scaled; xsum[r]: their sum in row r).
  template <int NT, int R>
  static inline void block(const uint8_t* const* p, const float* x, const float* xsum, F (&acc)[NT][R]) {
    F s[2][NT][R];  // sums of the low and of the high nibbles: two chains of additions a row
    UNROLL for (int h = 0; h < 2; ++h) UNROLL for (int t = 0; t < NT; ++t) UNROLL for (int r = 0; r < R; ++r)
      s[h][t][r] = zero();
    UNROLL for (int w = 0; w < 4; ++w) {
      Nibbles c[NT];
      UNROLL for (int t = 0; t < NT; ++t) c[t] = nibbles(p[t] + in_tile(TILE, 4 + 4 * w, 4, 0));
      UNROLL for (int i = 0; i < 8; ++i) {  // code i of each row's 4 bytes: weight 4w + i/2 (+ 16 for a high nibble)
        const float* xk = x + (4 * w + i / 2 + 16 * (i % 2)) * R;
        UNROLL for (int t = 0; t < NT; ++t) {
          const F q = nibble(c[t], i);
          UNROLL for (int r = 0; r < R; ++r) s[i % 2][t][r] = fma(xk[r], q, s[i % 2][t][r]);
        }
      }
    }
    UNROLL for (int t = 0; t < NT; ++t) {
      const F d = mul(halves(p[t]), 0x1p-12f), m = halves(p[t] + in_tile(TILE, 2, 2, 0));
      UNROLL for (int r = 0; r < R; ++r) acc[t][r] = fma(xsum[r], m, fma(d, add(s[0][t][r], s[1][t][r]), acc[t][r]));
    }
  }
  // A tile's block at p -> its weights d * q + m (the values GGUF's dequantization gives), weight k's 16 rows at
  // o + 16 k. A code comes scaled by 2^(4j): d by 2^-4j (exact), so that d * q is the same product.
  static inline void dequantize(const uint8_t* p, float* o) {
    const F d = halves(p), m = halves(p + in_tile(TILE, 2, 2, 0));
    const F ds[4] = {d, mul(d, 0x1p-4f), mul(d, 0x1p-8f), mul(d, 0x1p-12f)};
    UNROLL for (int w = 0; w < 4; ++w) {
      const Nibbles c = nibbles(p + in_tile(TILE, 4 + 4 * w, 4, 0));
      UNROLL for (int i = 0; i < 8; ++i)
        store(add(mul(ds[i % 4], nibble(c, i)), m), o + (4 * w + i / 2 + 16 * (i % 2)) * TILE);
    }
  }
};

// Q8_0: a row's block is d (fp16) and 32 int8 codes; a weight is d * q. In a tile: d, then the codes a byte at a time.
struct Q8_0 {
  static constexpr int64_t QK = ::QK, B = 34;
  static constexpr int FIELDS = 33;
  static constexpr int64_t width(int j) { return j ? 1 : 2; }
  static constexpr float scale(int64_t) { return 1.f; }
  template <int NT, int R>
  static inline void block(const uint8_t* const* p, const float* x, const float*, F (&acc)[NT][R]) {
    F s[NT][R];
    UNROLL for (int t = 0; t < NT; ++t) UNROLL for (int r = 0; r < R; ++r) s[t][r] = zero();
    for (int64_t k = 0; k < QK; ++k) UNROLL for (int t = 0; t < NT; ++t) {
      const F q = bytes(p[t] + in_tile(TILE, 2 + k, 1, 0));
      UNROLL for (int r = 0; r < R; ++r) s[t][r] = fma(x[k * R + r], q, s[t][r]);
    }
    UNROLL for (int t = 0; t < NT; ++t) {
      const F d = halves(p[t]);
      UNROLL for (int r = 0; r < R; ++r) acc[t][r] = fma(d, s[t][r], acc[t][r]);
    }
  }
  static inline void dequantize(const uint8_t* p, float* o) {  // d * q, weight k's 16 rows at o + 16 k
    const F d = halves(p);
    for (int64_t k = 0; k < QK; ++k) store(mul(d, bytes(p + in_tile(TILE, 2 + k, 1, 0))), o + k * TILE);
  }
};

// The formats whose products dequantize each weight in registers: Q::weights(p, sink) calls sink(k, w) for each
// weight k of a tile's block at p, w its 16 rows' values as gguf dequantizes them (each product rounded as gguf's).
template <class Q>
struct Dequantizing {
  static constexpr float scale(int64_t) { return 1.f; }  // x as it is
  // acc[t][r] += the block's weights of tile t (at p[t]) times row r of x (x [QK, R]), in order of k.
  template <int NT, int R>
  static inline void block(const uint8_t* const* p, const float* x, const float*, F (&acc)[NT][R]) {
    UNROLL for (int t = 0; t < NT; ++t) Q::weights(p[t], [&](int k, F w) {
      UNROLL for (int r = 0; r < R; ++r) acc[t][r] = fma(x[k * R + r], w, acc[t][r]);
    });
  }
  static inline void dequantize(const uint8_t* p, float* o) {  // weight k's 16 rows at o + 16 k
    Q::weights(p, [&](int k, F w) { store(w, o + k * TILE); });
  }
};

// Q5_0: a row's block is d (fp16), qh (4 bytes: bit k the fifth bit of weight k), 16 bytes of nibbles (byte i: weight
// i low, i + 16 high); a weight is d * (q - 16). In a tile: d, qh, then the nibbles 4 bytes (a field) at a time.
struct Q5_0 : Dequantizing<Q5_0> {
  static constexpr int64_t QK = 32, B = 22;
  static constexpr int FIELDS = 6;
  static constexpr int64_t width(int j) { return j ? 4 : 2; }
  template <class Sink>
  static inline void weights(const uint8_t* p, const Sink& sink) {
    const F d = halves(p);
    const Words h = words(p + in_tile(TILE, 2, 4, 0));
    UNROLL for (int w = 0; w < 4; ++w) {
      const Words c = words(p + in_tile(TILE, 6 + 4 * w, 4, 0));
      UNROLL for (int i = 0; i < 8; ++i) {  // nibble i of the 4 bytes: weight 4w + i/2 (+ 16 for a high nibble)
        const int k = 4 * w + i / 2 + 16 * (i % 2);
        const F q = add(bits(c, 4 * i, 0xF), mul(bits(h, k, 1), 16.f));
        sink(k, mul(d, sub(q, all(16.f))));
      }
    }
  }
};

// Q4_K: a row's super-block is d, dmin (fp16), 12 bytes of 6-bit scales and mins of its 8 sub-blocks of 32 (bytes
// 0-3: scales 0-3 in bits 0-5; 4-7: mins 0-3; 8-11: scales 4-7 in bits 0-3, mins 4-7 in bits 4-7, their bits 4-5 in
// bits 6-7 of bytes 0-3 and 4-7), 128 bytes of nibbles (sub-block j: bytes 32 (j/2) to 32 (j/2) + 31, low nibbles
// for even j, high for odd); a weight is (d * sc) * q - dmin * m. In a tile: d, dmin, then 4 bytes at a time.
struct Q4_K : Dequantizing<Q4_K> {
  static constexpr int64_t QK = 256, B = 144;
  static constexpr int FIELDS = 37;
  static constexpr int64_t width(int j) { return j < 2 ? 2 : 4; }
  template <class Sink>
  static inline void weights(const uint8_t* p, const Sink& sink) {
    const F d = halves(p), dmin = halves(p + in_tile(TILE, 2, 2, 0));
    const Words s[3] = {words(p + in_tile(TILE, 4, 4, 0)), words(p + in_tile(TILE, 8, 4, 0)),
                        words(p + in_tile(TILE, 12, 4, 0))};
    UNROLL for (int j = 0; j < 8; ++j) {
      const int b = 8 * (j % 4);  // the bit of byte j % 4 in a word of scales
      const F sc = j < 4 ? bits(s[0], b, 63) : add(bits(s[2], b, 0xF), mul(bits(s[0], b + 6, 3), 16.f));
      const F m = j < 4 ? bits(s[1], b, 63) : add(bits(s[2], b + 4, 0xF), mul(bits(s[1], b + 6, 3), 16.f));
      const F ds = mul(d, sc), dm = mul(dmin, m);
      NO_UNROLL for (int w = 0; w < 8; ++w) {  // codes 4w to 4w + 3 of the sub-block (the shifts fixed, places not)
        const Words c = words(p + in_tile(TILE, 16 + 32 * (j / 2) + 4 * w, 4, 0));
        UNROLL for (int i = 0; i < 4; ++i)
          sink(32 * j + 4 * w + i, sub(mul(ds, bits(c, 8 * i + 4 * (j % 2), 0xF)), dm));
      }
    }
  }
};

// Q6_K: a row's super-block is ql (128 bytes), qh (64), 16 int8 scales (one per 16 weights), d (fp16). Weight
// 128h + 32s + l (h < 2, s < 4, l < 32): its low 4 bits in byte 64h + 32 (s % 2) + l of ql (high nibble for s >= 2),
// its high 2 bits at bit 2s of byte 32h + l of qh; it is (d * sc) * (q - 32). In a tile: ql and qh 4 bytes at a time,
// the scales a byte at a time, d.
struct Q6_K : Dequantizing<Q6_K> {
  static constexpr int64_t QK = 256, B = 210;
  static constexpr int FIELDS = 65;
  static constexpr int64_t width(int j) { return j < 48 ? 4 : j < 64 ? 1 : 2; }
  template <class Sink>
  static inline void weights(const uint8_t* p, const Sink& sink) {
    const F d = halves(p + in_tile(TILE, 208, 2, 0));
    NO_UNROLL for (int h = 0; h < 2; ++h) UNROLL for (int s = 0; s < 4; ++s) UNROLL for (int g = 0; g < 2; ++g) {
      const F ds = mul(d, bytes(p + in_tile(TILE, 192 + 8 * h + 2 * s + g, 1, 0)));  // weights l = 16g to 16g + 15
      NO_UNROLL for (int w = 0; w < 4; ++w) {  // the shifts (of s) fixed, the places not
        const int l = 16 * g + 4 * w;
        const Words lo = words(p + in_tile(TILE, 64 * h + 32 * (s % 2) + l, 4, 0)),
                    hi = words(p + in_tile(TILE, 128 + 32 * h + l, 4, 0));
        UNROLL for (int i = 0; i < 4; ++i) {
          const F q = add(bits(lo, 8 * i + 4 * (s / 2), 0xF), mul(bits(hi, 8 * i + 2 * s, 3), 16.f));
          sink(128 * h + 32 * s + l + i, mul(ds, sub(q, all(32.f))));
        }
      }
    }
  }
};

// Copies each row's fields of every block from `src` to `dst`: from(block, offset, width, row) and to(...) give a
// field's place in each.
template <class Q, class Src, class Dst>
static void relayout(int64_t rows, int64_t Kb, const uint8_t* src, uint8_t* dst, const Src& from, const Dst& to) {
  for (int64_t b = 0; b < Kb; ++b)
    for (int j = 0, off = 0; j < Q::FIELDS; off += Q::width(j++))
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(dst + to(b, off, Q::width(j), r), src + from(b, off, Q::width(j), r), Q::width(j));
}

// blocks uint8 [N, K/QK * B] as GGUF stores them -> the same bytes in tiles: tile i (rows 16i to 16i + 15, the last
// tile maybe fewer) from byte 16i * K/32 * B on, block after block.
template <class Q>
static at::Tensor pack(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous() && blocks.size(1) % Q::B == 0,
              "pack: contiguous uint8 blocks [N, K/", Q::QK, " * ", Q::B, "] are needed");
  const int64_t N = blocks.size(0), Kb = blocks.size(1) / Q::B;
  at::Tensor out = at::empty(blocks.sizes(), blocks.options());
  const uint8_t* sp = blocks.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  parallel(0, (N + TILE - 1) / TILE, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t rows = std::min(TILE, N - i * TILE);
      const auto gguf = [&](int64_t b, int64_t off, int64_t, int64_t r) { return r * Kb * Q::B + b * Q::B + off; };
      const auto tile = [&](int64_t b, int64_t off, int64_t w, int64_t r) {
        return b * rows * Q::B + in_tile(rows, off, w, r);
      };
      relayout<Q>(rows, Kb, sp + i * TILE * Kb * Q::B, op + i * TILE * Kb * Q::B, gguf, tile);
    }
  });
  return out;
}

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

// The last tile of packed w if partial (rest rows), widened to 16 rows (zeros): the layout of a whole one.
template <class Q>
static std::vector<uint8_t> widened_last(const uint8_t* wp, int64_t N, int64_t Kb) {
  const int64_t full = N / TILE, rest = N % TILE, ts = TILE * Kb * Q::B;
  std::vector<uint8_t> last(ts, 0);
  const auto packed = [&](int64_t b, int64_t off, int64_t w, int64_t r) {
    return b * rest * Q::B + in_tile(rest, off, w, r);
  };
  const auto wide = [&](int64_t b, int64_t off, int64_t w, int64_t r) {
    return b * TILE * Q::B + in_tile(TILE, off, w, r);
  };
  relayout<Q>(rest, Kb, wp + full * ts, last.data(), packed, wide);
  return last;
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
      sp[i] = at::vec::reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, xb, Q::QK);
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
