// What the two small-linear kernel libraries (small_gemm.cpp in bf16, small_gemm_avx2.cpp in float32) share
// outside their arithmetic: the rows that are computed, the bias, the output and the ops' schemas.
//
// A batch whose later rows have stopped decoding still passes all of its rows (a compiled step keeps its shapes),
// with `live` (0-dim int64, optional) saying how many leading entries of x's first dimension are still decoding.
// Their rows of the flattened (M, K) input come first.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

// rows of the flattened input (m_total of them) that belong to the first `live` entries of x's dimension 0
inline int64_t live_rows(const torch::Tensor& x, int64_t m_total, const c10::optional<torch::Tensor>& live) {
  if (!live.has_value() || !live->defined() || x.dim() < 2 || x.size(0) == 0) return m_total;
  TORCH_CHECK(live->scalar_type() == at::kLong && live->numel() == 1 && live->device().is_cpu(),
              "live: a one-element int64 CPU tensor expected");
  const int64_t entries = std::clamp<int64_t>(*live->data_ptr<int64_t>(), 0, x.size(0));  // (no dispatch: a read)
  return entries * (m_total / x.size(0));
}

// the bias (N,) as contiguous float, or an undefined tensor without one
inline torch::Tensor float_bias(const c10::optional<torch::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value() || !bias->defined()) return torch::Tensor();
  TORCH_CHECK(bias->numel() == n, op, ": bias of ", n, " elements expected, got ", bias->numel());
  return bias->to(at::kFloat).contiguous();
}

inline float* data_or_null(const torch::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// the (m_all, n) output in x's dtype, its rows past the first m_live zeros (the kernel writes the others)
inline torch::Tensor output_rows(const torch::Tensor& x, int64_t m_all, int64_t m_live, int64_t n) {
  torch::Tensor out = torch::empty({m_all, n}, x.options());
  out.narrow(0, m_live, m_all - m_live).zero_();
  return out;
}

// x's shape with its last dimension n
inline std::vector<int64_t> out_shape(const torch::Tensor& x, int64_t n) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  return shape;
}

// One small_linear_q call (gguf_weights.py packs its blocks), checked and set up for both libraries' kernels. packed:
// int8 q (N/16, K, 16) with a scale per 32 (Q6_K: 16) k and column, params (N/16, K/32 or K/16, 16); or 4-bit q
// (N/16, K/2, 16) with a scale and a minimum per 32 k and column, params (N/16, K/32, 2, 16). The params are float32
// values held as int32 bits (out of reach of a model's .to(dtype)).
struct GgufCall {
  bool q8, sixteens;          // int8 q (else 4-bit); a scale per 16 k (Q6_K)
  int64_t blocks, k, groups;  // 16-column blocks, K, K/32
  const float* params;
  torch::Tensor rows, bias, out;  // x as (M, K) contiguous; the float bias or none; the output (M, N) in x's dtype
  int64_t m_live;                 // the rows the kernel computes (small_linear.h's live_rows)
};

inline GgufCall gguf_call(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& params,
                          const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& live,
                          at::ScalarType x_type) {
  constexpr int64_t kCols = 16, kGroup = 32;
  const bool q8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK((q8 || packed.scalar_type() == at::kByte) && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == kCols && packed.size(1) * (q8 ? 1 : 2) % kGroup == 0,
              "small_linear_q: packed must be contiguous int8 (N/16, K, 16) or uint8 (N/16, K/2, 16) with K a "
              "multiple of 32, got ", packed.scalar_type(), " ", packed.sizes());
  const int64_t blocks = packed.size(0), k = packed.size(1) * (q8 ? 1 : 2), groups = k / kGroup, n = blocks * kCols;
  const bool sixteens = q8 && params.numel() == blocks * groups * 2 * kCols;
  TORCH_CHECK(params.scalar_type() == at::kInt && params.is_contiguous() &&
                  params.numel() == blocks * groups * kCols * (q8 && !sixteens ? 1 : 2),
              "small_linear_q: params must be contiguous int32 bits of floats (N/16, K/32", q8 ? " or K/16" : ", 2",
              ", 16), got ", params.scalar_type(), " ", params.sizes());
  TORCH_CHECK(x.scalar_type() == x_type && x.size(-1) == k, "small_linear_q: x must be ", x_type, " with ", k,
              " features, got ", x.scalar_type(), " ", x.sizes());
  const torch::Tensor rows = x.reshape({-1, k}).contiguous();
  const int64_t m_live = live_rows(x, rows.size(0), live);
  return {q8, sixteens, blocks, k, groups, reinterpret_cast<const float*>(params.data_ptr()), rows,
          float_bias(bias, n, "small_linear_q"), output_rows(x, rows.size(0), m_live, n), m_live};
}

// The ops' schemas, the same for both kernel libraries; each defines pack_weight, small_linear and small_linear_int8.
#define DRAFTHEAD_SMALL_LINEAR_OPS(library)                                                                         \
  TORCH_LIBRARY(library, m) {                                                                                       \
    m.def("pack_weight(Tensor weight) -> Tensor");                                                                  \
    m.def("small_linear(Tensor x, Tensor packed, Tensor? bias, Tensor? live=None) -> Tensor");                      \
    m.def("small_linear_int8(Tensor x, Tensor packed, Tensor columns, Tensor? bias, Tensor? live=None) -> Tensor"); \
  }                                                                                                                 \
  TORCH_LIBRARY_IMPL(library, CPU, m) {                                                                             \
    m.impl("pack_weight", &pack_weight);                                                                            \
    m.impl("small_linear", &small_linear);                                                                          \
    m.impl("small_linear_int8", &small_linear_int8);                                                                \
  }
