// Attention of any tokens (torch.ops.lab.token_attention, registered in ops.cpp): each against its own sequence's keys
// in a slot or a paged cache, read in place, by attention.h's kernel.
#include "attention.h"
#include "ops.h"

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
