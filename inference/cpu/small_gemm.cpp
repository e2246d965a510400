// y = x · Wᵀ (+ bias) in bf16 for a few rows of x, with AVX512-BF16 dot products (vdpbf16ps).
//
// Decoding and tree verification multiply 1-16 rows by every weight of the model, so a step is bound by reading
// the weights once. The weight is packed once into 32-column blocks whose k-pairs are interleaved (the operand
// layout of vdpbf16ps), so one pass streams each block front to back while the rows' accumulators stay in
// registers. Each output element is summed over k in the same order whatever the number of rows, so a row's
// result does not depend on what else is in the batch.
//
// Layout of `packed`: (N/32, K/2, 32, 2) bf16; element [b, p, c, j] = W[32 b + c, 2 p + j].
//
// Built with AMX (-mamx-tile -mamx-bf16, on a CPU that has it), small_linear multiplies with AMX tiles instead
// wherever K is a multiple of 32: the same packed blocks load as tiles of 16 k-pairs x 16 columns, and 16 rows cost
// one pass over the weights (with vdpbf16ps, 16 rows cost twice and a half one row's time). Every row count takes
// that path, so a row's sums still do not depend on the others'.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16.h"
#include "small_linear.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define DRAFTHEAD_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kBlock = 32;   // output columns per block (two vectors of 16 floats)
constexpr int kMaxRows = 8;      // rows accumulated at once (2 x 8 = 16 accumulator registers)

// out[0, 32) = bf16 of (lo, hi) + bias[0, 32) (bias may be null): one row of a 32-column block
inline void store_block_row(__m512 lo, __m512 hi, const float* bias, uint16_t* out) {
  if (bias != nullptr) {
    lo = _mm512_add_ps(lo, _mm512_loadu_ps(bias));
    hi = _mm512_add_ps(hi, _mm512_loadu_ps(bias + 16));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(lo));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), (__m256i)_mm512_cvtneps_pbh(hi));
}

// The two products of a packed block, one loop (block_dot): bf16 pairs into floats (vdpbf16ps), or u8 x int8 quads
// into int32s (vpdpbusd, the int8 weights below); `kPack` k's share one 32-bit lane of x and of the weights.
template <typename InT, typename WeightT, typename SumT, int64_t kPackT>
struct PackedDot {
  using In = InT;
  using Weight = WeightT;
  using Sum = SumT;
  static constexpr int64_t kPack = kPackT;
};

struct Bf16Dot : PackedDot<uint16_t, uint16_t, float, 2> {
  using Vec = __m512;
  static Vec dot(Vec c, __m512i a, __m512i b) { return _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b); }
};

struct Int8Dot : PackedDot<uint8_t, int8_t, int32_t, 4> {
  using Vec = __m512i;
  static Vec dot(Vec c, __m512i a, __m512i b) { return _mm512_dpbusd_epi32(c, a, b); }
};

// acc (rows, 32) = a (rows, K) · one packed block (K/kPack, 32, kPack); with `next`, the same lines of the next
// block are fetched into L2 meanwhile
template <typename T, int kRows>
void block_dot(const typename T::In* a, int64_t lda, const typename T::Weight* b, int64_t steps,
               typename T::Sum* acc, const typename T::Weight* next) {
  typename T::Vec c[kRows][2];
  for (int m = 0; m < kRows; ++m) c[m][0] = c[m][1] = (typename T::Vec)_mm512_setzero_si512();
  for (int64_t p = 0; p < steps; ++p) {
    const typename T::Weight* bp = b + p * T::kPack * kBlock;
    if (next != nullptr) {  // a step reads two cache lines
      _mm_prefetch(reinterpret_cast<const char*>(next + p * T::kPack * kBlock), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + p * T::kPack * kBlock + T::kPack * kBlock / 2), _MM_HINT_T1);
    }
    const __m512i b0 = _mm512_loadu_si512(bp), b1 = _mm512_loadu_si512(bp + T::kPack * kBlock / 2);
#pragma GCC unroll 8
    for (int m = 0; m < kRows; ++m) {
      const __m512i am = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + m * lda + T::kPack * p));
      c[m][0] = T::dot(c[m][0], am, b0);
      c[m][1] = T::dot(c[m][1], am, b1);
    }
  }
  for (int m = 0; m < kRows; ++m) {
    _mm512_storeu_si512(acc + m * kBlock, (__m512i)c[m][0]);  // (the bits of floats or int32s)
    _mm512_storeu_si512(acc + m * kBlock + 16, (__m512i)c[m][1]);
  }
}

// a (m_total, K) · packed (N/32, K/kPack, 32, kPack)ᵀ, block by block; finish(acc, row, col) turns each row's 32
// sums of the block at column `col` into outputs. Past 8 rows, the groups after the first compute from cache: a
// last group of a full 8 rows fetches the next block meanwhile, so that the memory stream goes on while it computes
// (a shorter group ends too soon, and fetching from it measured slower).
template <typename T, typename Finish>
void multiply(const typename T::In* a, int64_t m_total, int64_t k, const typename T::Weight* packed, int64_t blocks,
              Finish finish) {
  using BlockDot = void (*)(const typename T::In*, int64_t, const typename T::Weight*, int64_t, typename T::Sum*,
                            const typename T::Weight*);
  static const BlockDot kBlockDot[kMaxRows + 1] = {nullptr,         block_dot<T, 1>, block_dot<T, 2>,
                                                   block_dot<T, 3>, block_dot<T, 4>, block_dot<T, 5>,
                                                   block_dot<T, 6>, block_dot<T, 7>, block_dot<T, 8>};
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    alignas(64) typename T::Sum acc[kMaxRows * kBlock];
    for (int64_t blk = first; blk < last; ++blk) {
      for (int64_t m0 = 0; m0 < m_total; m0 += kMaxRows) {
        const int rows_now = static_cast<int>(std::min<int64_t>(kMaxRows, m_total - m0));
        const bool fetch = m0 > 0 && m0 + kMaxRows == m_total && blk + 1 < last;
        kBlockDot[rows_now](a + m0 * k, k, packed + blk * k * kBlock, k / T::kPack, acc,
                            fetch ? packed + (blk + 1) * k * kBlock : nullptr);
        for (int m = 0; m < rows_now; ++m) finish(acc + m * kBlock, m0 + m, blk * kBlock);
      }
    }
  });
}

#ifdef DRAFTHEAD_AMX
// Linux gives a process AMX's tile registers only once it asks for them (arch_prctl ARCH_REQ_XCOMP_PERM), for all
// of its threads; false where the kernel refuses (then the vdpbf16ps path runs)
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

struct TileConfig {  // ldtilecfg's 64-byte operand, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0, 1: a block's two 16-column halves of sums (rows x 16 floats); 2: 32 k's of x (rows x 32 bf16);
// 3, 4: the two halves of 16 k-pairs of the block (16 x 16 pairs); configured per thread
void configure_tiles(int rows) {
  TileConfig config;
  for (int t = 0; t < 5; ++t) {
    config.rows[t] = t < 3 ? rows : 16;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

// multiply()'s contract with AMX tiles, for K a multiple of 32: up to 16 rows a pass over the weights
template <typename Finish>
void multiply_amx(const uint16_t* a, int64_t m_total, int64_t k, const uint16_t* packed, int64_t blocks,
                  Finish finish) {
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    alignas(64) float acc[16 * kBlock];
    // full passes of 16 rows first, then one of the rows left (one tile configuration each)
    const int64_t full = m_total / 16 * 16;
    const int64_t passes[2][2] = {{0, full}, {full, m_total}};
    for (const auto& [m_first, m_last] : passes) {
      if (m_first == m_last) continue;
      const int rows = static_cast<int>(std::min<int64_t>(16, m_last - m_first));
      configure_tiles(rows);
      for (int64_t blk = first; blk < last; ++blk) {
        const uint16_t* b = packed + blk * k * kBlock;
        for (int64_t m0 = m_first; m0 < m_last; m0 += 16) {
          _tile_zero(0);
          _tile_zero(1);
          for (int64_t k0 = 0; k0 < k; k0 += 32) {
            _tile_loadd(2, a + m0 * k + k0, k * 2);
            _tile_loadd(3, b + k0 * kBlock, 4 * kBlock);  // 16 k-pairs of columns 0-15, 128 bytes apart
            _tile_loadd(4, b + k0 * kBlock + kBlock, 4 * kBlock);  // of columns 16-31
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
          }
          _tile_stored(0, acc, 4 * kBlock);
          _tile_stored(1, acc + 16, 4 * kBlock);
          for (int m = 0; m < rows; ++m) finish(acc + m * kBlock, m0 + m, blk * kBlock);
        }
      }
      _tile_release();
    }
  });
}
#endif

// ---- int8 weights (a draft's copy): y = x · Wᵀ with W quantised per output column to int8 and each row of x
// quantised on the fly to int8 (per row), multiplied with AVX512-VNNI (vpdpbusd: 64 byte products a vector).
// Half the bytes of bf16 weights to stream, and half the instructions: a drafting step at a few rows costs about
// half as much. Not exact (about 4 % of a small model's greedy choices change): for drafts only, which the
// full-precision target verifies.
//
// Layout of `packed8`: (N/32, K/4, 32, 4) int8; element [b, q, c, j] = Wq[32 b + c, 4 q + j]. Row m of x becomes
// u8 = round(x / s_m) + 128 with s_m = max|x_m| / 127, so Σ_k x·W ≈ s_m · w_c · (Σ_k u8·Wq − 128 Σ_k Wq), w_c the
// column's scale; `columns` (2, N) float holds w_c and 128 Σ_k Wq[c, k].

void check_packed(const torch::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == kBlock &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "small_linear: packed weight must be contiguous bf16 (N/32, K/2, 32, 2), got ", packed.sizes());
}

}  // namespace

// (N, K) bf16 -> (N/32, K/2, 32, 2): N a multiple of 32, K even
torch::Tensor pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_weight: a 2-D bf16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kBlock == 0 && k % 2 == 0, "pack_weight: out_features must be a multiple of 32 and ",
              "in_features even, got ", weight.sizes());
  return weight.reshape({n / kBlock, kBlock, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x (..., K) bf16, packed (N/32, K/2, 32, 2), bias (N,) or none -> (..., N) bf16; with `live`, only the rows of x's
// first `live` entries are multiplied, the others are zeros (small_linear.h)
torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& packed,
                           const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& live) {
  check_packed(packed);
  const int64_t k = x.size(-1), n = packed.size(0) * kBlock, pairs = packed.size(1);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && k == 2 * pairs, "small_linear: x must be bf16 with ", 2 * pairs,
              " features, got ", x.scalar_type(), " ", x.sizes());
  const torch::Tensor rows = x.reshape({-1, k}).contiguous();
  const int64_t m_total = live_rows(x, rows.size(0), live);
  const torch::Tensor bias_f = float_bias(bias, n, "small_linear");
  torch::Tensor out = output_rows(x, rows.size(0), m_total, n);
  const float* bias_p = data_or_null(bias_f);
  uint16_t* y = reinterpret_cast<uint16_t*>(out.data_ptr());
  const auto finish = [&](const float* acc, int64_t m, int64_t col) {
    store_block_row(_mm512_loadu_ps(acc), _mm512_loadu_ps(acc + 16), bias_p != nullptr ? bias_p + col : nullptr,
                    y + m * n + col);
  };
  const uint16_t* a = reinterpret_cast<const uint16_t*>(rows.data_ptr());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
#ifdef DRAFTHEAD_AMX
  if (k % 32 == 0 && amx_permitted()) {
    if (m_total > 0) multiply_amx(a, m_total, k, w, packed.size(0), finish);
    return out.view(out_shape(x, n));
  }
#endif
  multiply<Bf16Dot>(a, m_total, k, w, packed.size(0), finish);
  return out.view(out_shape(x, n));
}

// x (..., K) bf16, packed8 and columns (small_gemm.py's quantize_weight_int8 + pack_int8), bias (N,) or none ->
// (..., N) bf16; `live` as small_linear's
torch::Tensor small_linear_int8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& columns,
                                const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& live) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == kBlock &&
                  packed.size(3) == 4 && packed.is_contiguous(),
              "small_linear_int8: packed weight must be contiguous int8 (N/32, K/4, 32, 4), got ", packed.sizes());
  const int64_t k = x.size(-1), n = packed.size(0) * kBlock, quads = packed.size(1);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && k == 4 * quads && k % 16 == 0, "small_linear_int8: x must be bf16 with ",
              4 * quads, " features, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(columns.scalar_type() == at::kFloat && columns.dim() == 2 && columns.size(0) == 2 &&
                  columns.size(1) == n && columns.stride(1) == 1,
              "small_linear_int8: columns must be float (2, ", n, ") with contiguous rows");
  const torch::Tensor rows = x.reshape({-1, k}).contiguous();
  const int64_t m_total = live_rows(x, rows.size(0), live);
  const torch::Tensor bias_f = float_bias(bias, n, "small_linear_int8");
  // each row of x as u8 (round(x / s) + 128) and its scale s (a plain loop: a few rows, no ATen op overhead)
  thread_local std::vector<uint8_t> xq;  // kept between calls: no allocation per call
  thread_local std::vector<float> row_scale;
  xq.resize(static_cast<size_t>(m_total * k));
  row_scale.resize(static_cast<size_t>(m_total));
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(rows.data_ptr());
  for (int64_t m = 0; m < m_total; ++m) {
    const uint16_t* src = xb + m * k;
    __m512 most = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) most = _mm512_max_ps(most, _mm512_abs_ps(bf16x16_to_float(src + i)));
    const float scale = std::max(_mm512_reduce_max_ps(most), 1e-30f) / 127.0f;
    row_scale[m] = scale;
    const __m512 divisor = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < k; i += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(bf16x16_to_float(src + i), divisor),
                                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m512i u = _mm512_add_epi32(_mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)),
                                                          _mm512_set1_epi32(-127)), _mm512_set1_epi32(128));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq.data() + m * k + i), _mm512_cvtepi32_epi8(u));
    }
  }
  torch::Tensor out = output_rows(x, rows.size(0), m_total, n);
  const float* sa = row_scale.data();
  const float* col_scale = columns.data_ptr<float>();
  const float* col_comp = col_scale + columns.stride(0);
  const float* bias_p = data_or_null(bias_f);
  uint16_t* y = reinterpret_cast<uint16_t*>(out.data_ptr());
  multiply<Int8Dot>(xq.data(), m_total, k, packed.data_ptr<int8_t>(), packed.size(0),
                    [&](const int32_t* acc, int64_t m, int64_t col) {
                      const __m512 s = _mm512_set1_ps(sa[m]);
                      const __m512 raw0 = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc)),
                                                        _mm512_loadu_ps(col_comp + col));
                      const __m512 raw1 = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc + 16)),
                                                        _mm512_loadu_ps(col_comp + col + 16));
                      store_block_row(_mm512_mul_ps(raw0, _mm512_mul_ps(_mm512_loadu_ps(col_scale + col), s)),
                                      _mm512_mul_ps(raw1, _mm512_mul_ps(_mm512_loadu_ps(col_scale + col + 16), s)),
                                      bias_p != nullptr ? bias_p + col : nullptr, y + m * n + col);
                    });
  return out.view(out_shape(x, n));
}

DRAFTHEAD_SMALL_LINEAR_OPS(drafthead_kernels)
