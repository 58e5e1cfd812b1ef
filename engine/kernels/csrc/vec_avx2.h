// vec.h for AVX2 builds: F is two 256-bit registers (rows 0-7 and 8-15), V one.
#pragma once
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#ifndef SLEEF_STATIC_LIBS
#define SLEEF_STATIC_LIBS
#endif
#include <sleef.h>

constexpr const char* ISA = "AVX2";
constexpr int ACC = 2;
constexpr int RMAX = 4;
constexpr int FMA_TILES = 1, FMA_ROWS = 6;  // an FMA kernel's tiles and rows (bf16 widened, GGUF dequantized)
constexpr int A8_TILES = 1, A8_ROWS = 4;  // an 8-bit products' kernel's (a8.h): its int32 sums in registers
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

// I: 16 int32 lanes (rows 0-7 and 8-15); dot4 by vpmaddubsw and vpmaddwd (exact while each pair of byte products
// is within int16: a8.h's codes are).
struct I {
  __m256i a, b;
};
#define A8_TARGET
template <class Op>
ALWAYS_INLINE I halves_of(I x, I y, const Op& op) { return {op(x.a, y.a), op(x.b, y.b)}; }
ALWAYS_INLINE I izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
ALWAYS_INLINE I iall(int32_t a) { return {_mm256_set1_epi32(a), _mm256_set1_epi32(a)}; }
ALWAYS_INLINE I iadd(I x, I y) { return halves_of(x, y, [](__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }); }
ALWAYS_INLINE I isub(I x, I y) { return halves_of(x, y, [](__m256i a, __m256i b) { return _mm256_sub_epi32(a, b); }); }
ALWAYS_INLINE I imul(I x, I y) {
  return halves_of(x, y, [](__m256i a, __m256i b) { return _mm256_mullo_epi32(a, b); });
}
ALWAYS_INLINE I ior(I x, I y) { return halves_of(x, y, [](__m256i a, __m256i b) { return _mm256_or_si256(a, b); }); }
ALWAYS_INLINE I ishl(I x, int n) {
  const __m128i s = _mm_cvtsi32_si128(n);
  return {_mm256_sll_epi32(x.a, s), _mm256_sll_epi32(x.b, s)};
}
ALWAYS_INLINE I ifield(I x, int shift, uint32_t mask) {  // each lane's (x >> shift) & mask
  const __m128i s = _mm_cvtsi32_si128(shift);
  const __m256i m = _mm256_set1_epi32(mask);
  return {_mm256_and_si256(_mm256_srl_epi32(x.a, s), m), _mm256_and_si256(_mm256_srl_epi32(x.b, s), m)};
}
ALWAYS_INLINE I lanes(const uint8_t* p) {  // 16 rows' 4 bytes, a lane each
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
ALWAYS_INLINE I ibytes(const uint8_t* p) {  // 16 int8, a lane each
  return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
ALWAYS_INLINE F ifloat(I x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
ALWAYS_INLINE I four(const int8_t* p) {  // 4 signed bytes, in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return iall(v);
}
ALWAYS_INLINE I dot4(I acc, I u, I s) {  // + 4 u8 x s8 a lane (each pair's sum within int16)
  const __m256i one = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(_mm256_maddubs_epi16(u.a, s.a), one)),
          _mm256_add_epi32(acc.b, _mm256_madd_epi16(_mm256_maddubs_epi16(u.b, s.b), one))};
}
ALWAYS_INLINE I dot4_short(I acc, I u, I s) {  // + 4 u8 x s8 a lane, as int16 pairs: widened makes them int32
  return {_mm256_add_epi16(acc.a, _mm256_maddubs_epi16(u.a, s.a)),
          _mm256_add_epi16(acc.b, _mm256_maddubs_epi16(u.b, s.b))};
}
ALWAYS_INLINE I widened(I acc) {  // dot4_short's int16 pairs -> a lane's int32 sum
  const __m256i one = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(acc.a, one), _mm256_madd_epi16(acc.b, one)};
}
ALWAYS_INLINE I dot4s(I acc, I w, I x) {  // + 4 s8 x s8 a lane: |w| times x signed as w
  return dot4(acc, {_mm256_abs_epi8(w.a), _mm256_abs_epi8(w.b)},
              {_mm256_sign_epi8(x.a, w.a), _mm256_sign_epi8(x.b, w.b)});
}

// V: a register of W floats.
struct V {
  __m256 v;
};
constexpr int64_t W = 8;
ALWAYS_INLINE V load(const float* p) { return {_mm256_loadu_ps(p)}; }
ALWAYS_INLINE V load(const float* p, int64_t n) {  // the first n (< W) floats, zeros after
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return {_mm256_maskload_ps(p, mask)};
}
ALWAYS_INLINE V load(const c10::BFloat16* p) {  // W bf16 widened (a shift: exact)
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16))};
}
ALWAYS_INLINE V splat(float a) { return {_mm256_set1_ps(a)}; }
ALWAYS_INLINE void store(V a, float* o) { _mm256_storeu_ps(o, a.v); }
ALWAYS_INLINE V add(V a, V b) { return {_mm256_add_ps(a.v, b.v)}; }
ALWAYS_INLINE V sub(V a, V b) { return {_mm256_sub_ps(a.v, b.v)}; }
ALWAYS_INLINE V mul(V a, V b) { return {_mm256_mul_ps(a.v, b.v)}; }
ALWAYS_INLINE V div(V a, V b) { return {_mm256_div_ps(a.v, b.v)}; }
ALWAYS_INLINE V fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c, one rounding
ALWAYS_INLINE V neg(V a) { return {_mm256_xor_ps(_mm256_set1_ps(-0.f), a.v)}; }
ALWAYS_INLINE V maximum(V a, V b) {  // NaN where either is NaN (all bits set)
  return {_mm256_or_ps(_mm256_max_ps(a.v, b.v), _mm256_cmp_ps(a.v, b.v, _CMP_UNORD_Q))};
}
ALWAYS_INLINE void round_bytes(V a, int8_t* o) {  // o [W]: the lanes rounded to the nearest integer (ties to even),
  const __m256i i = _mm256_cvtps_epi32(a.v);  // within int8
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(o), _mm_packs_epi16(w, w));
}
ALWAYS_INLINE V exp(V a) { return {Sleef_expf8_u10(a.v)}; }  // within 1 ulp
ALWAYS_INLINE V exp_le0(V a) { return exp(a); }  // for x <= 0
// Lanes reduced by op in halves (4 apart, 2, 1), as ATen's vec_reduce_all.
template <class Op>
ALWAYS_INLINE float reduce_lanes(V a, const Op& op) {
  a = op(a, V{_mm256_permute2f128_ps(a.v, a.v, 0x1)});
  a = op(a, V{_mm256_shuffle_ps(a.v, a.v, 0x4E)});
  a = op(a, V{_mm256_shuffle_ps(a.v, a.v, 0xB1)});
  return _mm256_cvtss_f32(a.v);
}
ALWAYS_INLINE float sum(V a) { return reduce_lanes(a, [](V x, V y) { return add(x, y); }); }
ALWAYS_INLINE float largest(V a) { return reduce_lanes(a, [](V x, V y) { return maximum(x, y); }); }
ALWAYS_INLINE bool any_equal(V a, V b) { return _mm256_movemask_ps(_mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ)) != 0; }

// 8 floats rounded to bf16, nearest even (a NaN -> 0xFFFF), each in its lane's low half.
ALWAYS_INLINE __m256i bf16_lanes(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)), u), 16);
  return _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), r, _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_ORD_Q)));
}
// src [n] -> dst [n] rounded to bf16, nearest even: 16 at a time (a NaN -> 0xFFFF), the rest one by one (0x7FC0).
ALWAYS_INLINE void narrow_bf16(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i lo = bf16_lanes(_mm256_loadu_ps(src + i)), hi = bf16_lanes(_mm256_loadu_ps(src + i + 8));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);  // in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

// Attention reads rows in order, a V at a time, one key after another (SPLIT_PAIRS, SUM4 false); the grouped reads
// below, never reached in this build, give the same values lane by lane.
constexpr bool SPLIT_PAIRS = false;
ALWAYS_INLINE void split_pairs(const c10::BFloat16* p, V& even, V& odd) {  // 2W bf16: evens, odds
  float e[W], o[W];
  for (int i = 0; i < W; ++i) e[i] = p[2 * i], o[i] = p[2 * i + 1];
  even = load(e), odd = load(o);
}
ALWAYS_INLINE void split_floats(const float* p, V& even, V& odd) {  // 2W floats: evens, odds
  float e[W], o[W];
  for (int i = 0; i < W; ++i) e[i] = p[2 * i], o[i] = p[2 * i + 1];
  even = load(e), odd = load(o);
}
ALWAYS_INLINE void store_merged(V even, V odd, float c, float* o) {  // o [2W] = the values merged back, times c
  float e[W], d[W];
  store(mul(even, splat(c)), e), store(mul(odd, splat(c)), d);
  for (int i = 0; i < W; ++i) o[2 * i] = e[i], o[2 * i + 1] = d[i];
}
constexpr bool SUM4 = false;
ALWAYS_INLINE void sum4(V a, V b, V c, V d, float sc, const float* bias, float* o) {  // o [4]: each sum * sc + bias
  const V v[4] = {a, b, c, d};
  for (int j = 0; j < 4; ++j) o[j] = sum(v[j]) * sc + (bias ? bias[j] : 0.f);
}
#endif
