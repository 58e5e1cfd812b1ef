// Attention's kernel for the fused operators (decode_attention.cpp, token_attention.cpp): each (query token, kv head)
// reads its keys once for all query heads of its GQA group, masked keys never read, the next group's keys and values
// prefetched meanwhile. The cache holds fp32 or bf16 (read as fp32: exact); q, the scores, the softmax and the output
// are fp32; the softmax's division is applied once to each output row. Vectors: vec.h's V, W floats.
#pragma once
#include <type_traits>

#include "native.h"

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

// Whether rows of NV vectors of T are read split (bf16 where the build reads pairs apart, SPLIT_PAIRS; NV even): each
// 2W values at once, their evens in one vector and their odds in the next; queries and outputs are then split and
// merged to match. Otherwise in order, W values a vector.
template <int NV, typename T>
constexpr bool split() {
  return SPLIT_PAIRS && std::is_same_v<T, at::BFloat16> && NV % 2 == 0;
}

// A cache row's NV vectors as fp32, in the order split<NV, T>() gives.
template <int NV, typename T>
static inline void row(const T* p, V (&v)[NV]) {
  if constexpr (split<NV, T>()) {
    for (int m = 0; m < NV / 2; ++m) split_pairs(p + 2 * W * m, v[2 * m], v[2 * m + 1]);
  } else {
    for (int n = 0; n < NV; ++n) v[n] = load(p + n * W);
  }
}

// A query row of NV vectors (fp32), in the order its keys are read.
template <int NV, typename T>
static inline void query(const float* q, V (&v)[NV]) {
  if constexpr (split<NV, T>()) {
    for (int m = 0; m < NV / 2; ++m) split_floats(q + 2 * W * m, v[2 * m], v[2 * m + 1]);
  } else {
    for (int n = 0; n < NV; ++n) v[n] = load(q + n * W);
  }
}

// o [NV * W] = v * c, v in the order rows are read.
template <int NV, typename T>
static inline void store_row(const V (&v)[NV], float c, float* o) {
  if constexpr (split<NV, T>()) {
    for (int m = 0; m < NV / 2; ++m) store_merged(v[2 * m], v[2 * m + 1], c, o + 2 * W * m);
  } else {
    for (int n = 0; n < NV; ++n) store(mul(v[n], splat(c)), o + n * W);
  }
}

// R query rows (qs floats apart) of a GQA group against L keys, rows NV vectors long: scores into p [R, L] (-inf
// where masked), with the rows' queries in registers over all keys (split as the keys are read: each score the
// same sum of products, added in another order); the next group's keys prefetched meanwhile.
template <int NV, int R, typename T>
static void group_scores(const float* q, int64_t qs, const Keys<T>& kv, float sc, int64_t L, float* p,
                         const Keys<T>* next) {
  V qv[R][NV];
  for (int r = 0; r < R; ++r) query<NV, T>(q + r * qs, qv[r]);
  auto one = [&](int64_t l) {
    if (next && !next->masked(l)) prefetch(next->key(l), NV * W);
    if (kv.masked(l)) {  // the key is never read
      for (int r = 0; r < R; ++r) p[r * L + l] = kv.b[l];
      return;
    }
    V k[NV];
    row<NV, T>(kv.key(l), k);
    for (int r = 0; r < R; ++r) {
      V acc = mul(qv[r][0], k[0]);
      for (int n = 1; n < NV; ++n) acc = fma(qv[r][n], k[n], acc);
      p[r * L + l] = sum(acc) * sc + kv.bias(l);
    }
  };
  int64_t l = 0;
  if constexpr (SUM4)
    for (; l + 4 <= L; l += 4) {  // four keys at a time, their sums reduced together
      if (kv.masked(l) || kv.masked(l + 1) || kv.masked(l + 2) || kv.masked(l + 3)) {
        for (int j = 0; j < 4; ++j) one(l + j);
        continue;
      }
      V acc[R][4];
      for (int j = 0; j < 4; ++j) {
        if (next && !next->masked(l + j)) prefetch(next->key(l + j), NV * W);
        V k[NV];
        row<NV, T>(kv.key(l + j), k);
        for (int r = 0; r < R; ++r) acc[r][j] = mul(qv[r][0], k[0]);
        for (int n = 1; n < NV; ++n)
          for (int r = 0; r < R; ++r) acc[r][j] = fma(qv[r][n], k[n], acc[r][j]);
      }
      for (int r = 0; r < R; ++r)
        sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], sc, kv.b ? kv.b + l : nullptr, p + r * L + l);
    }
  for (; l < L; ++l) one(l);
}

// o [R, D] = (p [R, L] (unnormalised probabilities) times the values) * inv [R], masked ones unread; the next
// group's prefetched.
template <int NV, int R, typename T>
static void group_values(const float* p, const float* inv, const Keys<T>& kv, int64_t L, float* o, int64_t D,
                         const Keys<T>* next) {
  V acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) acc[r][n] = splat(0.f);
  for (int64_t l = 0; l < L; ++l) {
    if (next && !next->masked(l)) prefetch(next->value(l), NV * W);
    if (kv.masked(l)) continue;
    V v[NV];
    row<NV, T>(kv.value(l), v);
    for (int n = 0; n < NV; ++n)
      for (int r = 0; r < R; ++r) acc[r][n] = fma(splat(p[r * L + l]), v[n], acc[r][n]);
  }
  for (int r = 0; r < R; ++r) store_row<NV, T>(acc[r], inv[r], o + r * D);
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

// A row of n scores -> exp(score - their largest), in place; 1 / the sum of those.
static inline float exp_row(float* r, int64_t n) {
  const V m = splat(reduce_max(r, n));
  V total = splat(0.f);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const V e = exp_le0(sub(load(r + i), m));
    store(e, r + i);
    total = add(total, e);
  }
  float s = sum(total);
  if (i < n) {  // the last n - i scores: their lanes alone summed
    float e[W];
    store(exp_le0(sub(load(r + i, n - i), m)), e);
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
