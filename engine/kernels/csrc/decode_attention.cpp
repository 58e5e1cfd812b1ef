// Attention of decode steps (torch.ops.lab.decode_attention, rotary_decode_attention; registered in ops.cpp): one
// query per sequence against its seat of a slot cache, by attention.h's kernel.
#include "attention.h"
#include "ops.h"

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
                       convert_row(key, kc + r * D, D);
                       convert_row(x + (heads + KV + h) * D, vc + r * D, D);
                       return Queries{buf, D};
                     });
  });
}
