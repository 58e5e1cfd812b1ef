// vec.h for AVX-512 builds: F and V are one 512-bit register; the bf16 dot products are compiled for AVX512-BF16
// (target attribute BF16_TARGET: run only where the CPU has it).
#pragma once
#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#ifndef SLEEF_STATIC_LIBS
#define SLEEF_STATIC_LIBS
#endif
#include <sleef.h>

constexpr const char* ISA = "AVX512";
constexpr int ACC = 4;   // a tile kernel's tiles for one row of x (ACC / rows for more): what the registers hold
constexpr int RMAX = 8;  // and its rows of x at most
constexpr int FMA_TILES = 3, FMA_ROWS = 6;  // an FMA kernel's tiles and rows (bf16 widened, GGUF dequantized)
constexpr int A8_TILES = 2, A8_ROWS = 4;  // an 8-bit products' kernel's (a8.h): its int32 sums in registers

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

// I: 16 int32 lanes, a lane a tile's row (the 8-bit products' sums: a8.h; Q4_1's fixed point: gguf_kernels.h).
// dot4 is vpdpbusd where the build has VNNI (A8_TARGET: functions calling it are compiled for it), else vpmaddubsw
// and vpmaddwd (exact while each pair of byte products is within int16: a8.h's codes are).
using I = __m512i;  // 16 int32 lanes, or 64 bytes
ALWAYS_INLINE I izero() { return _mm512_setzero_si512(); }
ALWAYS_INLINE I iall(int32_t a) { return _mm512_set1_epi32(a); }
ALWAYS_INLINE I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
ALWAYS_INLINE I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
ALWAYS_INLINE I imul(I a, I b) { return _mm512_mullo_epi32(a, b); }
ALWAYS_INLINE I ior(I a, I b) { return _mm512_or_si512(a, b); }
ALWAYS_INLINE I ishl(I a, int n) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
ALWAYS_INLINE I ifield(I a, int shift, uint32_t mask) {  // each lane's (a >> shift) & mask
  return _mm512_and_si512(_mm512_srl_epi32(a, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(mask));
}
ALWAYS_INLINE I lanes(const uint8_t* p) { return _mm512_loadu_si512(p); }  // 16 rows' 4 bytes, a lane each
ALWAYS_INLINE I ibytes(const uint8_t* p) {  // 16 int8, a lane each
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
ALWAYS_INLINE F ifloat(I a) { return {_mm512_cvtepi32_ps(a)}; }
ALWAYS_INLINE I four(const int8_t* p) {  // 4 signed bytes, in every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
#if defined(LAB_VNNI)
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define A8_TARGET VNNI_TARGET
VNNI_TARGET ALWAYS_INLINE I dot4(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }  // + 4 u8 x s8 a lane
VNNI_TARGET ALWAYS_INLINE I dot4_short(I acc, I u, I s) { return dot4(acc, u, s); }
ALWAYS_INLINE I widened(I acc) { return acc; }
#else
#define A8_TARGET
ALWAYS_INLINE I dot4(I acc, I u, I s) {  // + 4 u8 x s8 a lane (each pair's sum within int16)
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
ALWAYS_INLINE I dot4_short(I acc, I u, I s) {  // + 4 u8 x s8 a lane, as int16 pairs: widened makes them int32
  return _mm512_add_epi16(acc, _mm512_maddubs_epi16(u, s));
}
ALWAYS_INLINE I widened(I acc) { return _mm512_madd_epi16(acc, _mm512_set1_epi16(1)); }  // int16 pairs -> int32 lanes
#endif
A8_TARGET ALWAYS_INLINE I dot4s(I acc, I w, I x) {  // + 4 s8 x s8 a lane: |w| times x signed as w
  const I neg = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  return dot4(acc, _mm512_abs_epi8(w), neg);
}

#if defined(LAB_VNNI)  // Q4_1's fixed point (gguf_kernels.h): compiled for AVX512-VNNI, run where the CPU has it
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
ALWAYS_INLINE F limbs(const I (&s)[4]) {  // s0 + 2^8 s1 + 2^16 (s2 + 2^8 s3) in fp32, 2^8-apart pairs exact in int32
  const I s01 = _mm512_add_epi32(s[0], _mm512_slli_epi32(s[1], 8));
  const I s23 = _mm512_add_epi32(s[2], _mm512_slli_epi32(s[3], 8));
  return {_mm512_fmadd_ps(_mm512_cvtepi32_ps(s23), _mm512_set1_ps(0x1p16f), _mm512_cvtepi32_ps(s01))};
}
#endif

// V: a register of W floats, F itself.
using V = F;
constexpr int64_t W = 16;
ALWAYS_INLINE V load(const float* p) { return {_mm512_loadu_ps(p)}; }
ALWAYS_INLINE V load(const float* p, int64_t n) {  // the first n (< W) floats, zeros after
  return {_mm512_maskz_loadu_ps(static_cast<__mmask16>((1ULL << n) - 1), p)};
}
ALWAYS_INLINE V load(const c10::BFloat16* p) {  // W bf16 widened (a shift: exact)
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16))};
}
ALWAYS_INLINE V splat(float a) { return {_mm512_set1_ps(a)}; }
ALWAYS_INLINE V div(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
ALWAYS_INLINE V neg(V a) { return {_mm512_xor_ps(_mm512_set1_ps(-0.f), a.v)}; }
ALWAYS_INLINE V maximum(V a, V b) {  // NaN where either is NaN (all bits set)
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, b.v, _CMP_UNORD_Q);
  const __m512 ones = _mm512_castsi512_ps(_mm512_mask_set1_epi32(_mm512_setzero_si512(), nan, -1));
  return {_mm512_or_ps(_mm512_max_ps(a.v, b.v), ones)};
}
ALWAYS_INLINE void round_bytes(V a, int8_t* o) {  // o [W]: the lanes rounded to the nearest integer (ties to even),
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a.v)));  // within int8
}
ALWAYS_INLINE V exp(V a) { return {Sleef_expf16_u10(a.v)}; }  // within 1 ulp
// exp(x) for x <= 0 (a score less its row's largest), inlined: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts),
// exp(r) by Cephes' degree-6 polynomial (within about 1 ulp), times 2^n by scalef (0 below -104; NaN stays NaN).
ALWAYS_INLINE V exp_le0(V v) {
  const __m512 x = _mm512_max_ps(_mm512_set1_ps(-104.f), v.v);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return {_mm512_scalef_ps(y, n)};
}
// Lanes reduced by op in halves (8 apart, 4, 2, 1), as ATen's vec_reduce_all.
template <class Op>
ALWAYS_INLINE float reduce_lanes(V a, const Op& op) {
  a = op(a, V{_mm512_shuffle_f32x4(a.v, a.v, 0x4E)});
  a = op(a, V{_mm512_shuffle_f32x4(a.v, a.v, 0xB1)});
  a = op(a, V{_mm512_shuffle_ps(a.v, a.v, 0x4E)});
  a = op(a, V{_mm512_shuffle_ps(a.v, a.v, 0xB1)});
  return _mm512_cvtss_f32(a.v);
}
ALWAYS_INLINE float sum(V a) { return reduce_lanes(a, [](V x, V y) { return add(x, y); }); }
ALWAYS_INLINE float largest(V a) { return reduce_lanes(a, [](V x, V y) { return maximum(x, y); }); }
ALWAYS_INLINE bool any_equal(V a, V b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ) != 0; }

// 16 floats rounded to bf16, nearest even (a NaN -> 0xFFFF), each in its lane's low half.
ALWAYS_INLINE __m512i bf16_lanes(__m512 a) {
  const __m512i u = _mm512_castps_si512(a);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)), u), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), _mm512_set1_epi32(0xFFFF), r);
}
// src [n] -> dst [n] rounded to bf16, nearest even: 32 at a time (a NaN -> 0xFFFF), the rest one by one (0x7FC0).
ALWAYS_INLINE void narrow_bf16(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i lo = bf16_lanes(_mm512_loadu_ps(src + i)), hi = bf16_lanes(_mm512_loadu_ps(src + i + 16));
    const __m512i order = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
    _mm512_storeu_si512(dst + i, _mm512_permutexvar_epi64(order, _mm512_packus_epi32(lo, hi)));
  }
  for (; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

// Attention's rows of bf16 are read split: each 32 values at once, their evens in one V and their odds in the next
// (a shift and a mask, both exact, instead of a widening shuffle per 16 values).
constexpr bool SPLIT_PAIRS = true;
ALWAYS_INLINE void split_pairs(const c10::BFloat16* p, V& even, V& odd) {  // 2W bf16
  const __m512i x = _mm512_loadu_si512(p);  // lane i: value 2i in its low half, 2i + 1 in its high
  even = {_mm512_castsi512_ps(_mm512_slli_epi32(x, 16))};
  odd = {_mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
ALWAYS_INLINE void split_floats(const float* p, V& even, V& odd) {  // 2W floats, as split_pairs splits
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odds = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
  even = {_mm512_permutex2var_ps(a, evens, b)};
  odd = {_mm512_permutex2var_ps(a, odds, b)};
}
ALWAYS_INLINE void store_merged(V even, V odd, float c, float* o) {  // o [2W] = the values merged back, times c
  const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i high = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  const __m512 cv = _mm512_set1_ps(c);
  _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_permutex2var_ps(even.v, low, odd.v), cv));
  _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_permutex2var_ps(even.v, high, odd.v), cv));
}

// Four dot products of a block of keys reduced together: o [4] = [sum of a's lanes, b's, c's, d's] * sc + bias [4]
// (null: none), each by one FMA.
constexpr bool SUM4 = true;
ALWAYS_INLINE void sum4(V a, V b, V c, V d, float sc, const float* bias, float* o) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a.v, b.v, 0x44), _mm512_shuffle_f32x4(a.v, b.v, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c.v, d.v, 0x44), _mm512_shuffle_f32x4(c.v, d.v, 0xEE));
  __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));  // each 128-bit lane: one vector's four partial sums
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
  const __m512i first = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);  // of each lane
  const __m128 s = _mm512_castps512_ps128(_mm512_permutexvar_ps(first, x));
  _mm_storeu_ps(o, _mm_fmadd_ps(s, _mm_set1_ps(sc), bias ? _mm_loadu_ps(bias) : _mm_setzero_ps()));
}
#endif
