// vec.h for AVX2 builds: F is two 256-bit registers (rows 0-7 and 8-15).
#pragma once
#include <immintrin.h>

constexpr const char* ISA = "AVX2";
constexpr int ACC = 2;
constexpr int RMAX = 4;
constexpr int FMA_TILES = 1, FMA_ROWS = 6;  // an FMA kernel's tiles and rows (bf16 widened, GGUF dequantized)
struct F {  // rows 0-7 and 8-15
  __m256 a, b;
};
ALWAYS_INLINE F zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
ALWAYS_INLINE F fma(F a, F b, F c) { return {_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)}; }
ALWAYS_INLINE F add(F a, F b) { return {_mm256_add_ps(a.a, b.a), _mm256_add_ps(a.b, b.b)}; }
ALWAYS_INLINE F fma(float a, F b, F c) { return fma(F{_mm256_set1_ps(a), _mm256_set1_ps(a)}, b, c); }
ALWAYS_INLINE F mul(F a, float b) {
  return {_mm256_mul_ps(a.a, _mm256_set1_ps(b)), _mm256_mul_ps(a.b, _mm256_set1_ps(b))};
}
ALWAYS_INLINE F floats16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }  // 16 floats
ALWAYS_INLINE F mul(F a, F b) { return {_mm256_mul_ps(a.a, b.a), _mm256_mul_ps(a.b, b.b)}; }
ALWAYS_INLINE F sub(F a, F b) { return {_mm256_sub_ps(a.a, b.a), _mm256_sub_ps(a.b, b.b)}; }
ALWAYS_INLINE F all(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }  // a in every lane
ALWAYS_INLINE void store(F a, float* o) {
  _mm256_storeu_ps(o, a.a);
  _mm256_storeu_ps(o + 8, a.b);
}
// 8 fp16 to fp32 (F16C, with every AVX2 CPU)
ALWAYS_INLINE __m256 half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
ALWAYS_INLINE F halves(const uint8_t* p) { return {half8(p), half8(p + 16)}; }
ALWAYS_INLINE F evens(const uint16_t* p) {  // 16 pairs of bf16: the first of each, widened (a shift)
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
}
ALWAYS_INLINE F odds(const uint16_t* p) {  // and the second of each (the low half cleared)
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)), hi = _mm256_set1_epi32(0xFFFF0000);
  return {_mm256_castsi256_ps(_mm256_and_si256(a, hi)), _mm256_castsi256_ps(_mm256_and_si256(b, hi))};
}
ALWAYS_INLINE __m256 byte8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
ALWAYS_INLINE F bytes(const uint8_t* p) { return {byte8(p), byte8(p + 8)}; }
struct Nibbles {  // rows 0-7 and 8-15, codes 0-3 (lo) and 4-7 (hi) in the low 16 bits
  __m256i lo_a, lo_b, hi_a, hi_b;
};
ALWAYS_INLINE Nibbles nibbles(const uint8_t* p) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  return {a, b, _mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16)};
}
ALWAYS_INLINE F nibble(const Nibbles& n, int c) {
  const __m256i mask = _mm256_set1_epi32(0xF << 4 * (c % 4));
  return {_mm256_cvtepi32_ps(_mm256_and_si256(c < 4 ? n.lo_a : n.hi_a, mask)),
          _mm256_cvtepi32_ps(_mm256_and_si256(c < 4 ? n.lo_b : n.hi_b, mask))};
}
struct Words {  // rows 0-7 and 8-15's 4 bytes, a lane each
  __m256i a, b;
};
ALWAYS_INLINE Words words(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
ALWAYS_INLINE F bits(const Words& w, int shift, uint32_t mask) {  // each row's (word >> shift) & mask (< 2^31), fp32
  const __m128i s = _mm_cvtsi32_si128(shift);
  const __m256i m = _mm256_set1_epi32(mask);
  return {_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(w.a, s), m)),
          _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(w.b, s), m))};
}
