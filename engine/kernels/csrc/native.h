// What the kernels' sources share: the vector layer (vec.h), the size below which a loop stays on one thread, the
// parallel split, the argument check, and rows of floats: reductions, dot, axpy, norm, SiLU x up, rotary.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec.h"

constexpr int64_t GRAIN = 1 << 15;  // floats of work below which a loop stays on one thread

// Items per thread at least, for items of `work` floats each: `per` floats' worth, at least one (an empty item
// counts one).
static inline int64_t grain_of(int64_t work, int64_t per = GRAIN) {
  return std::max<int64_t>(1, per / std::max<int64_t>(1, work));
}

// Tiles of a weight a thread takes at a time (a multiple of `step`): their bytes (`tile_bytes` each) within
// GROUP_BYTES, its share of L2, so that each row block of x read from cache serves them all; each thread's share of
// the tiles split into groups as even as that allows, so that no thread waits on another's last, larger group.
constexpr int64_t GROUP_BYTES = 1 << 18;
static inline int64_t tile_group(int64_t tiles, int64_t tile_bytes, int64_t step) {
  const int64_t fit = std::max<int64_t>(1, GROUP_BYTES / tile_bytes / step) * step;
  const int64_t each = (tiles + at::get_num_threads() - 1) / at::get_num_threads();  // tiles per thread
  const int64_t groups = std::max<int64_t>(1, (each + fit - 1) / fit);  // a thread's groups (one: no tiles at all)
  const int64_t even = std::max<int64_t>(1, (each + groups - 1) / groups);  // and their size
  return (even + step - 1) / step * step;
}

static inline void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, ": a float32 CPU tensor is needed");
  TORCH_CHECK(t.stride(-1) == 1, name, ": its last dimension must be contiguous");
}

// op over p [n] (n > 0) down to one float, as ATen's reduce_all: lane-wise over V after V (the last one's first
// n % W lanes alone), then across lanes by `lanes`; fewer than W floats: lane after lane.
template <class Op, class Lanes>
static inline float reduce(const float* p, int64_t n, const Op& op, const Lanes& lanes) {
  float a[W], b[W];
  if (n < W) {
    V acc = load(p, n);
    store(acc, a);
    for (int64_t i = 1; i < n; ++i) {
      std::fill_n(b, W, 0.f);
      b[0] = a[i];
      acc = op(acc, load(b));
    }
    store(acc, a);
    return a[0];
  }
  V acc = load(p);
  int64_t d = W;
  for (; d < n - n % W; d += W) acc = op(acc, load(p + d));
  if (d < n) {  // lanes [0, n - d) of op(acc, the rest), the others acc's
    store(acc, a);
    store(op(acc, load(p + d, n - d)), b);
    std::copy_n(b, n - d, a);
    acc = load(a);
  }
  return lanes(acc);
}

static inline float reduce_sum(const float* p, int64_t n) {
  return reduce(p, n, [](V x, V y) { return add(x, y); }, [](V x) { return sum(x); });
}

static inline float reduce_max(const float* p, int64_t n) {  // NaN wins
  return reduce(p, n, [](V x, V y) { return maximum(x, y); }, [](V x) { return largest(x); });
}

static inline float dot(const float* a, const float* b, int64_t n) {
  V acc = splat(0.f);
  int64_t d = 0;
  for (; d + W <= n; d += W) acc = fma(load(a + d), load(b + d), acc);
  float s = sum(acc);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

static inline void axpy(float a, const float* x, float* y, int64_t n) {  // y += a * x
  int64_t d = 0;
  for (; d + W <= n; d += W) store(fma(splat(a), load(x + d), load(y + d)), y + d);
  for (; d < n; ++d) y[d] += a * x[d];
}

// o [N] = r * rsqrt(mean(r^2) + eps) * w: one row of an RMS norm.
static inline void norm_row(const float* r, const float* w, int64_t N, float eps, float* o) {
  const float inv = 1.f / std::sqrt(dot(r, r, N) / N + eps);
  int64_t d = 0;
  for (; d + W <= N; d += W) store(mul(mul(load(r + d), splat(inv)), load(w + d)), o + d);
  for (; d < N; ++d) o[d] = r[d] * inv * w[d];
}

// o [I] = silu(g) * u: one row of SiLU x up.
static inline void silu_row(const float* g, const float* u, int64_t I, float* o) {
  int64_t d = 0;
  for (; d + W <= I; d += W) {
    const V x = load(g + d);
    store(mul(div(x, add(splat(1.f), exp(neg(x)))), load(u + d)), o + d);
  }
  for (; d < I; ++d) o[d] = g[d] / (1.f + std::exp(-g[d])) * u[d];
}

// o [D] = x * c + x with its halves swapped * s (c and s [D], s's first half negated): one row of rotary; o may be x.
static inline void rotate_row(const float* x, const float* c, const float* s, int64_t D, float* o) {
  const int64_t h = D / 2;
  int64_t d = 0;
  for (; d + W <= h; d += W) {
    const V a = load(x + d), b = load(x + h + d);
    store(fma(a, load(c + d), mul(b, load(s + d))), o + d);
    store(fma(b, load(c + h + d), mul(a, load(s + h + d))), o + h + d);
  }
  for (; d < h; ++d) {
    const float a = x[d], b = x[h + d];
    o[d] = a * c[d] + b * s[d];
    o[h + d] = b * c[h + d] + a * s[h + d];
  }
}

// dst [n] = src: copied (float), or rounded to bf16 (nearest even), as Tensor.to rounds.
static inline void convert_row(const float* src, float* dst, int64_t n) { std::copy_n(src, n, dst); }
static inline void convert_row(const float* src, c10::BFloat16* dst, int64_t n) { narrow_bf16(src, dst, n); }

// f(begin, end) over [begin, end) in contiguous chunks, one per thread (torch's number, at most one per `grain`):
// one OpenMP region, without at::parallel_for's per-call copy of thread-local state (the fused kernels need none).
template <class Fn>
static inline void parallel(int64_t begin, int64_t end, int64_t grain, const Fn& f) {
  const int64_t n = end - begin, threads = std::min<int64_t>(at::get_num_threads(), n / std::max<int64_t>(1, grain));
#ifdef _OPENMP
  if (threads > 1 && !omp_in_parallel()) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t k = omp_get_num_threads(), chunk = (n + k - 1) / k, b = begin + omp_get_thread_num() * chunk;
      if (b < end) f(b, std::min(end, b + chunk));
    }
    return;
  }
#endif
  if (n > 0) f(begin, end);
}
