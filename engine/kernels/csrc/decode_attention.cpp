// Attention for the fused kernels (torch.ops.lab.decode_attention, rotary_decode_attention and token_attention;
// registered in ops.cpp): each (query token, kv head) reads its keys once for all query heads of its GQA group,
// masked keys never read, the next group's keys and values prefetched meanwhile. The cache holds fp32 or bf16 (read
// as fp32: exact); q, the scores, the softmax and the output are fp32; the softmax's division is applied once to each
// output row.
#include "native.h"
#include "ops.h"

// W cache values from p as fp32.
static inline Vec load(const float* p) { return Vec::loadu(p); }
static inline Vec load(const at::BFloat16* p) {
  Vec v;
  at::vec::load_to_float(p, v);
  return v;
}

// The n keys and values one query token reads under one kv head: key l at row `rows[l]` (a paged cache's block
// rows) or l (a slot cache's seat) of k and v (T: float or at::BFloat16), rows `ks` and `vs` values apart; b its
// additive bias (-inf: masked, never read; null: none).
template <typename T>
struct Keys {
  const T *k, *v;
  int64_t ks, vs;
  const int64_t* rows;
  const float* b;
  int64_t n;
  const T* key(int64_t l) const { return k + (rows ? rows[l] : l) * ks; }
  const T* value(int64_t l) const { return v + (rows ? rows[l] : l) * vs; }
  bool masked(int64_t l) const { return b && b[l] == -std::numeric_limits<float>::infinity(); }
  float bias(int64_t l) const { return b ? b[l] : 0.f; }
};

// Asks for a row of D values to be brought into L2 (locality 2): the next group's (sequence, kv head) keys and
// values are fetched while this one's are used, which the hardware prefetcher alone does not do across groups.
template <typename T>
static inline void prefetch(const T* row, int64_t D) {
  for (int64_t d = 0; d < D; d += 64 / sizeof(T)) __builtin_prefetch(row + d, 0, 2);
}

#if defined(CPU_CAPABILITY_AVX512)
// [sum of a's lanes, b's, c's, d's]: the four dot products of a block of keys, reduced together.
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));  // each 128-bit lane: one vector's four partial sums
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
  const __m512i first = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);  // of each lane
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(first, x));
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
using Reg = __m512;  // accumulators as bare registers (arrays of Vec are kept in memory)
static inline Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
#else
using Reg = Vec;
static inline Reg fma(Reg a, Reg b, Reg c) { return at::vec::fmadd(a, b, c); }
#endif

// Whether rows of NV vectors of T are read split (bf16 with AVX-512, NV even): each 32 values at once, their evens
// in one vector and their odds in the next (a shift and a mask, both exact, instead of a widening shuffle per 16
// values); queries and outputs are then split and merged to match. Otherwise in order, W values a vector.
template <int NV, typename T>
constexpr bool split() {
#if defined(CPU_CAPABILITY_AVX512)
  return std::is_same_v<T, at::BFloat16> && NV % 2 == 0;
#else
  return false;
#endif
}

// A cache row's NV vectors as fp32, in the order split<NV, T>() gives.
template <int NV, typename T>
static inline void row(const T* p, Reg (&v)[NV]) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (split<NV, T>()) {
    for (int m = 0; m < NV / 2; ++m) {
      const __m512i x = _mm512_loadu_si512(p + 32 * m);  // lane i: value 2i in its low half, 2i + 1 in its high
      v[2 * m] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      v[2 * m + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    }
    return;
  }
#endif
  for (int n = 0; n < NV; ++n) v[n] = load(p + n * W);
}

// A query row of NV vectors (fp32), in the order its keys are read.
template <int NV, typename T>
static inline void query(const float* q, Reg (&v)[NV]) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (split<NV, T>()) {
    const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odds = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    for (int m = 0; m < NV / 2; ++m) {
      const __m512 a = _mm512_loadu_ps(q + 32 * m), b = _mm512_loadu_ps(q + 32 * m + 16);
      v[2 * m] = _mm512_permutex2var_ps(a, evens, b);
      v[2 * m + 1] = _mm512_permutex2var_ps(a, odds, b);
    }
    return;
  }
#endif
  for (int n = 0; n < NV; ++n) v[n] = Vec::loadu(q + n * W);
}

// o [NV * W] = v * c, v in the order rows are read.
template <int NV, typename T>
static inline void store(const Reg (&v)[NV], float c, float* o) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (split<NV, T>()) {
    const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i high = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    const __m512 cv = _mm512_set1_ps(c);
    for (int m = 0; m < NV / 2; ++m) {
      _mm512_storeu_ps(o + 32 * m, _mm512_mul_ps(_mm512_permutex2var_ps(v[2 * m], low, v[2 * m + 1]), cv));
      _mm512_storeu_ps(o + 32 * m + 16, _mm512_mul_ps(_mm512_permutex2var_ps(v[2 * m], high, v[2 * m + 1]), cv));
    }
    return;
  }
#endif
  for (int n = 0; n < NV; ++n) (Vec(v[n]) * Vec(c)).store(o + n * W);
}

// R query rows (qs floats apart) of a GQA group against L keys, rows NV vectors long: scores into p [R, L] (-inf
// where masked), with the rows' queries in registers over all keys (split as the keys are read: each score the
// same sum of products, added in another order); the next group's keys prefetched meanwhile.
template <int NV, int R, typename T>
static void group_scores(const float* q, int64_t qs, const Keys<T>& kv, float sc, int64_t L, float* p,
                         const Keys<T>* next) {
  Reg qv[R][NV];
  for (int r = 0; r < R; ++r) query<NV, T>(q + r * qs, qv[r]);
  auto one = [&](int64_t l) {
    if (next && !next->masked(l)) prefetch(next->key(l), NV * W);
    if (kv.masked(l)) {  // the key is never read
      for (int r = 0; r < R; ++r) p[r * L + l] = kv.b[l];
      return;
    }
    Reg k[NV];
    row<NV, T>(kv.key(l), k);
    for (int r = 0; r < R; ++r) {
      Vec acc = Vec(qv[r][0]) * Vec(k[0]);
      for (int n = 1; n < NV; ++n) acc = at::vec::fmadd(Vec(qv[r][n]), Vec(k[n]), acc);
      p[r * L + l] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc) * sc + kv.bias(l);
    }
  };
  int64_t l = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; l + 4 <= L; l += 4) {  // four keys at a time, their sums reduced together
    if (kv.masked(l) || kv.masked(l + 1) || kv.masked(l + 2) || kv.masked(l + 3)) {
      for (int j = 0; j < 4; ++j) one(l + j);
      continue;
    }
    __m512 acc[R][4];
    for (int j = 0; j < 4; ++j) {
      if (next && !next->masked(l + j)) prefetch(next->key(l + j), NV * W);
      Reg k[NV];
      row<NV, T>(kv.key(l + j), k);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_mul_ps(qv[r][0], k[0]);
      for (int n = 1; n < NV; ++n)
        for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(qv[r][n], k[n], acc[r][j]);
    }
    const __m128 bias = kv.b ? _mm_loadu_ps(kv.b + l) : _mm_setzero_ps();
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(p + r * L + l,
                    _mm_fmadd_ps(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), _mm_set1_ps(sc), bias));
  }
#endif
  for (; l < L; ++l) one(l);
}

// o [R, D] = (p [R, L] (unnormalised probabilities) times the values) * inv [R], masked ones unread; the next
// group's prefetched.
template <int NV, int R, typename T>
static void group_values(const float* p, const float* inv, const Keys<T>& kv, int64_t L, float* o, int64_t D,
                         const Keys<T>* next) {
  Reg acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) acc[r][n] = Vec(0.f);
  for (int64_t l = 0; l < L; ++l) {
    if (next && !next->masked(l)) prefetch(next->value(l), NV * W);
    if (kv.masked(l)) continue;
    Reg v[NV];
    row<NV, T>(kv.value(l), v);
    for (int n = 0; n < NV; ++n)
      for (int r = 0; r < R; ++r) acc[r][n] = fma(Vec(p[r * L + l]), v[n], acc[r][n]);
  }
  for (int r = 0; r < R; ++r) store<NV, T>(acc[r], inv[r], o + r * D);
}

// A whole group of G rows, at most 4 at a time (4 x NV accumulators): scores, or (given `inv`, each row's 1 / sum of
// its probabilities) the weighted sum.
template <int NV, typename T>
static void group(const float* q, int64_t qs, const Keys<T>& kv, float sc, int64_t G, int64_t L, float* p,
                  const float* inv, float* o, int64_t D, const Keys<T>* next) {
  for (int64_t j = 0; j < G; j += 4) {
    const int64_t R = std::min<int64_t>(4, G - j);
    if (!inv) {
      auto f = R == 4 ? group_scores<NV, 4, T> : R == 3 ? group_scores<NV, 3, T> : R == 2 ? group_scores<NV, 2, T>
                                                                                          : group_scores<NV, 1, T>;
      f(q + j * qs, qs, kv, sc, L, p + j * L, j ? nullptr : next);
    } else {
      auto f = R == 4 ? group_values<NV, 4, T> : R == 3 ? group_values<NV, 3, T> : R == 2 ? group_values<NV, 2, T>
                                                                                          : group_values<NV, 1, T>;
      f(p + j * L, inv + j, kv, L, o + j * D, D, j ? nullptr : next);
    }
  }
}

// A cache row of D values as fp32: the row itself (float), else converted into `buf`.
static inline const float* as_float(const float* row, int64_t, float*) { return row; }
static inline const float* as_float(const at::BFloat16* row, int64_t D, float* buf) {
  for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(row[d]);
  return buf;
}

// The same for any head dim, one row and one key at a time.
template <typename T>
static void group_any(const float* q, int64_t qs, const Keys<T>& kv, float sc, int64_t G, int64_t L, float* p,
                      const float* inv, float* o, int64_t D, const Keys<T>*) {
  if (inv) std::fill_n(o, G * D, 0.f);
  std::vector<float> buf(D);
  for (int64_t j = 0; j < G; ++j)
    for (int64_t l = 0; l < L; ++l) {
      if (!inv)
        p[j * L + l] =
            kv.masked(l) ? kv.b[l] : dot(q + j * qs, as_float(kv.key(l), D, buf.data()), D) * sc + kv.bias(l);
      else if (!kv.masked(l))
        axpy(p[j * L + l] * inv[j], as_float(kv.value(l), D, buf.data()), o + j * D, D);
    }
}

template <typename T>
using GroupFn = decltype(&group_any<T>);

template <typename T>
static GroupFn<T> group_for(int64_t D) {  // head dims of 1 to 8 vectors (16 to 128 floats with AVX-512)
  if (D % W) return group_any<T>;
  switch (D / W) {
    case 1: return group<1, T>;
    case 2: return group<2, T>;
    case 3: return group<3, T>;
    case 4: return group<4, T>;
    case 5: return group<5, T>;
    case 6: return group<6, T>;
    case 8: return group<8, T>;
    default: return group_any<T>;
  }
}

// Products of q and the keys (and of p and the values) below which attention stays on one thread: a second one's
// start and join cost more than it saves (one sequence, 3 kv heads: 10.6 us on one thread, 17.5 on two at 50 keys;
// 29.9 against 19.5 at 300).
constexpr int64_t WORK = 4 * GRAIN;

// exp(x) for x <= 0 (a score less its row's largest), inlined (ATen's calls a library function): x = n ln2 + r
// (|r| <= ln2 / 2, ln2 in two parts), exp(r) by Cephes' degree-6 polynomial (within about 1 ulp), times 2^n by
// scalef (0 below -104; NaN stays NaN).
static inline Vec exp_le0(Vec v) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x = _mm512_max_ps(_mm512_set1_ps(-104.f), v);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
#else
  return v.exp();
#endif
}

// A row of n scores -> exp(score - their largest), in place; 1 / the sum of those.
static inline float exp_row(float* r, int64_t n) {
  const Vec m(at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, r, n));
  Vec sum(0.f);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const Vec e = exp_le0(Vec::loadu(r + i) - m);
    e.store(r + i);
    sum = sum + e;
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum);
  if (i < n) {  // the last n - i scores: their lanes alone summed
    float e[W];
    exp_le0(Vec::loadu(r + i, n - i) - m).store(e);
    std::copy_n(e, n - i, r + i);
    for (int64_t k = 0; k < n - i; ++k) s += e[k];
  }
  return 1.f / s;
}

// G query rows of one GQA group, `qs` floats apart.
struct Queries {
  const float* q;
  int64_t qs;
};

// softmax(scale * q k^T + bias) v for S queries of H heads of D (`like`: their options), [S, H, D]: the keys of
// (query s, kv head h) given by `keys(s, h)` (at most L of them), its G query rows by `queries(s, h, buf)` (buf:
// (G + 1) * D floats of the thread's own, for rows it computes).
template <typename T, typename KeysOf, typename QueriesOf>
static at::Tensor attend(const at::Tensor& like, int64_t S, int64_t H, int64_t D, int64_t KV, int64_t L, double scale,
                         const KeysOf& keys, const QueriesOf& queries) {
  const int64_t G = H / KV;
  at::Tensor out = at::empty({S, H, D}, like.options());  // every row written by its group
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const GroupFn<T> fn = group_for<T>(D);
  parallel(0, S * KV, grain_of(2 * G * L * D, WORK), [&](int64_t begin, int64_t end) {
    std::vector<float> p(G * L), inv(G), buf((G + 1) * D);  // [G, n] scores, then unnormalised probabilities;
                                                             // 1 / each row's sum; queries(s, h, buf)'s
    Keys<T> kv = keys(begin / KV, begin % KV), nk = kv;  // this group's keys, then the next's (each found once)
    for (int64_t i = begin; i < end; ++i, kv = nk) {  // group i: query i / KV, kv head i % KV
      const int64_t s = i / KV, h = i % KV;
      const Queries q = queries(s, h, buf.data());
      if (i + 1 < end) nk = keys((i + 1) / KV, (i + 1) % KV);
      const Keys<T>* next = i + 1 < end ? &nk : nullptr;
      const int64_t n = kv.n;
      float* ob = op + (s * H + h * G) * D;
      fn(q.q, q.qs, kv, sc, G, n, p.data(), nullptr, ob, D, next);
      for (int64_t j = 0; j < G; ++j) inv[j] = exp_row(p.data() + j * n, n);
      fn(q.q, q.qs, kv, sc, G, n, p.data(), inv.data(), ob, D, next);
    }
  });
  return out;
}

// The query rows of group (s, h) of q [S, H, D] (rows may be strided), read in place.
static auto queries_of(const at::Tensor& q, int64_t G) {
  const float* qp = q.data_ptr<float>();
  const int64_t s0 = q.stride(0), s1 = q.stride(1);
  return [=](int64_t s, int64_t h, float*) { return Queries{qp + s * s0 + h * G * s1, s1}; };
}

// k and v: CPU tensors of one dtype, fp32 or bf16, their last dimension contiguous.
static void check_cache(const at::Tensor& k, const at::Tensor& v, const char* op) {
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->stride(-1) == 1 &&
                    (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16),
                op, ": k and v as float32 or bfloat16 CPU tensors, their last dimension contiguous, are needed");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), op, ": k and v of one dtype are needed");
}

// f(T()) for the cache's element type T (float or at::BFloat16).
template <typename Fn>
static at::Tensor by_cache_type(const at::Tensor& k, const Fn& f) {
  return k.scalar_type() == at::kBFloat16 ? f(at::BFloat16()) : f(float());
}

// Each sequence's keys up to its last unmasked one (a shorter sequence's masked tail is not even scored) and its row
// of bias [S, L] (additive, -inf: never read), dropped where none of those keys is masked (no per-key checks then):
// found once for all kv heads. No bias: all L keys of every sequence.
static std::pair<std::vector<int64_t>, std::vector<const float*>> spans_of(const std::optional<at::Tensor>& bias,
                                                                           int64_t S, int64_t L, const char* op) {
  std::vector<int64_t> lens(S, L);
  std::vector<const float*> masks(S, nullptr);
  if (!bias) return {lens, masks};
  check(*bias, "bias");
  TORCH_CHECK(bias->dim() == 2 && bias->size(0) == S && bias->size(1) == L, op, ": bias [S, L] is needed");
  const float* bp = bias->data_ptr<float>();
  for (int64_t s = 0; s < S; ++s) {
    const float* b = bp + s * bias->stride(0);
    while (lens[s] > 1 && b[lens[s] - 1] == -std::numeric_limits<float>::infinity()) --lens[s];
    if (!std::all_of(b, b + lens[s], [](float x) { return x == 0.f; })) masks[s] = b;
  }
  return {lens, masks};
}

// The keys of (sequence s, kv head h) in k and v [S, KV, L, D] (any strides but the last: a slot cache or its view),
// the first lens[s] of them.
template <typename T>
static auto seat_keys(const at::Tensor& k, const at::Tensor& v, const std::vector<int64_t>& lens,
                      const std::vector<const float*>& masks) {
  const T *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  return [&, kp, vp](int64_t s, int64_t h) {
    return Keys<T>{kp + s * k.stride(0) + h * k.stride(1), vp + s * v.stride(0) + h * v.stride(1), k.stride(2),
                   v.stride(2), nullptr, masks[s], lens[s]};
  };
}

// One query per sequence, q [S, H, D], against k and v [S, KV, L, D] (any strides but the last: a slot cache's
// view), bias [S, L] additive (-inf: that key is never read) or none.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& bias, double scale) {
  check(q, "q");
  check_cache(k, v, "decode_attention");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 && k.size(2) > 0,
              "decode_attention: q [S, H, D], k and v [S, KV, L, D] (KV dividing H, L at least 1) are needed");
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), KV = k.size(1), L = k.size(2);
  const auto [lens, masks] = spans_of(bias, S, L, "decode_attention");
  return by_cache_type(k, [&](auto zero) {
    using T = decltype(zero);
    return attend<T>(q, S, H, D, KV, L, scale, seat_keys<T>(k, v, lens, masks), queries_of(q, H / KV));
  });
}

// A decode step's attention after its own rotary and K/V writes, each done by the group that reads them (the same
// values rotary_, write_rows_ and decode_attention give one after another; qkv is left as it was): qkv [S, (H + 2 KV)
// D] the step's projection (rows may be strided: per row, H query heads, then KV key and KV value heads, unrotated),
// cos and sin [S, D] as rotary_ takes them; sequence s decodes in seat s of k_cache and v_cache [seats, KV, P, D], its
// K and V going to flat row rows[s * KV + h] of their [-1, D] views, and attends the first `length` positions of its
// seat (bias [S, length] as decode_attention takes it, or none). [S, H, D].
at::Tensor rotary_decode_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                   const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& rows,
                                   const std::optional<at::Tensor>& bias, int64_t length, int64_t heads,
                                   double scale) {
  for (const at::Tensor* t : {&qkv, &cos, &sin}) check(*t, "rotary_decode_attention");
  check_cache(k_cache, v_cache, "rotary_decode_attention");
  TORCH_CHECK(qkv.dim() == 2 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "rotary_decode_attention: qkv [S, (H + 2 KV) D] and contiguous caches [seats, KV, P, D] of one shape "
              "are needed");
  const int64_t S = qkv.size(0), KV = k_cache.size(1), D = k_cache.size(3);
  TORCH_CHECK(KV > 0 && D > 0 && D % 2 == 0 && heads % KV == 0 && qkv.size(1) == (heads + 2 * KV) * D &&
                  S <= k_cache.size(0) && 0 < length && length <= k_cache.size(2) && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes() && cos.size(0) == S && cos.size(1) == D &&
                  rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == S * KV,
              "rotary_decode_attention: qkv [S, (H + 2 KV) D] (KV dividing H, D even), cos and sin [S, D], caches "
              "of at least S seats, rows [S * KV] int64 and 0 < length <= P are needed");
  const int64_t *rp = rows.data_ptr<int64_t>(), P = k_cache.size(2);
  for (int64_t i = 0; i < S * KV; ++i)  // group i writes only among the keys it reads: no other group's
    TORCH_CHECK(rp[i] >= i * P && rp[i] < (i + 1) * P, "rotary_decode_attention: row ", rp[i], " of sequence ",
                i / KV, ", kv head ", i % KV, " is outside its own seat's positions [", i * P, ", ", (i + 1) * P, ")");
  const auto [lens, masks] = spans_of(bias, S, length, "rotary_decode_attention");
  const int64_t G = heads / KV, qs = qkv.stride(0);
  const float *qp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  return by_cache_type(k_cache, [&](auto zero) {
    using T = decltype(zero);
    T *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
    return attend<T>(qkv, S, heads, D, KV, length, scale, seat_keys<T>(k_cache, v_cache, lens, masks),
                     [&](int64_t s, int64_t h, float* buf) {
                       const float *c = cp + s * cos.stride(0), *n = sp + s * sin.stride(0), *x = qp + s * qs;
                       for (int64_t j = 0; j < G; ++j) rotate_row(x + (h * G + j) * D, c, n, D, buf + j * D);
                       float* key = buf + G * D;
                       rotate_row(x + (heads + h) * D, c, n, D, key);  // as rotary_, then write_rows_
                       const int64_t r = rp[s * KV + h];
                       at::vec::convert(key, kc + r * D, D);
                       at::vec::convert(x + (heads + KV + h) * D, vc + r * D, D);
                       return Queries{buf, D};
                     });
  });
}

// Any tokens, each against its own sequence's keys in the cache, read in place: q [T, H, D]; k and v the cache
// [B, KV, P, D]; spans [T, 3] int64, token t's (sequence, first key, end key): it attends keys [first, end) of its
// sequence. rows: none, sequence s is seat s of a slot cache (key l at [s, h, l]); or [Sq, KV, L] int64, the row of
// k's [B * KV * P, D] view holding each key of (sequence, kv head) (a paged cache's blocks).
at::Tensor token_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& spans,
                           const std::optional<at::Tensor>& rows, double scale) {
  check(q, "q");
  check_cache(k, v, "token_attention");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes() && q.size(2) == k.size(3) && k.size(3) > 0 &&
                  k.size(1) > 0 && q.size(1) % k.size(1) == 0 && spans.dim() == 2 && spans.size(0) == q.size(0) &&
                  spans.size(1) == 3 && spans.is_contiguous() && spans.scalar_type() == at::kLong,
              "token_attention: q [T, H, D], k and v [B, KV, P, D] (KV dividing H, D at least 1), spans [T, 3] "
              "contiguous int64 are needed");
  const int64_t T = q.size(0), KV = k.size(1);
  const int64_t* sp = spans.data_ptr<int64_t>();
  const int64_t *rp = nullptr, Sq = rows ? rows->size(0) : k.size(0), L = rows ? rows->size(2) : k.size(2);
  if (rows) {
    TORCH_CHECK(rows->dim() == 3 && rows->size(1) == KV && rows->is_contiguous() &&
                    rows->scalar_type() == at::kLong && k.is_contiguous() && v.is_contiguous(),
                "token_attention: rows [Sq, KV, L] contiguous int64 and contiguous k, v are needed");
    rp = rows->data_ptr<int64_t>();
    const int64_t N = k.numel() / k.size(3);
    int64_t least = 0, top = 0;  // one vectorizable pass per call (every layer), one check after it
    for (int64_t i = 0; i < rows->numel(); ++i) least = std::min(least, rp[i]), top = std::max(top, rp[i]);
    TORCH_CHECK(least >= 0 && top < N, "token_attention: rows span [", least, ", ", top, "], beyond the cache's ", N);
  }
  int64_t most = 1;  // keys of the longest span
  for (int64_t t = 0; t < T; ++t) {
    const int64_t* s = sp + 3 * t;
    TORCH_CHECK(s[0] >= 0 && s[0] < Sq && 0 <= s[1] && s[1] < s[2] && s[2] <= L, "token_attention: span (", s[0],
                ", ", s[1], ", ", s[2], ") of token ", t, " is not within ", Sq, " sequences of ", L, " keys");
    most = std::max(most, s[2] - s[1]);
  }
  return by_cache_type(k, [&](auto zero) {
    using T = decltype(zero);
    const T *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
    const auto keys = [&](int64_t t, int64_t h) {
      const int64_t *s = sp + 3 * t, n = s[2] - s[1];
      if (rp) return Keys<T>{kp, vp, k.size(3), v.size(3), rp + (s[0] * KV + h) * L + s[1], nullptr, n};
      return Keys<T>{kp + s[0] * k.stride(0) + h * k.stride(1) + s[1] * k.stride(2),
                     vp + s[0] * v.stride(0) + h * v.stride(1) + s[1] * v.stride(2), k.stride(2), v.stride(2),
                     nullptr, nullptr, n};
    };
    return attend<T>(q, q.size(0), q.size(1), q.size(2), KV, most, scale, keys, queries_of(q, q.size(1) / KV));
  });
}
