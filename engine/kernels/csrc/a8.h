// The 8-bit products (precision levels w4a8 and w8a8): x quantized per block as llama.cpp quantizes a product's
// activations for each weight format (Q8_1 for Q4_1, Q8_0 for Q8_0 and Q5_0, Q8_K for Q4_K and Q6_K: the same scale,
// the same rounding), each block's codes times the weight's codes summed exactly in int32 (vec.h's dot4: vpdpbusd with
// VNNI, else vpmaddubsw), then scaled in fp32 as llama.cpp's vec_dot scales them (d_w d_x sum, + m s for Q4_1,
// - dmin d_x sum(m bsums) for Q4_K): a row's result the same bits whatever the rows beside it. Weights in tiles of 16
// rows as gguf_blocks.h packs them, a lane a row (Q8_0's codes 4 bytes a field: Q8_0x4).
#pragma once
#include "quant.h"

enum class Act { Q8_0, Q8_1, Q8_K };  // llama.cpp's activation blocks: 32 codes (Q8_1 with d * sum), 256 codes

static inline float fp16_rounded(float v) {  // as GGML_FP32_TO_FP16 then back (nearest even)
  return c10::detail::fp16_ieee_to_fp32_value(c10::detail::fp16_ieee_from_fp32_value(v));
}

// A block of x (32 floats; Q8_K 256) -> its codes q, the scale d a weight block's d multiplies, Q8_1's s (d * sum(q)
// in fp16) and the sums of each 16 codes; llama.cpp's x86 rounding: Q8_0 and Q8_1 q = nearest-even(x * 127 / amax),
// d = fp16(amax / 127); Q8_K q = min(127, nearest-even(x * -127 / max)), max the x of the largest |x|, d = 1 / that
// scale in fp32. A block holding a NaN or an infinity gets d = NaN (its products NaN, as fp32's would be).
// Q8_K's MIN(127, q) never binds: |x * -127 / max| <= 127 up to one rounding.
template <Act A>
static inline void quantize_x(const float* x, int8_t* q, float* d, float* s, int32_t* sums) {
  constexpr int n = A == Act::Q8_K ? 256 : 32;
  V m = maximum(load(x), neg(load(x)));
  for (int k = W; k < n; k += W) m = maximum(m, maximum(load(x + k), neg(load(x + k))));
  const float amax = largest(m);  // NaN where any x is
  const bool finite = std::isfinite(amax);
  if (!finite || amax == 0.f) {
    std::memset(q, 0, n);
    *d = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
  } else {
    float scale = 127.f / amax;  // Q8_K: -127 / max, max the first x of the largest |x|
    if constexpr (A == Act::Q8_K)
      scale = -127.f / *std::find_if(x, x + n, [&](float v) { return std::fabs(v) == amax; });
    for (int k = 0; k < n; k += W) round_bytes(mul(load(x + k), splat(scale)), q + k);
    *d = A == Act::Q8_K ? 1.f / scale : fp16_rounded(amax / 127.f);
  }
  int32_t all = 0;
  for (int g = 0; g < n / 16; ++g) {
    int32_t sum = 0;
    for (int k = 0; k < 16; ++k) sum += q[16 * g + k];
    sums[g] = sum;
    all += sum;
  }
  if constexpr (A == Act::Q8_1) *s = finite ? fp16_rounded(amax / 127.f * all) : *d;
}

struct Acts {            // x quantized, one block per weight block of each row (Kb a row), rows t * Kb on
  const int8_t* q;       // [T, Kb, QK] codes
  const float* d;        // [T, Kb] scales
  const float* s;        // [T, Kb] Q8_1's d * sum(q), fp16
  const int32_t* sums;   // [T, Kb, QK / 16] sums of 16 codes
  int64_t Kb;
};

struct A8Operands {  // one product's: out [T, N] = x [T, K] W^T + bias + residual
  Acts x;
  const float* bias;  // [N] or null
  const float* res;   // [T, N] rows rs floats apart, or null
  int64_t rs;
  float* out;         // [T, N] contiguous
  int64_t T, N, Kb;
};

// Q8_0's blocks with their codes 4 bytes a field (a row's 4 codes in one lane): the 8-bit products' packing.
struct Q8_0x4 {
  static constexpr int64_t QK = 32, B = 34;
  static constexpr int FIELDS = 9;
  static constexpr int64_t width(int j) { return j ? 4 : 2; }
};

// Each format: its packing (Blocks), its activation blocks (ACT), and block<NT, R>: acc[t][r] += tile t's block (at
// p[t]) times row r's block (x's block xb + r Kb), as llama.cpp's vec_dot adds it.
struct A8Q4_1 {  // sum(q_w q_x) with codes 0-15: d_w d_x sum + m_w s_x
  using Blocks = Q4_1;
  static constexpr Act ACT = Act::Q8_1;
  template <int NT, int R>
  A8_TARGET static inline void block(const uint8_t* const* p, const Acts& x, int64_t xb, F (&acc)[NT][R]) {
    I s[NT][R];
    UNROLL for (int t = 0; t < NT; ++t) UNROLL for (int r = 0; r < R; ++r) s[t][r] = izero();
    UNROLL for (int w = 0; w < 4; ++w) {  // code bytes 4w to 4w + 3: weights 4w.. (low nibbles), 16 + 4w.. (high)
      I lo[NT], hi[NT];
      UNROLL for (int t = 0; t < NT; ++t) {
        const I c = lanes(p[t] + in_tile(TILE, 4 + 4 * w, 4, 0));
        lo[t] = ifield(c, 0, 0x0F0F0F0F);
        hi[t] = ifield(c, 4, 0x0F0F0F0F);
      }
      UNROLL for (int r = 0; r < R; ++r) {  // short sums: 16 products a lane, each |15 * 127|: within 2^15
        const int8_t* q = x.q + (xb + r * x.Kb) * 32;
        const I a = four(q + 4 * w), b = four(q + 16 + 4 * w);
        UNROLL for (int t = 0; t < NT; ++t) s[t][r] = dot4_short(dot4_short(s[t][r], lo[t], a), hi[t], b);
      }
    }
    UNROLL for (int t = 0; t < NT; ++t) {
      const F d = halves(p[t]), m = halves(p[t] + in_tile(TILE, 2, 2, 0));
      UNROLL for (int r = 0; r < R; ++r) {
        const int64_t j = xb + r * x.Kb;
        acc[t][r] = fma(x.s[j], m, fma(mul(d, x.d[j]), ifloat(widened(s[t][r])), acc[t][r]));
      }
    }
  }
};

struct A8Q8_0 {  // sum(q_w q_x), both signed: d_w d_x sum
  using Blocks = Q8_0x4;
  static constexpr Act ACT = Act::Q8_0;
  template <int NT, int R>
  A8_TARGET static inline void block(const uint8_t* const* p, const Acts& x, int64_t xb, F (&acc)[NT][R]) {
    I s[NT][R];
    UNROLL for (int t = 0; t < NT; ++t) UNROLL for (int r = 0; r < R; ++r) s[t][r] = izero();
    UNROLL for (int w = 0; w < 8; ++w) {
      I c[NT];
      UNROLL for (int t = 0; t < NT; ++t) c[t] = lanes(p[t] + in_tile(TILE, 2 + 4 * w, 4, 0));
      UNROLL for (int r = 0; r < R; ++r) {
        const I a = four(x.q + (xb + r * x.Kb) * 32 + 4 * w);
        UNROLL for (int t = 0; t < NT; ++t) s[t][r] = dot4s(s[t][r], c[t], a);
      }
    }
    UNROLL for (int t = 0; t < NT; ++t) {
      const F d = halves(p[t]);
      UNROLL for (int r = 0; r < R; ++r) acc[t][r] = fma(mul(d, x.d[xb + r * x.Kb]), ifloat(s[t][r]), acc[t][r]);
    }
  }
};

struct A8Q5_0 {  // sum((q_w - 16) q_x) = sum(q_w q_x) - 16 sum(q_x), codes 0-31: d_w d_x that
  using Blocks = Q5_0;
  static constexpr Act ACT = Act::Q8_0;
  static inline I fifth(I h, int first) {  // qh's bits first to first + 3 -> bit 4 of each byte of a lane
    const I b = ifield(h, first, 0xF);
    return ishl(ifield(ior(ior(b, ishl(b, 7)), ior(ishl(b, 14), ishl(b, 21))), 0, 0x01010101), 4);
  }
  template <int NT, int R>
  A8_TARGET static inline void block(const uint8_t* const* p, const Acts& x, int64_t xb, F (&acc)[NT][R]) {
    I s[NT][R], h[NT];
    UNROLL for (int t = 0; t < NT; ++t) {
      h[t] = lanes(p[t] + in_tile(TILE, 2, 4, 0));
      UNROLL for (int r = 0; r < R; ++r) s[t][r] = izero();
    }
    UNROLL for (int w = 0; w < 4; ++w) {  // nibble bytes 4w to 4w + 3: weights 4w.. (low), 16 + 4w.. (high)
      I lo[NT], hi[NT];
      UNROLL for (int t = 0; t < NT; ++t) {
        const I c = lanes(p[t] + in_tile(TILE, 6 + 4 * w, 4, 0));
        lo[t] = ior(ifield(c, 0, 0x0F0F0F0F), fifth(h[t], 4 * w));
        hi[t] = ior(ifield(c, 4, 0x0F0F0F0F), fifth(h[t], 16 + 4 * w));
      }
      UNROLL for (int r = 0; r < R; ++r) {
        const int8_t* q = x.q + (xb + r * x.Kb) * 32;
        const I a = four(q + 4 * w), b = four(q + 16 + 4 * w);
        UNROLL for (int t = 0; t < NT; ++t) s[t][r] = dot4(dot4(s[t][r], lo[t], a), hi[t], b);
      }
    }
    UNROLL for (int t = 0; t < NT; ++t) {
      const F d = halves(p[t]);
      UNROLL for (int r = 0; r < R; ++r) {
        const int64_t j = xb + r * x.Kb;
        const I sum = isub(s[t][r], iall(16 * (x.sums[2 * j] + x.sums[2 * j + 1])));
        acc[t][r] = fma(mul(d, x.d[j]), ifloat(sum), acc[t][r]);
      }
    }
  }
};

struct A8Q4_K {  // per sub-block j of 32: sc_j sum(q_w q_x) and m_j bsum_j: d_w d_x sum_j(...) - dmin_w d_x sum_j(...)
  using Blocks = Q4_K;
  static constexpr Act ACT = Act::Q8_K;
  template <int NT, int R>
  A8_TARGET static inline void block(const uint8_t* const* p, const Acts& x, int64_t xb, F (&acc)[NT][R]) {
    I S[NT][R], M[NT][R], sc[3][NT];
    UNROLL for (int t = 0; t < NT; ++t) {
      UNROLL for (int f = 0; f < 3; ++f) sc[f][t] = lanes(p[t] + in_tile(TILE, 4 + 4 * f, 4, 0));
      UNROLL for (int r = 0; r < R; ++r) S[t][r] = M[t][r] = izero();
    }
    NO_UNROLL for (int j = 0; j < 8; ++j) {
      I s[NT][R];
      UNROLL for (int t = 0; t < NT; ++t) UNROLL for (int r = 0; r < R; ++r) s[t][r] = izero();
      UNROLL for (int w = 0; w < 8; ++w) {  // codes 4w to 4w + 3 of sub-block j
        I u[NT];
        UNROLL for (int t = 0; t < NT; ++t)
          u[t] = ifield(lanes(p[t] + in_tile(TILE, 16 + 32 * (j / 2) + 4 * w, 4, 0)), 4 * (j % 2), 0x0F0F0F0F);
        UNROLL for (int r = 0; r < R; ++r) {  // short sums: 16 products a lane, each |15 * 127|: within 2^15
          const I a = four(x.q + (xb + r * x.Kb) * 256 + 32 * j + 4 * w);
          UNROLL for (int t = 0; t < NT; ++t) s[t][r] = dot4_short(s[t][r], u[t], a);
        }
      }
      const int b = 8 * (j % 4);  // the bit of byte j % 4 in a word of scales (as Q4_K::weights reads them)
      UNROLL for (int t = 0; t < NT; ++t) {
        const I scj = j < 4 ? ifield(sc[0][t], b, 63)
                            : ior(ifield(sc[2][t], b, 0xF), ishl(ifield(sc[0][t], b + 6, 3), 4));
        const I mj = j < 4 ? ifield(sc[1][t], b, 63)
                           : ior(ifield(sc[2][t], b + 4, 0xF), ishl(ifield(sc[1][t], b + 6, 3), 4));
        UNROLL for (int r = 0; r < R; ++r) {
          const int32_t* bs = x.sums + (xb + r * x.Kb) * 16 + 2 * j;
          S[t][r] = iadd(S[t][r], imul(scj, widened(s[t][r])));
          M[t][r] = iadd(M[t][r], imul(mj, iall(bs[0] + bs[1])));
        }
      }
    }
    UNROLL for (int t = 0; t < NT; ++t) {
      const F d = halves(p[t]), dmin = halves(p[t] + in_tile(TILE, 2, 2, 0));
      UNROLL for (int r = 0; r < R; ++r) {
        const float dx = x.d[xb + r * x.Kb];
        acc[t][r] = fma(mul(d, dx), ifloat(S[t][r]), fma(mul(dmin, -dx), ifloat(M[t][r]), acc[t][r]));
      }
    }
  }
};

struct A8Q6_K {  // per sub-block of 16: sc (int8) (sum(q_w q_x) - 32 bsum), codes 0-63: d_w d_x sum of those
  using Blocks = Q6_K;
  static constexpr Act ACT = Act::Q8_K;
  template <int NT, int R>
  A8_TARGET static inline void block(const uint8_t* const* p, const Acts& x, int64_t xb, F (&acc)[NT][R]) {
    I S[NT][R];
    UNROLL for (int t = 0; t < NT; ++t) UNROLL for (int r = 0; r < R; ++r) S[t][r] = izero();
    NO_UNROLL for (int sb = 0; sb < 16; ++sb) {  // weights 16 sb on: 128 h + 32 s + 16 g (sb = 8 h + 2 s + g)
      const int h = sb / 8, s4 = sb / 2 % 4, g = sb % 2;
      I s[NT][R];
      UNROLL for (int t = 0; t < NT; ++t) UNROLL for (int r = 0; r < R; ++r) s[t][r] = izero();
      UNROLL for (int w = 0; w < 4; ++w) {
        const int l = 16 * g + 4 * w;
        I u[NT];
        UNROLL for (int t = 0; t < NT; ++t) {
          const I lo = lanes(p[t] + in_tile(TILE, 64 * h + 32 * (s4 % 2) + l, 4, 0)),
                  hi = lanes(p[t] + in_tile(TILE, 128 + 32 * h + l, 4, 0));
          u[t] = ior(ifield(lo, 4 * (s4 / 2), 0x0F0F0F0F), ishl(ifield(hi, 2 * s4, 0x03030303), 4));
        }
        UNROLL for (int r = 0; r < R; ++r) {
          const I a = four(x.q + (xb + r * x.Kb) * 256 + 16 * sb + 4 * w);
          UNROLL for (int t = 0; t < NT; ++t) s[t][r] = dot4(s[t][r], u[t], a);
        }
      }
      UNROLL for (int t = 0; t < NT; ++t) {
        const I sc = ibytes(p[t] + in_tile(TILE, 192 + sb, 1, 0));
        UNROLL for (int r = 0; r < R; ++r)
          S[t][r] = iadd(S[t][r], imul(sc, isub(s[t][r], iall(32 * x.sums[(xb + r * x.Kb) * 16 + sb]))));
      }
    }
    UNROLL for (int t = 0; t < NT; ++t) {
      const F d = halves(p[t] + in_tile(TILE, 208, 2, 0));
      UNROLL for (int r = 0; r < R; ++r) acc[t][r] = fma(mul(d, x.d[xb + r * x.Kb]), ifloat(S[t][r]), acc[t][r]);
    }
  }
};

// NT tiles (the first at w, its columns from 16 i on, the next `ts` bytes on) times rows t0 to t0 + R - 1 of x.
template <class A, int NT, int R>
A8_TARGET static void a8_tiles(const A8Operands& a, const uint8_t* w, int64_t ts, int64_t i, int64_t t0) {
  using Q = typename A::Blocks;
  F acc[NT][R];
  UNROLL for (int t = 0; t < NT; ++t) UNROLL for (int r = 0; r < R; ++r) acc[t][r] = zero();
  const uint8_t* p[NT];
  for (int64_t b = 0; b < a.Kb; ++b) {
    UNROLL for (int t = 0; t < NT; ++t) {  // and the same block of the next NT tiles fetched into L2 meanwhile
      p[t] = w + t * ts + b * TILE * Q::B;
      for (int64_t l = 0; l < TILE * Q::B; l += 64) __builtin_prefetch(p[t] + NT * ts + l, 0, 2);
    }
    A::template block<NT, R>(p, a.x, t0 * a.Kb + b, acc);
  }
  finish<NT, R>(a, acc, i, t0);
}

using A8Kernel = void (*)(const A8Operands&, const uint8_t*, int64_t, int64_t, int64_t);

template <class A, int R = A8_ROWS>
static A8Kernel a8_kernel_for(int r, bool wide) {  // r rows of x: A8_TILES tiles (wide) or one
  if constexpr (R > 1)
    if (r < R) return a8_kernel_for<A, R - 1>(r, wide);
  return wide ? a8_tiles<A, A8_TILES, R> : a8_tiles<A, 1, R>;
}

constexpr int64_t A8_GROUP = 8;  // tiles a thread runs against every row of x before the next (kept in cache)

// x [T, K] float32 (rows may be strided), w packed (A::Blocks) [N, K/QK * B], bias [N], residual [T, N] -> [T, N]
template <class A>
static at::Tensor a8_linear(const at::Tensor& x, const at::Tensor& w, const Opt& bias, const Opt& residual) {
  using Q = typename A::Blocks;
  check_args<Q>(x, w, bias, residual);
  const int64_t T = x.size(0), N = w.size(0), K = x.size(1), Kb = K / Q::QK, ts = TILE * Kb * Q::B;
  at::Tensor out = at::empty({T, N}, x.options()), xq = at::empty({T * K}, x.options().dtype(at::kChar)),
             xf = at::empty({2, T * Kb}, x.options()), xs = at::empty({T * K / 16}, x.options().dtype(at::kInt));
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float *dp = xf.data_ptr<float>(), *sp = dp + T * Kb;
  int32_t* bp = xs.data_ptr<int32_t>();
  parallel(0, T * Kb, grain_of(Q::QK), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)  // block i % Kb of row i / Kb
      quantize_x<A::ACT>(xp + i / Kb * x.stride(0) + i % Kb * Q::QK, qp + i * Q::QK, dp + i, sp + i,
                         bp + i * Q::QK / 16);
  });
  const A8Operands a{{qp, dp, sp, bp, Kb}, bias ? bias->data_ptr<float>() : nullptr,
                     residual ? residual->data_ptr<float>() : nullptr, residual ? residual->stride(0) : 0,
                     out.data_ptr<float>(), T, N, Kb};
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t full = N / TILE;  // whole tiles (a partial last one widened: widened_last)
  parallel(0, (N + TILE - 1) / TILE, grain_of(TILE * K * std::max<int64_t>(1, T)),
           [&](int64_t begin, int64_t end) {
    const std::vector<uint8_t> last = end > full ? widened_last<Q>(wp, N, Kb) : std::vector<uint8_t>();
    for (int64_t g = begin; g < end; g += A8_GROUP)
      for (int64_t t = 0; t < T; t += A8_ROWS) {
        const int r = std::min<int64_t>(A8_ROWS, T - t);
        for (int64_t i = g; i < std::min(end, g + A8_GROUP);) {
          if (i + A8_TILES <= std::min({end, g + A8_GROUP, full})) {
            a8_kernel_for<A>(r, true)(a, wp + i * ts, ts, i, t);
            i += A8_TILES;
          } else {
            a8_kernel_for<A>(r, false)(a, i < full ? wp + i * ts : last.data(), ts, i, t);
            ++i;
          }
        }
      }
  });
  return out;
}

// Each format's 8-bit operators (ops.h's LAB_GGUF): its packing for them, and the product.
#define LAB_A8_OPS(f, A)                                                                                  \
  at::Tensor f##_a8_pack(const at::Tensor& blocks) { return pack<A::Blocks>(blocks); }                    \
  at::Tensor f##_a8_linear(const at::Tensor& x, const at::Tensor& w, const Opt& bias, const Opt& residual) { \
    return a8_linear<A>(x, w, bias, residual);                                                            \
  }
