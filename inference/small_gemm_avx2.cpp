// y = x · Wᵀ (+ bias) in float32 for a few rows of x, with AVX2 + FMA: small_gemm.cpp's idea for CPUs without
// AVX512-BF16, where float32 is the fast dtype.
//
// A decoding step or a tree verification multiplies a handful of rows by every weight of the model, so it is
// bound by reading the weights once. PyTorch's float32 linear (MKL) does not stream them at that size on an AVX2
// EPYC (SmolLM2-135M's lm_head at 8 rows: ~2.5 GB/s). The weight is packed once into 16-column blocks, each
// stored k by k (16 floats, two vectors, per k), so one pass streams a block front to back while 4 rows'
// accumulators stay in registers; more rows take the same 256-k piece of the block again from L1. Each output
// element is summed over k in order whatever the number of rows, so a row's result does not depend on what else
// is in the batch.
//
// Layout of `packed`: (N/16, K, 16) float; element [b, k, c] = W[16 b + c, k].

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;   // output columns per block (two vectors of 8 floats)
constexpr int kMaxRows = 4;      // rows accumulated at once (2 x 4 = 8 accumulator registers; more spill)
constexpr int64_t kChunk = 256;  // k per pass: a block's 256 x 16 floats (16 KB) stay in L1 for every row group

// out (rows, 16) (+)= a (rows, chunk) · one packed block's chunk (chunk, 16); `first`: the chunk starts the sum
template <int kRows>
void block_dot(const float* a, int64_t lda, const float* b, int64_t chunk, bool first, float* out, int64_t ldo) {
  __m256 c[kRows][2];
  for (int m = 0; m < kRows; ++m) {
    c[m][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + m * ldo);
    c[m][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + m * ldo + 8);
  }
  for (int64_t i = 0; i < chunk; ++i) {
    // the weights one piece ahead (the block's next piece, or the next block's first: they follow in memory), so
    // that they arrive while this piece is multiplied for every row group (no fault past the end: a hint)
    _mm_prefetch(reinterpret_cast<const char*>(b + (i + kChunk) * kBlock), _MM_HINT_T0);
    const __m256 b0 = _mm256_loadu_ps(b + i * kBlock), b1 = _mm256_loadu_ps(b + i * kBlock + 8);
#pragma GCC unroll 4
    for (int m = 0; m < kRows; ++m) {
      const __m256 am = _mm256_broadcast_ss(a + m * lda + i);
      c[m][0] = _mm256_fmadd_ps(am, b0, c[m][0]);
      c[m][1] = _mm256_fmadd_ps(am, b1, c[m][1]);
    }
  }
  for (int m = 0; m < kRows; ++m) {
    _mm256_storeu_ps(out + m * ldo, c[m][0]);
    _mm256_storeu_ps(out + m * ldo + 8, c[m][1]);
  }
}

using BlockDot = void (*)(const float*, int64_t, const float*, int64_t, bool, float*, int64_t);
const BlockDot kBlockDot[kMaxRows + 1] = {nullptr, block_dot<1>, block_dot<2>, block_dot<3>, block_dot<4>};

}  // namespace

// (N, K) float -> (N/16, K, 16): N a multiple of 16
torch::Tensor pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_weight: a 2-D float32 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kBlock == 0, "pack_weight: out_features must be a multiple of 16, got ", weight.sizes());
  return weight.reshape({n / kBlock, kBlock, k}).permute({0, 2, 1}).contiguous();
}

// x (..., K) float, packed (N/16, K, 16), bias (N,) or none -> (..., N) float
torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& packed,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(2) == kBlock &&
                  packed.is_contiguous(),
              "small_linear: packed weight must be contiguous float (N/16, K, 16), got ", packed.sizes());
  const int64_t k = x.size(-1), n = packed.size(0) * kBlock;
  TORCH_CHECK(x.scalar_type() == at::kFloat && k == packed.size(1), "small_linear: x must be float32 with ",
              packed.size(1), " features, got ", x.scalar_type(), " ", x.sizes());
  const torch::Tensor rows = x.reshape({-1, k}).contiguous();
  const int64_t m_total = rows.size(0);
  torch::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "small_linear: bias of ", n, " elements expected, got ", bias->numel());
    bias_f = bias->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  torch::Tensor out = torch::empty({m_total, n}, x.options());
  const float* a = rows.data_ptr<float>();
  const float* b = packed.data_ptr<float>();
  const float* bias_p = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t first, int64_t last) {
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t col = blk * kBlock;
      const float* block = b + blk * k * kBlock;
      for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
        const int64_t chunk = std::min(kChunk, k - k0);
        for (int64_t m0 = 0; m0 < m_total; m0 += kMaxRows) {
          const int rows_now = static_cast<int>(std::min<int64_t>(kMaxRows, m_total - m0));
          kBlockDot[rows_now](a + m0 * k + k0, k, block + k0 * kBlock, chunk, k0 == 0, y + m0 * n + col, n);
        }
      }
      if (bias_p != nullptr)
        for (int64_t m = 0; m < m_total; ++m)
          for (int64_t c = 0; c < kBlock; c += 8)
            _mm256_storeu_ps(y + m * n + col + c, _mm256_add_ps(_mm256_loadu_ps(y + m * n + col + c),
                                                               _mm256_loadu_ps(bias_p + col + c)));
    }
  });
  return out.view(shape);
}

TORCH_LIBRARY(drafthead_avx2, m) {
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("small_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(drafthead_avx2, CPU, m) {
  m.impl("pack_weight", &pack_weight);
  m.impl("small_linear", &small_linear);
}
