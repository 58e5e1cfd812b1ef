// vec.h for builds without vector instructions: F is 16 floats and V 8 (ATen's scalar width), each operation a loop
// over them.
#pragma once
#if !defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)

constexpr const char* ISA = "scalar";
constexpr int ACC = 1;
constexpr int RMAX = 1;
constexpr int FMA_TILES = 1, FMA_ROWS = 1;  // an FMA kernel's tiles and rows (bf16 widened, GGUF dequantized)
constexpr int A8_TILES = 1, A8_ROWS = 1;  // an 8-bit products' kernel's (a8.h)
struct F {
  float v[TILE];
};
ALWAYS_INLINE F zero() { return {}; }
ALWAYS_INLINE F fma(F a, F b, F c) {
  for (int i = 0; i < TILE; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
ALWAYS_INLINE F fma(float a, F b, F c) {
  for (int i = 0; i < TILE; ++i) c.v[i] += a * b.v[i];
  return c;
}
ALWAYS_INLINE F mul(F a, float b) {
  for (int i = 0; i < TILE; ++i) a.v[i] *= b;
  return a;
}
ALWAYS_INLINE F add(F a, F b) {
  for (int i = 0; i < TILE; ++i) a.v[i] += b.v[i];
  return a;
}
ALWAYS_INLINE F floats16(const float* p) {
  F f;
  std::copy_n(p, TILE, f.v);
  return f;
}
ALWAYS_INLINE F mul(F a, F b) {
  for (int i = 0; i < TILE; ++i) a.v[i] *= b.v[i];
  return a;
}
ALWAYS_INLINE F sub(F a, F b) {
  for (int i = 0; i < TILE; ++i) a.v[i] -= b.v[i];
  return a;
}
ALWAYS_INLINE F all(float a) {  // a in every lane
  F f;
  std::fill_n(f.v, TILE, a);
  return f;
}
ALWAYS_INLINE void store(F a, float* o) { std::copy_n(a.v, TILE, o); }
ALWAYS_INLINE F halves(const uint8_t* p) {
  F f;
  for (int i = 0; i < TILE; ++i) f.v[i] = c10::detail::fp16_ieee_to_fp32_value(p[2 * i] | p[2 * i + 1] << 8);
  return f;
}
ALWAYS_INLINE F evens(const uint16_t* p) {  // 16 pairs of bf16: the first of each, widened
  F f;
  for (int i = 0; i < TILE; ++i) {
    const uint32_t v = static_cast<uint32_t>(p[2 * i]) << 16;
    std::memcpy(&f.v[i], &v, 4);
  }
  return f;
}
ALWAYS_INLINE F odds(const uint16_t* p) {  // and the second of each
  F f;
  for (int i = 0; i < TILE; ++i) {
    const uint32_t v = static_cast<uint32_t>(p[2 * i + 1]) << 16;
    std::memcpy(&f.v[i], &v, 4);
  }
  return f;
}
ALWAYS_INLINE F bytes(const uint8_t* p) {
  F f;
  for (int i = 0; i < TILE; ++i) f.v[i] = static_cast<int8_t>(p[i]);
  return f;
}
using Nibbles = const uint8_t*;
ALWAYS_INLINE Nibbles nibbles(const uint8_t* p) { return p; }
ALWAYS_INLINE F nibble(const Nibbles& n, int c) {
  F f;
  for (int i = 0; i < TILE; ++i) {
    const uint32_t v = n[4 * i] | n[4 * i + 1] << 8 | n[4 * i + 2] << 16 | static_cast<uint32_t>(n[4 * i + 3]) << 24;
    f.v[i] = static_cast<float>(v >> 16 * (c / 4) & 0xFu << 4 * (c % 4));
  }
  return f;
}
struct Words {  // 16 rows' 4 bytes (little-endian), one each
  uint32_t v[TILE];
};
ALWAYS_INLINE Words words(const uint8_t* p) {
  Words w;
  for (int i = 0; i < TILE; ++i)
    w.v[i] = p[4 * i] | p[4 * i + 1] << 8 | p[4 * i + 2] << 16 | static_cast<uint32_t>(p[4 * i + 3]) << 24;
  return w;
}
ALWAYS_INLINE F bits(const Words& w, int shift, uint32_t mask) {  // each row's (word >> shift) & mask, in fp32
  F f;
  for (int i = 0; i < TILE; ++i) f.v[i] = static_cast<float>(w.v[i] >> shift & mask);
  return f;
}

// V: W floats (as wide as ATen's scalar Vectorized<float>: sums in its order).
constexpr int64_t W = 8;
// I: 16 int32 lanes, each operation a loop over them.
struct I {
  int32_t v[TILE];
};
#define A8_TARGET
template <class Op>
ALWAYS_INLINE I lanewise(I x, I y, const Op& op) {
  for (int i = 0; i < TILE; ++i) x.v[i] = op(x.v[i], y.v[i]);
  return x;
}
ALWAYS_INLINE I izero() { return {}; }
ALWAYS_INLINE I iall(int32_t a) {
  I x;
  std::fill_n(x.v, TILE, a);
  return x;
}
ALWAYS_INLINE I iadd(I x, I y) { return lanewise(x, y, [](int32_t a, int32_t b) { return a + b; }); }
ALWAYS_INLINE I isub(I x, I y) { return lanewise(x, y, [](int32_t a, int32_t b) { return a - b; }); }
ALWAYS_INLINE I imul(I x, I y) { return lanewise(x, y, [](int32_t a, int32_t b) { return a * b; }); }
ALWAYS_INLINE I ior(I x, I y) { return lanewise(x, y, [](int32_t a, int32_t b) { return a | b; }); }
ALWAYS_INLINE I ishl(I x, int n) {
  for (int i = 0; i < TILE; ++i) x.v[i] = static_cast<int32_t>(static_cast<uint32_t>(x.v[i]) << n);
  return x;
}
ALWAYS_INLINE I ifield(I x, int shift, uint32_t mask) {  // each lane's (x >> shift) & mask
  for (int i = 0; i < TILE; ++i) x.v[i] = static_cast<int32_t>(static_cast<uint32_t>(x.v[i]) >> shift & mask);
  return x;
}
ALWAYS_INLINE I lanes(const uint8_t* p) {  // 16 rows' 4 bytes (little-endian), a lane each
  I x;
  std::memcpy(x.v, p, 4 * TILE);
  return x;
}
ALWAYS_INLINE I ibytes(const uint8_t* p) {  // 16 int8, a lane each
  I x;
  for (int i = 0; i < TILE; ++i) x.v[i] = static_cast<int8_t>(p[i]);
  return x;
}
ALWAYS_INLINE F ifloat(I x) {
  F f;
  for (int i = 0; i < TILE; ++i) f.v[i] = static_cast<float>(x.v[i]);
  return f;
}
ALWAYS_INLINE I four(const int8_t* p) {  // 4 signed bytes, in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return iall(v);
}
template <bool SIGNED>
ALWAYS_INLINE I dot(I acc, I w, I x) {  // + 4 byte products a lane (w's bytes unsigned or signed, x's signed)
  for (int i = 0; i < TILE; ++i)
    for (int b = 0; b < 4; ++b) {
      const int32_t u = static_cast<int32_t>(static_cast<uint32_t>(w.v[i]) >> 8 * b & 0xFF);
      acc.v[i] += (SIGNED ? static_cast<int8_t>(u) : u) * static_cast<int8_t>(x.v[i] >> 8 * b & 0xFF);
    }
  return acc;
}
ALWAYS_INLINE I dot4(I acc, I u, I s) { return dot<false>(acc, u, s); }
ALWAYS_INLINE I dot4s(I acc, I w, I x) { return dot<true>(acc, w, x); }
ALWAYS_INLINE I dot4_short(I acc, I u, I s) { return dot4(acc, u, s); }  // int32 already
ALWAYS_INLINE I widened(I acc) { return acc; }

struct V {
  float v[W];
};
ALWAYS_INLINE V load(const float* p) {
  V a;
  std::copy_n(p, W, a.v);
  return a;
}
ALWAYS_INLINE V load(const float* p, int64_t n) {  // the first n (< W) floats, zeros after
  V a{};
  std::copy_n(p, n, a.v);
  return a;
}
ALWAYS_INLINE V load(const c10::BFloat16* p) {  // W bf16 widened (exact)
  V a;
  for (int i = 0; i < W; ++i) a.v[i] = static_cast<float>(p[i]);
  return a;
}
ALWAYS_INLINE V splat(float x) {
  V a;
  std::fill_n(a.v, W, x);
  return a;
}
ALWAYS_INLINE void store(V a, float* o) { std::copy_n(a.v, W, o); }
template <class Op>
ALWAYS_INLINE V each(V a, V b, const Op& op) {  // op(a_i, b_i) in lane i
  for (int i = 0; i < W; ++i) a.v[i] = op(a.v[i], b.v[i]);
  return a;
}
ALWAYS_INLINE V add(V a, V b) { return each(a, b, [](float x, float y) { return x + y; }); }
ALWAYS_INLINE V sub(V a, V b) { return each(a, b, [](float x, float y) { return x - y; }); }
ALWAYS_INLINE V mul(V a, V b) { return each(a, b, [](float x, float y) { return x * y; }); }
ALWAYS_INLINE V div(V a, V b) { return each(a, b, [](float x, float y) { return x / y; }); }
ALWAYS_INLINE V fma(V a, V b, V c) { return add(mul(a, b), c); }  // a * b + c, two roundings
ALWAYS_INLINE V neg(V a) { return each(a, a, [](float x, float) { return -x; }); }
ALWAYS_INLINE float maximum(float x, float y) { return std::isnan(x) ? x : x > y ? x : y; }  // NaN wins
ALWAYS_INLINE V maximum(V a, V b) { return each(a, b, [](float x, float y) { return maximum(x, y); }); }
ALWAYS_INLINE void round_bytes(V a, int8_t* o) {  // o [W]: the lanes rounded to the nearest integer (ties to even)
  for (int64_t i = 0; i < W; ++i) o[i] = static_cast<int8_t>(std::nearbyint(a.v[i]));
}
ALWAYS_INLINE V exp(V a) { return each(a, a, [](float x, float) { return std::exp(x); }); }
ALWAYS_INLINE V exp_le0(V a) { return exp(a); }  // for x <= 0
ALWAYS_INLINE float sum(V a) {  // lane after lane, as ATen's vec_reduce_all
  float s = a.v[0];
  for (int i = 1; i < W; ++i) s = s + a.v[i];
  return s;
}
ALWAYS_INLINE float largest(V a) {
  float m = a.v[0];
  for (int i = 1; i < W; ++i) m = maximum(m, a.v[i]);
  return m;
}
ALWAYS_INLINE bool any_equal(V a, V b) {
  bool any = false;
  for (int i = 0; i < W; ++i) any |= a.v[i] == b.v[i];
  return any;
}
ALWAYS_INLINE void narrow_bf16(const float* src, c10::BFloat16* dst, int64_t n) {  // nearest even (a NaN: 0x7FC0)
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

// Attention reads rows in order, a V at a time, one key after another (SPLIT_PAIRS, SUM4 false); the grouped reads
// below, never reached in this build, give the same values lane by lane.
constexpr bool SPLIT_PAIRS = false;
ALWAYS_INLINE void split_pairs(const c10::BFloat16* p, V& even, V& odd) {  // 2W bf16: evens, odds
  for (int i = 0; i < W; ++i) even.v[i] = p[2 * i], odd.v[i] = p[2 * i + 1];
}
ALWAYS_INLINE void split_floats(const float* p, V& even, V& odd) {  // 2W floats: evens, odds
  for (int i = 0; i < W; ++i) even.v[i] = p[2 * i], odd.v[i] = p[2 * i + 1];
}
ALWAYS_INLINE void store_merged(V even, V odd, float c, float* o) {  // o [2W] = the values merged back, times c
  for (int i = 0; i < W; ++i) o[2 * i] = even.v[i] * c, o[2 * i + 1] = odd.v[i] * c;
}
constexpr bool SUM4 = false;
ALWAYS_INLINE void sum4(V a, V b, V c, V d, float sc, const float* bias, float* o) {  // o [4]: each sum * sc + bias
  const V v[4] = {a, b, c, d};
  for (int j = 0; j < 4; ++j) o[j] = sum(v[j]) * sc + (bias ? bias[j] : 0.f);
}
#endif
