// y = x · Wᵀ (+ bias) for a few rows of a bf16 model's x, W a GGUF target's own quantized blocks, with AVX512-BF16
// dot products: the bf16 counterpart of small_gemm_avx2.cpp's small_linear_q, on the same packed blocks
// (gguf_weights.py).
//
// Every q of these formats (int8, or 4 bits) is exact in bf16, so vdpbf16ps forms each product x · q exactly and
// sums it in float32; each GGUF block's sum is then scaled by its d (and the block's Σ x times its minimum m added).
// The weights multiplied are thus exactly the dequantized d · q (+ m), not their bf16 roundings, while a step
// streams about 0.6 (4-bit) or 1.1 (8-bit) bytes a weight instead of bf16's 2. Each output is summed in the same
// order whatever the number of rows, so a row's result does not depend on what else is in the batch.
// Layouts: small_linear.h's GgufCall (4-bit q: k = 2p in byte [p, c]'s low nibble, 2p + 1 in its high one).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16.h"
#include "small_linear.h"

namespace {

constexpr int64_t kCols = 16;        // output columns per packed block: one vector of float sums
constexpr int64_t kGroup = 32;       // k's per scale (and minimum) but Q6_K's 16
constexpr int kMaxRows = 16;         // rows summed at once, straight from the packed blocks
constexpr int64_t kChunkPairs = 128;  // past kMaxRows rows, k-pairs of a block converted once to bf16 (8 KB, in L1)

// 16 columns x 2 k's as vdpbf16ps' operand (lane c: k = 2p in its low half, 2p + 1 in its high one), from int8 q of
// two consecutive k's (2 x 16 bytes): an 8-bit integer's float32 has 16 zero low bits, so its high half is its bf16
inline __m512i q8_pair(const int8_t* q) {
  const __m512i k0 = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q))));
  const __m512i k1 =
      _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + kCols)))));
  return _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(k0, 16), k1);
}

// the same from 16 bytes of 4-bit q (byte c: column c's two k's): each word of lane c gets one of byte c's nibbles
// in its low 4 bits, then `table` (word i: bf16 of i mod 16) gives its value (vpermw reads 5 bits a word)
inline __m512i q4_pair(const uint8_t* q, __m512i table) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
  return _mm512_permutexvar_epi16(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), table);  // high word: byte c >> 4
}

__m512i bf16_small_integers() {  // words i = 0..31: bf16 of i mod 16
  alignas(64) uint16_t words[32] = {};
  for (int i = 0; i < 32; ++i) {
    const float f = static_cast<float>(i % 16);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    words[i] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(words);
}

// A block's k-pairs, by pair index: converted from its int8 or 4-bit q (streamed from memory: `ahead` is what to
// fetch meanwhile), or read back from a converted piece (in L1: nothing to fetch)
struct Q8Pairs {
  const int8_t* q;
  __m512i pair(int64_t p) const { return q8_pair(q + p * 2 * kCols); }
  const void* ahead(int64_t p) const { return q + (p + 32) * 2 * kCols; }
};
struct Q4Pairs {
  const uint8_t* q;
  __m512i table;
  __m512i pair(int64_t p) const { return q4_pair(q + p * kCols, table); }
  const void* ahead(int64_t p) const { return q + (p + 32) * kCols; }
};
struct Converted {
  const __m512i* w;
  int64_t first;  // the pair index of w[0]
  __m512i pair(int64_t p) const { return _mm512_load_si512(w + (p - first)); }
};

// What scales a block's sums: per group g, 16 scales at d + g · stride (and, with minimums, 16 minimums after them)
struct Scales {
  int64_t stride;
  int64_t group_pairs;  // k-pairs per group
  bool minimums;
};

// total (rows, kBlocks x 16) (+)= x (rows, K) · pairs [p_begin, p_end) of kBlocks blocks (src[j], scales d[j]);
// xsum (rows, K/32): each row's Σ x per group (read with minimums only); `first`: the pairs start the sums. Only
// the group sums live in registers (rows x blocks of them); the totals take one update a group, in L1.
template <int kRows, int kBlocks, typename Pairs>
void block_dot(const uint16_t* x, int64_t ldx, const Pairs* src, const float* const* d, const Scales& scales,
               int64_t p_begin, int64_t p_end, const float* xsum, int64_t ldsum, float* total, int64_t ldt,
               bool first) {
  for (int64_t p = p_begin; p < p_end; p += scales.group_pairs) {
    __m512 sum[kRows][kBlocks];
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < kBlocks; ++j) sum[r][j] = _mm512_setzero_ps();
    for (int64_t i = p; i < p + scales.group_pairs; ++i) {
#pragma GCC unroll 16
      for (int j = 0; j < kBlocks; ++j) {
        if constexpr (!std::is_same_v<Pairs, Converted>)
          if (i % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(src[j].ahead(i)), _MM_HINT_T0);
        const __m512bh w = (__m512bh)src[j].pair(i);
#pragma GCC unroll 16
        for (int r = 0; r < kRows; ++r) {
          const __m512i xr = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * ldx + 2 * i));
          sum[r][j] = _mm512_dpbf16_ps(sum[r][j], (__m512bh)xr, w);
        }
      }
    }
    const int64_t g = p / scales.group_pairs;
    const bool start = first && p == p_begin;
#pragma GCC unroll 16
    for (int j = 0; j < kBlocks; ++j) {
      const float* s = d[j] + g * scales.stride;
      const __m512 scale = _mm512_loadu_ps(s);
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
        float* t = total + r * ldt + j * kCols;
        __m512 v = _mm512_fmadd_ps(sum[r][j], scale, start ? _mm512_setzero_ps() : _mm512_loadu_ps(t));
        if (scales.minimums) v = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * ldsum + g]), _mm512_loadu_ps(s + kCols), v);
        _mm512_storeu_ps(t, v);
      }
    }
  }
}

// blocks a pass for a row count: enough independent sums (rows x blocks, up to 16) to hide vdpbf16ps' latency
constexpr int blocks_a_pass(int rows) { return rows <= 2 ? 8 : rows <= 4 ? 4 : rows <= 8 ? 2 : 1; }
constexpr int kMaxBlocks = 8;

template <typename Pairs>
using BlockDot = void (*)(const uint16_t*, int64_t, const Pairs*, const float* const*, const Scales&, int64_t,
                          int64_t, const float*, int64_t, float*, int64_t, bool);

template <typename Pairs, size_t... kRows>
constexpr std::array<std::array<BlockDot<Pairs>, 2>, kMaxRows + 1> block_dot_table(std::index_sequence<0, kRows...>) {
  return {{{nullptr, nullptr},
           {block_dot<static_cast<int>(kRows), blocks_a_pass(static_cast<int>(kRows)), Pairs>,
            block_dot<static_cast<int>(kRows), 1, Pairs>}...}};
}
// [rows][0]: blocks_a_pass(rows) blocks at once, [rows][1]: one block
template <typename Pairs>
constexpr auto kBlockDot = block_dot_table<Pairs>(std::make_index_sequence<kMaxRows + 1>());

// y (m_total, N) bf16 = x (m_total, K) · W (N, K)ᵀ (+ bias), W's blocks given by pairs(b) and their scales at
// params + b · per_block
template <typename Pairs, typename MakePairs>
void multiply(const uint16_t* x, int64_t m_total, int64_t k, int64_t blocks, MakePairs pairs, const float* params,
              int64_t per_block, const Scales& scales, const float* xsum, const float* bias, uint16_t* y) {
  const int64_t n = blocks * kCols, all_pairs = k / 2, groups = k / kGroup;
  // rows [m0, m0 + rows) of `count` blocks from blk on, from their totals (ldt floats a row), to bf16 outputs
  const auto finish = [&](const float* total, int64_t ldt, int64_t rows, int64_t m0, int64_t blk, int count) {
    for (int64_t r = 0; r < rows; ++r)
      for (int j = 0; j < count; ++j) {
        const int64_t col = (blk + j) * kCols;
        __m512 v = _mm512_loadu_ps(total + r * ldt + j * kCols);
        if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + col));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + r) * n + col), (__m256i)_mm512_cvtneps_pbh(v));
      }
  };
  const auto gather = [&](int64_t blk, int count, Pairs* src, const float** d) {  // blocks blk.. and their scales
    for (int j = 0; j < count; ++j) {
      src[j] = pairs(blk + j);
      d[j] = params + (blk + j) * per_block;
    }
  };
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    if (m_total <= kMaxRows) {  // every row at once, straight from the packed blocks, several blocks a pass
      const int rows = static_cast<int>(m_total), wide = blocks_a_pass(rows);
      alignas(64) float total[kMaxRows * kMaxBlocks * kCols];
      for (int64_t blk = first; blk < last;) {
        const int count = blk + wide <= last ? wide : 1;
        Pairs src[kMaxBlocks];
        const float* d[kMaxBlocks];
        gather(blk, count, src, d);
        kBlockDot<Pairs>[rows][count == wide ? 0 : 1](x, k, src, d, scales, 0, all_pairs, xsum, groups, total,
                                                      count * kCols, true);
        finish(total, count * kCols, rows, 0, blk, count);
        blk += count;
      }
      return;
    }
    // more rows: a piece of two blocks is converted once, then every group of 8 rows reads it from L1
    constexpr int kPieceBlocks = blocks_a_pass(8);  // (so that a full group of rows takes kBlockDot[8][0])
    alignas(64) __m512i converted[kPieceBlocks][kChunkPairs];
    std::vector<float> totals(static_cast<size_t>(m_total * kPieceBlocks * kCols));
    for (int64_t blk = first; blk < last;) {
      const int count = blk + kPieceBlocks <= last ? kPieceBlocks : 1;
      Pairs src[kPieceBlocks];
      const float* d[kPieceBlocks];
      gather(blk, count, src, d);
      for (int64_t p0 = 0; p0 < all_pairs; p0 += kChunkPairs) {
        const int64_t p1 = std::min(all_pairs, p0 + kChunkPairs);
        Converted pieces[kPieceBlocks];
        for (int j = 0; j < count; ++j) {
          for (int64_t i = p0; i < p1; ++i) converted[j][i - p0] = src[j].pair(i);
          pieces[j] = Converted{converted[j], p0};
        }
        for (int64_t m0 = 0; m0 < m_total; m0 += 8) {
          const int rows = static_cast<int>(std::min<int64_t>(8, m_total - m0));
          const int64_t ldt = count * kCols;
          if (count == kPieceBlocks && rows == 8) {
            kBlockDot<Converted>[rows][0](x + m0 * k, k, pieces, d, scales, p0, p1, xsum + m0 * groups, groups,
                                          totals.data() + m0 * ldt, ldt, p0 == 0);
            continue;
          }
          for (int j = 0; j < count; ++j)  // a short group of rows (or a last single block): one block at a time
            kBlockDot<Converted>[rows][1](x + m0 * k, k, &pieces[j], &d[j], scales, p0, p1, xsum + m0 * groups,
                                          groups, totals.data() + m0 * ldt + j * kCols, ldt, p0 == 0);
        }
      }
      finish(totals.data(), count * kCols, m_total, 0, blk, count);
      blk += count;
    }
  });
}

}  // namespace

// A GGUF target's quantized weight in a bf16 model: x (..., K) bf16; packed and params as small_gemm_avx2.cpp's
// small_linear_q takes them; bias (N,) or none -> (..., N) bf16 from the exactly dequantized weights; `live` as
// small_linear's (small_linear.h)
torch::Tensor small_linear_q(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& params,
                             const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& live) {
  const GgufCall call = gguf_call(x, packed, params, bias, live, at::kBFloat16);
  const int64_t blocks = call.blocks, k = call.k, groups = call.groups;  // (plain names: lambdas below capture them)
  const uint16_t* a = reinterpret_cast<const uint16_t*>(call.rows.data_ptr());
  uint16_t* y = reinterpret_cast<uint16_t*>(call.out.data_ptr());
  const int64_t per_block = params.numel() / blocks;  // a block's scales (and minimums), floats
  if (call.q8) {
    const int8_t* q = packed.data_ptr<int8_t>();
    multiply<Q8Pairs>(a, call.m_live, k, blocks, [=](int64_t b) { return Q8Pairs{q + b * k * kCols}; }, call.params,
                      per_block, Scales{kCols, call.sixteens ? 8 : kGroup / 2, false}, nullptr, data_or_null(call.bias),
                      y);
  } else {
    // each row's Σ x per group of 32 k, which the minimums multiply (summed alike for every row)
    std::vector<float> xsum(static_cast<size_t>(call.m_live * groups));
    for (int64_t m = 0; m < call.m_live; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        const uint16_t* s = a + m * k + g * kGroup;
        xsum[m * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(bf16x16_to_float(s), bf16x16_to_float(s + 16)));
      }
    const uint8_t* q = packed.data_ptr<uint8_t>();
    const __m512i table = bf16_small_integers();
    multiply<Q4Pairs>(a, call.m_live, k, blocks, [=](int64_t b) { return Q4Pairs{q + b * k / 2 * kCols, table}; },
                      call.params, per_block, Scales{2 * kCols, kGroup / 2, true}, xsum.data(),
                      data_or_null(call.bias), y);
  }
  return call.out.view(out_shape(x, blocks * kCols));
}

TORCH_LIBRARY_FRAGMENT(drafthead_kernels, m) {
  m.def("small_linear_q(Tensor x, Tensor packed, Tensor params, Tensor? bias, Tensor? live=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(drafthead_kernels, CPU, m) { m.impl("small_linear_q", &small_linear_q); }
