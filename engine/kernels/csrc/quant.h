// The vector type of the GGUF products (engine/kernels/csrc/quant.cpp), per instruction set: F holds one fp32 value of each of a
// tile's 16 output rows (a lane each); the loads fill it from a tile's fields.
#pragma once
#include "native.h"
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

constexpr int64_t TILE = 16;  // rows per tile

// Per instruction set: F, a tile's 16 rows of fp32 (a lane each), and the loads that fill it.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int ACC = 4;   // tiles in one kernel for one row of x (ACC / rows for more)
constexpr int RMAX = 8;  // rows of x in one kernel at most
struct F {
  __m512 v;
};
static inline F zero() { return {_mm512_setzero_ps()}; }
static inline F fma(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline F add(F a, F b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline F fma(float a, F b, F c) { return {_mm512_fmadd_ps(_mm512_set1_ps(a), b.v, c.v)}; }
static inline F mul(F a, float b) { return {_mm512_mul_ps(a.v, _mm512_set1_ps(b))}; }
static inline void store(F a, float* o) { _mm512_storeu_ps(o, a.v); }
static inline F halves(const uint8_t* p) {  // 16 fp16
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
static inline F bytes(const uint8_t* p) {  // 16 int8
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
struct Nibbles {  // 16 rows' 4 bytes (codes 0-7 at bits 4c): codes 0-3 in lo's low 16 bits, 4-7 in hi's
  __m512i lo, hi;
};
static inline Nibbles nibbles(const uint8_t* p) {
  const __m512i v = _mm512_loadu_si512(p);
  return {v, _mm512_srli_epi32(v, 16)};
}
static inline F nibble(const Nibbles& n, int c) {  // code c of each row, q * 2^(4 (c % 4)) in fp32
  return {_mm512_cvtepi32_ps(_mm512_and_si512(c < 4 ? n.lo : n.hi, _mm512_set1_epi32(0xF << 4 * (c % 4))))};
}
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int ACC = 2;
constexpr int RMAX = 4;
struct F {  // rows 0-7 and 8-15
  __m256 a, b;
};
static inline F zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline F fma(F a, F b, F c) { return {_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)}; }
static inline F add(F a, F b) { return {_mm256_add_ps(a.a, b.a), _mm256_add_ps(a.b, b.b)}; }
static inline F fma(float a, F b, F c) { return fma(F{_mm256_set1_ps(a), _mm256_set1_ps(a)}, b, c); }
static inline F mul(F a, float b) {
  return {_mm256_mul_ps(a.a, _mm256_set1_ps(b)), _mm256_mul_ps(a.b, _mm256_set1_ps(b))};
}
static inline void store(F a, float* o) {
  _mm256_storeu_ps(o, a.a);
  _mm256_storeu_ps(o + 8, a.b);
}
// 8 fp16 without F16C (not among the AVX2 flags): exponent and mantissa shifted into place and rebiased by a product
// with 2^112 (exact, subnormals included), inf and nan given the top exponent, the sign put back.
static inline __m256 half8(const uint8_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i em = _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x7fff)), 13);
  const __m256i top = _mm256_and_si256(_mm256_cmpgt_epi32(em, _mm256_set1_epi32(0x7bff << 13)),
                                       _mm256_set1_epi32(0x7f800000));
  const __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(em), _mm256_set1_ps(0x1p112f));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)), 16);
  return _mm256_or_ps(f, _mm256_castsi256_ps(_mm256_or_si256(top, sign)));
}
static inline F halves(const uint8_t* p) { return {half8(p), half8(p + 16)}; }
static inline __m256 byte8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline F bytes(const uint8_t* p) { return {byte8(p), byte8(p + 8)}; }
struct Nibbles {  // rows 0-7 and 8-15, codes 0-3 (lo) and 4-7 (hi) in the low 16 bits
  __m256i lo_a, lo_b, hi_a, hi_b;
};
static inline Nibbles nibbles(const uint8_t* p) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  return {a, b, _mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16)};
}
static inline F nibble(const Nibbles& n, int c) {
  const __m256i mask = _mm256_set1_epi32(0xF << 4 * (c % 4));
  return {_mm256_cvtepi32_ps(_mm256_and_si256(c < 4 ? n.lo_a : n.hi_a, mask)),
          _mm256_cvtepi32_ps(_mm256_and_si256(c < 4 ? n.lo_b : n.hi_b, mask))};
}
#else
constexpr int ACC = 1;
constexpr int RMAX = 1;
struct F {
  float v[TILE];
};
static inline F zero() { return {}; }
static inline F fma(F a, F b, F c) {
  for (int i = 0; i < TILE; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
static inline F fma(float a, F b, F c) {
  for (int i = 0; i < TILE; ++i) c.v[i] += a * b.v[i];
  return c;
}
static inline F mul(F a, float b) {
  for (int i = 0; i < TILE; ++i) a.v[i] *= b;
  return a;
}
static inline F add(F a, F b) {
  for (int i = 0; i < TILE; ++i) a.v[i] += b.v[i];
  return a;
}
static inline void store(F a, float* o) { std::copy_n(a.v, TILE, o); }
static inline F halves(const uint8_t* p) {
  F f;
  for (int i = 0; i < TILE; ++i) f.v[i] = c10::detail::fp16_ieee_to_fp32_value(p[2 * i] | p[2 * i + 1] << 8);
  return f;
}
static inline F bytes(const uint8_t* p) {
  F f;
  for (int i = 0; i < TILE; ++i) f.v[i] = static_cast<int8_t>(p[i]);
  return f;
}
using Nibbles = const uint8_t*;
static inline Nibbles nibbles(const uint8_t* p) { return p; }
static inline F nibble(const Nibbles& n, int c) {
  F f;
  for (int i = 0; i < TILE; ++i) {
    const uint32_t v = n[4 * i] | n[4 * i + 1] << 8 | n[4 * i + 2] << 16 | static_cast<uint32_t>(n[4 * i + 3]) << 24;
    f.v[i] = static_cast<float>(v >> 16 * (c / 4) & 0xFu << 4 * (c % 4));
  }
  return f;
}
#endif
