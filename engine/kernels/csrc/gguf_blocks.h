// The GGUF block formats (Q4_1, Q8_0, Q5_0 of 32 weights; Q4_K, Q6_K super-blocks of 256) as the fused kernels
// read them: each format's fields, its weights in a tile's registers (vec.h's F: one weight of 16 rows), and the
// weights repacked once in tiles of 16 rows, each block's rows side by side (pack), so that no sum ever crosses lanes.
#pragma once
#include <cstring>
#include <vector>

#include "native.h"

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
