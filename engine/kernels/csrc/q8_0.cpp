// Q8_0's products (quant.h) and 8-bit products (a8.h), and its rows read out (the tied embedding's lookup).
#include "a8.h"

LAB_GGUF_OPS(q8_0, Q8_0)
LAB_A8_OPS(q8_0, A8Q8_0)

// w packed (Q: Q8_0, or Q8_0x4 for the 8-bit products) [N, K/32 * 34], ids [n] int64 -> rows ids of the weight,
// [n, K] float32
template <class Q>
static at::Tensor rows_of(const at::Tensor& w, const at::Tensor& ids) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() &&
                  w.size(1) % Q::B == 0 && ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "q8_0_rows: packed w uint8 [N, K/32 * 34] and ids [n] contiguous int64 are needed");
  const int64_t N = w.size(0), Kb = w.size(1) / Q::B, n = ids.numel(), c = Q::width(1);  // c: codes a field
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "q8_0_rows: id ", ip[i], " out of range");
  at::Tensor out = at::empty({n, Kb * QK}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  parallel(0, n * Kb, grain_of(QK), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // block i % Kb of row ids[i / Kb]
      const int64_t row = ip[i / Kb], b = i % Kb, rows = std::min(TILE, N - row / TILE * TILE), r = row % TILE;
      const uint8_t* p = wp + row / TILE * TILE * Kb * Q::B + b * rows * Q::B;
      const float d = c10::detail::fp16_ieee_to_fp32_value(p[2 * r] | p[2 * r + 1] << 8);
      for (int64_t k = 0; k < QK; ++k)
        op[i * QK + k] = d * static_cast<int8_t>(p[in_tile(rows, 2 + k / c * c, c, r) + k % c]);
    }
  });
  return out;
}

at::Tensor q8_0_rows(const at::Tensor& w, const at::Tensor& ids) { return rows_of<Q8_0>(w, ids); }
at::Tensor q8_0_a8_rows(const at::Tensor& w, const at::Tensor& ids) { return rows_of<Q8_0x4>(w, ids); }
