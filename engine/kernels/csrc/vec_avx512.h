// vec.h for AVX-512 builds: F is one 512-bit register; the bf16 dot products are compiled for AVX512-BF16 (target
// attribute BF16_TARGET: run only where the CPU has it).
#pragma once
#include <immintrin.h>

constexpr const char* ISA = "AVX512";
constexpr int ACC = 4;   // a tile kernel's tiles for one row of x (ACC / rows for more): what the registers hold
constexpr int RMAX = 8;  // and its rows of x at most
constexpr int FMA_TILES = 3, FMA_ROWS = 6;  // an FMA kernel's tiles and rows (bf16 widened, GGUF dequantized)

struct F {
  __m512 v;
};
ALWAYS_INLINE F zero() { return {_mm512_setzero_ps()}; }
ALWAYS_INLINE F fma(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
ALWAYS_INLINE F add(F a, F b) { return {_mm512_add_ps(a.v, b.v)}; }
ALWAYS_INLINE F fma(float a, F b, F c) { return {_mm512_fmadd_ps(_mm512_set1_ps(a), b.v, c.v)}; }
ALWAYS_INLINE F mul(F a, float b) { return {_mm512_mul_ps(a.v, _mm512_set1_ps(b))}; }
ALWAYS_INLINE F floats16(const float* p) { return {_mm512_loadu_ps(p)}; }  // 16 floats
ALWAYS_INLINE F mul(F a, F b) { return {_mm512_mul_ps(a.v, b.v)}; }
ALWAYS_INLINE F sub(F a, F b) { return {_mm512_sub_ps(a.v, b.v)}; }
ALWAYS_INLINE F all(float a) { return {_mm512_set1_ps(a)}; }  // a in every lane
ALWAYS_INLINE void store(F a, float* o) { _mm512_storeu_ps(o, a.v); }
ALWAYS_INLINE F halves(const uint8_t* p) {  // 16 fp16
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
ALWAYS_INLINE F evens(const uint16_t* p) {  // 16 pairs of bf16: the first of each, widened (a shift)
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16))};
}
ALWAYS_INLINE F odds(const uint16_t* p) {  // and the second of each (the low half cleared)
  return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(0xFFFF0000)))};
}
ALWAYS_INLINE F bytes(const uint8_t* p) {  // 16 int8
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
struct Nibbles {  // 16 rows' 4 bytes (codes 0-7 at bits 4c): codes 0-3 in lo's low 16 bits, 4-7 in hi's
  __m512i lo, hi;
};
ALWAYS_INLINE Nibbles nibbles(const uint8_t* p) {
  const __m512i v = _mm512_loadu_si512(p);
  return {v, _mm512_srli_epi32(v, 16)};
}
ALWAYS_INLINE F nibble(const Nibbles& n, int c) {  // code c of each row, q * 2^(4 (c % 4)) in fp32
  return {_mm512_cvtepi32_ps(_mm512_and_si512(c < 4 ? n.lo : n.hi, _mm512_set1_epi32(0xF << 4 * (c % 4))))};
}
struct Words {  // 16 rows' 4 bytes, a lane each
  __m512i v;
};
ALWAYS_INLINE Words words(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
ALWAYS_INLINE F bits(Words w, int shift, uint32_t mask) {  // each row's (word >> shift) & mask (< 2^31), in fp32
  const __m512i v = _mm512_srl_epi32(w.v, _mm_cvtsi32_si128(shift));
  return {_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(mask)))};
}

#define LAB_BF16 1
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
using Pairs = __m512bh;  // 16 pairs of bf16: a pair of inputs of each of a tile's rows
BF16_TARGET ALWAYS_INLINE Pairs pairs(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
BF16_TARGET ALWAYS_INLINE Pairs pair(const uint16_t* p) {  // one pair, in every lane
  return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}
BF16_TARGET ALWAYS_INLINE F dot_pairs(F acc, Pairs x, Pairs w) { return {_mm512_dpbf16_ps(acc.v, x, w)}; }  // acc + x.w

#if defined(LAB_VNNI)  // Q4_1's integer products: compiled for AVX512-VNNI (VNNI_TARGET), run where the CPU has it
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
using I = __m512i;  // 16 int32 lanes, or 64 bytes
ALWAYS_INLINE I izero() { return _mm512_setzero_si512(); }
ALWAYS_INLINE float max_abs(F a, F b) {  // the largest |value| of a's and b's lanes
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a.v), _mm512_abs_ps(b.v)));
}
ALWAYS_INLINE I scaled_int(F a, int e) {  // a * 2^e, rounded to the nearest int32 (ties to even)
  return _mm512_cvtps_epi32(_mm512_scalef_ps(a.v, _mm512_set1_ps(e)));
}
ALWAYS_INLINE I low_byte(I x) { return _mm512_srai_epi32(_mm512_slli_epi32(x, 24), 24); }  // signed, per lane
ALWAYS_INLINE I above_byte(I x, I b) { return _mm512_srai_epi32(_mm512_sub_epi32(x, b), 8); }  // (x - b) / 2^8
ALWAYS_INLINE void store_bytes(I x, int8_t* o) {  // each lane's low byte: 16 bytes
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm512_cvtepi32_epi8(x));
}
struct Codes {  // 16 rows' 4 bytes of codes: their low nibbles, and their high ones, a byte each
  I lo, hi;
};
ALWAYS_INLINE Codes codes(const uint8_t* p) {
  const I c = _mm512_loadu_si512(p), low = _mm512_set1_epi8(0x0F);
  return {_mm512_and_si512(c, low), _mm512_and_si512(_mm512_srli_epi16(c, 4), low)};
}
ALWAYS_INLINE I four(const int8_t* p) {  // 4 signed bytes, in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
VNNI_TARGET ALWAYS_INLINE I dot4(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }  // + 4 u8 x s8 a lane
ALWAYS_INLINE F limbs(const I (&s)[4]) {  // s0 + 2^8 s1 + 2^16 (s2 + 2^8 s3) in fp32, 2^8-apart pairs exact in int32
  const I s01 = _mm512_add_epi32(s[0], _mm512_slli_epi32(s[1], 8));
  const I s23 = _mm512_add_epi32(s[2], _mm512_slli_epi32(s[3], 8));
  return {_mm512_fmadd_ps(_mm512_cvtepi32_ps(s23), _mm512_set1_ps(0x1p16f), _mm512_cvtepi32_ps(s01))};
}
#endif
