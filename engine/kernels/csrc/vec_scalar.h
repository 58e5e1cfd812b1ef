// vec.h for builds without vector instructions: F is 16 floats, each operation a loop over them.
#pragma once

constexpr const char* ISA = "scalar";
constexpr int ACC = 1;
constexpr int RMAX = 1;
constexpr int FMA_TILES = 1, FMA_ROWS = 1;  // an FMA kernel's tiles and rows (bf16 widened, GGUF dequantized)
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
