// y = x · Wᵀ (+ bias) in float32 for a few rows of x, with AVX2 + FMA (AVX512F where the CPU has it):
// small_gemm.cpp's idea for float32 models, the fast dtype on CPUs without AVX512-BF16 and a GGUF target's.
//
// A decoding step or a tree verification multiplies a handful of rows by every weight of the model, so it is
// bound by reading the weights once. PyTorch's float32 linear (MKL) does not stream them at that size on an AVX2
// EPYC (SmolLM2-135M's lm_head at 8 rows: ~2.5 GB/s). The weight is packed once into 16-column blocks, each
// stored k by k (16 floats per k), so one pass streams a block front to back while 4 rows' accumulators (16
// with AVX512F) stay in registers; more rows take the same 256-k piece of the block again from L1; a single
// row takes three blocks a pass. Each output element is summed over k in order whatever the number of rows, so
// a row's result does not depend on what else is in the batch.
//
// Layout of `packed`: (N/16, K, 16) float; element [b, k, c] = W[16 b + c, k]. small_linear_int8 takes int8
// weights in the same layout (a self-draft's int8 copy, one scale per output column), widened in registers.
//
// small_linear_q multiplies by a GGUF target's own quantized blocks (Q8_0, Q5_0 and Q6_K as int8 q and a scale, Q4_0,
// Q4_1 and Q4_K as 4-bit q, a scale and a minimum; gguf_weights.py repacks them),
// dequantized in registers to exactly the float32 values the dequantized model holds (gguf's d·q and d·q + m, each
// step rounded as numpy rounds it) and summed in the same order as small_linear: the result is bit-identical to
// small_linear on the dequantized weight, while a step streams 0.75 (4-bit) or 1.125-1.25 (int8) bytes a weight, not 4.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "small_linear.h"

namespace {

constexpr int64_t kBlock = 16;   // output columns per block (one vector of 16 floats, or two of 8)
// one row of float32 or int8 weights: this many blocks a pass, so that enough FMA chains run while the weights
// stream (docs/results/small_gemm_avx2_row_blocks_zen3.json)
constexpr int kRowBlocks = 3;

// A block's 16 columns of one k (or of one row's sums), and the few operations the kernel needs on them. Built
// with AVX512F (where the CPU has it), one 512-bit vector, and 32 registers hold 16 rows' sums, so that a verify
// of 16 tokens dequantizes and streams each weight once; else two 256-bit vectors and 4 rows. Every lane does the
// same float32 operations in the same order either way: the results are bit-identical.
#ifdef __AVX512F__
constexpr int kMaxRows = 16;  // rows accumulated at once (16 of the 32 registers)
constexpr int64_t kChunk = 256;  // k per pass: a block's kChunk x 16 piece stays in L1 for every row group
struct Columns {
  __m512 v;
  static Columns zero() { return {_mm512_setzero_ps()}; }
  static Columns load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Columns widen(__m128i bytes) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))}; }  // 16 int8
  // 16 bytes of two 4-bit values each: the low nibbles and the high ones
  static void nibbles(__m128i bytes, Columns& low, Columns& high) {
    const __m512i lanes = _mm512_cvtepu8_epi32(bytes);
    low = {_mm512_cvtepi32_ps(_mm512_and_si512(lanes, _mm512_set1_epi32(0x0F)))};
    high = {_mm512_cvtepi32_ps(_mm512_srli_epi32(lanes, 4))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  Columns times(const Columns& s) const { return {_mm512_mul_ps(v, s.v)}; }
  Columns times_plus(const Columns& s, const Columns& o) const { return {_mm512_fmadd_ps(v, s.v, o.v)}; }
  Columns fma(const float* a, const Columns& w) const { return {_mm512_fmadd_ps(_mm512_set1_ps(*a), w.v, v)}; }
};
#else
constexpr int kMaxRows = 4;  // rows accumulated at once (2 x 4 = 8 accumulator registers; more spill)
// a 4 KB float piece: with the rows streaming past it, 16 KB overflowed L1 from 5 rows on
// (docs/results/small_gemm_avx2_chunk_zen3.json)
constexpr int64_t kChunk = 64;
struct Columns {
  __m256 lo, hi;
  static Columns zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Columns load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Columns widen(__m128i bytes) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes)))};
  }
  static void nibbles(__m128i bytes, Columns& low, Columns& high) {
    const __m256i lo = _mm256_cvtepu8_epi32(bytes), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    low = {_mm256_cvtepi32_ps(_mm256_and_si256(lo, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask))};
    high = {_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4))};
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  Columns times(const Columns& s) const { return {_mm256_mul_ps(lo, s.lo), _mm256_mul_ps(hi, s.hi)}; }
  Columns times_plus(const Columns& s, const Columns& o) const {
    return {_mm256_fmadd_ps(lo, s.lo, o.lo), _mm256_fmadd_ps(hi, s.hi, o.hi)};
  }
  Columns fma(const float* a, const Columns& w) const {
    const __m256 am = _mm256_broadcast_ss(a);
    return {_mm256_fmadd_ps(am, w.lo, lo), _mm256_fmadd_ps(am, w.hi, hi)};
  }
};
#endif

// one k of a packed block: its 16 weights (int8 ones widened)
inline Columns load_weights(const float* b) { return Columns::load(b); }
inline Columns load_weights(const int8_t* b) {
  return Columns::widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
}

// The weights of one packed 16-column block, read from some k on, kStep k's a load. Plain: float or int8 values,
// (K, 16).
template <typename W>
struct Plain {
  const W* p;
  static constexpr int kStep = 1;
  static constexpr int64_t kPerLine = 64 / (kBlock * sizeof(W));  // k's per cache line
  Plain at(int64_t k0) const { return {p + k0 * kBlock}; }
  const void* ahead(int64_t i) const { return p + (i + kChunk) * kBlock; }
  void load(int64_t i, Columns* w) const { w[0] = load_weights(p + i * kBlock); }
};

// GGUF blocks: a 4- or 8-bit q times a half-precision scale d is exact in float32, so the dequantized weight
// (gguf's d·q, d·q + m) is one multiplication or one fused multiply-add, rounded as numpy rounds it
constexpr int64_t kGroup = 32;  // k's per scale (and minimum) of a column: a GGUF block (a Q4_K sub-block)

// Q8_0: int8 q (K, 16) and one float scale d per kGroupK k and column (K/kGroupK, 16): w = q · d (Q6_K: 16 k a scale)
template <int64_t kGroupK>
struct Q8 {
  const int8_t* q;
  const float* d;
  static constexpr int kStep = 1;
  static constexpr int64_t kPerLine = 64 / kBlock;
  Q8 at(int64_t k0) const { return {q + k0 * kBlock, d + k0 / kGroupK * kBlock}; }
  const void* ahead(int64_t i) const { return q + (i + kChunk) * kBlock; }
  void load(int64_t i, Columns* w) const {
    w[0] = load_weights(q + i * kBlock).times(Columns::load(d + i / kGroupK * kBlock));
  }
};

// Q4_1: 4-bit q (K/2, 16 bytes: k = 2p in byte [p, c]'s low nibble, 2p + 1 in its high one) and per 32 k and column
// a float scale d and minimum m ((K/32, 2, 16): the 16 d's, then the 16 m's): w = q · d + m, two k's a load
struct Q4 {
  const uint8_t* q;
  const float* dm;
  static constexpr int kStep = 2;
  static constexpr int64_t kPerLine = 64 / kBlock * 2;
  Q4 at(int64_t k0) const { return {q + k0 / 2 * kBlock, dm + k0 / kGroup * 2 * kBlock}; }
  const void* ahead(int64_t i) const { return q + (i + kChunk) / 2 * kBlock; }
  void load(int64_t i, Columns* w) const {
    const float* s = dm + i / kGroup * 2 * kBlock;
    const Columns d = Columns::load(s), m = Columns::load(s + kBlock);
    Columns low, high;
    Columns::nibbles(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i / 2 * kBlock)), low, high);
    w[0] = low.times_plus(d, m);
    w[1] = high.times_plus(d, m);
  }
};

// out (rows, kBlocks x 16) (+)= a (rows, chunk) · the chunks (chunk, 16) of kBlocks packed blocks, block j's from
// its cursor b[j] (and written at out + 16 j); `first`: the chunk starts the sum
template <int kRows, int kBlocks, typename Cursor>
void block_dot(const float* a, int64_t lda, const Cursor* b, int64_t chunk, bool first, float* out, int64_t ldo) {
  // every loop over the rows unrolled: then the accumulators live in registers only (with one loop left rolled,
  // GCC kept the array in memory too and stored all 8 accumulators on every k: ~1.7x slower at 8 rows)
  Columns c[kRows][kBlocks];
#pragma GCC unroll 16
  for (int m = 0; m < kRows; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < kBlocks; ++j)
      c[m][j] = first ? Columns::zero() : Columns::load(out + m * ldo + j * kBlock);
  for (int64_t i = 0; i < chunk; i += Cursor::kStep) {
#pragma GCC unroll 4
    for (int j = 0; j < kBlocks; ++j) {
      // the weights one piece ahead (the block's next piece, or the next block's first: they follow in memory),
      // so that they arrive while this piece is multiplied for every row group (no fault past the end: a hint)
      if (i % Cursor::kPerLine == 0) _mm_prefetch(reinterpret_cast<const char*>(b[j].ahead(i)), _MM_HINT_T0);
      Columns w[Cursor::kStep];
      b[j].load(i, w);
#pragma GCC unroll 2
      for (int step = 0; step < Cursor::kStep; ++step)
#pragma GCC unroll 16
        for (int m = 0; m < kRows; ++m) c[m][j] = c[m][j].fma(a + m * lda + i + step, w[step]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < kRows; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < kBlocks; ++j) c[m][j].store(out + m * ldo + j * kBlock);
}

// a piece of `chunk` k's of a packed block as float32 (chunk, 16) in `tile`, exactly as Cursor::load gives them
template <typename Cursor>
void widen(const Cursor& b, int64_t chunk, float* tile) {
  for (int64_t i = 0; i < chunk; i += Cursor::kStep) {
    if (i % Cursor::kPerLine == 0) _mm_prefetch(reinterpret_cast<const char*>(b.ahead(i)), _MM_HINT_T0);
    Columns w[Cursor::kStep];
    b.load(i, w);
    for (int step = 0; step < Cursor::kStep; ++step) w[step].store(tile + (i + step) * kBlock);
  }
}

template <typename Cursor>
using BlockDot = void (*)(const float*, int64_t, const Cursor*, int64_t, bool, float*, int64_t);

// block_dot of one block by row count 1..kMaxRows (entry 0 unused)
template <typename Cursor, size_t... kRows>
constexpr std::array<BlockDot<Cursor>, kMaxRows + 1> block_dot_table(std::index_sequence<0, kRows...>) {
  return {nullptr, block_dot<static_cast<int>(kRows), 1, Cursor>...};
}
template <typename Cursor>
constexpr std::array<BlockDot<Cursor>, kMaxRows + 1> kBlockDot =
    block_dot_table<Cursor>(std::make_index_sequence<kMaxRows + 1>());

// y (m_total, N) = a (m_total, K) · W (N, K)ᵀ with W's blocks given by block(b) (a cursor at k = 0), then each
// column times scale (if any) plus bias (if any)
template <typename Cursor, typename Block>
void multiply(const float* a, int64_t m_total, int64_t k, Block block, int64_t blocks, const float* scale,
              const float* bias, float* y) {
  // from two row groups on, int8 and GGUF weights are widened once a piece into a float32 tile that every row
  // group then reads from L1, instead of widening them again for each group; the same values, summed in the same
  // order (one full group and a short one were faster widening twice)
  const bool widen_once = !std::is_same_v<Cursor, Plain<float>> && m_total >= 2 * kMaxRows;
  const int64_t n = blocks * kBlock;
  constexpr bool plain = std::is_same_v<Cursor, Plain<float>> || std::is_same_v<Cursor, Plain<int8_t>>;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    alignas(64) float tile[kChunk * kBlock];
    for (int64_t blk = first; blk < last;) {
      // one row of float32 or int8 weights: kRowBlocks blocks a pass while they last, else one
      const int64_t span = plain && m_total == 1 && blk + kRowBlocks <= last ? kRowBlocks : 1;
      const int64_t col = blk * kBlock;
      const Cursor weights = block(blk);
      for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
        const int64_t chunk = std::min(kChunk, k - k0);
        if constexpr (plain) {
          if (span == kRowBlocks) {
            Cursor pieces[kRowBlocks];
            for (int j = 0; j < kRowBlocks; ++j) pieces[j] = block(blk + j).at(k0);
            block_dot<1, kRowBlocks>(a + k0, k, pieces, chunk, k0 == 0, y + col, n);
            continue;
          }
        }
        const auto row_groups = [&](const auto& w) {  // every group of rows times the piece `w`
          using W = std::decay_t<decltype(w)>;
          for (int64_t m0 = 0; m0 < m_total; m0 += kMaxRows) {
            const int rows_now = static_cast<int>(std::min<int64_t>(kMaxRows, m_total - m0));
            kBlockDot<W>[rows_now](a + m0 * k + k0, k, &w, chunk, k0 == 0, y + m0 * n + col, n);
          }
        };
        const Cursor piece = weights.at(k0);
        if (widen_once) {
          widen(piece, chunk, tile);
          row_groups(Plain<float>{tile});
        } else {
          row_groups(piece);
        }
      }
      blk += span;
      if (scale == nullptr && bias == nullptr) continue;
      for (int64_t c = col; c < blk * kBlock; c += 8) {
        const __m256 s = scale != nullptr ? _mm256_loadu_ps(scale + c) : _mm256_set1_ps(1.0f);
        const __m256 add = bias != nullptr ? _mm256_loadu_ps(bias + c) : _mm256_setzero_ps();
        for (int64_t m = 0; m < m_total; ++m)
          _mm256_storeu_ps(y + m * n + c, _mm256_fmadd_ps(_mm256_loadu_ps(y + m * n + c), s, add));
      }
    }
  });
}

// packed (N/16, K, 16) of W's type, one block after another
template <typename W>
void multiply_packed(const float* a, int64_t m_total, int64_t k, const W* packed, int64_t blocks, const float* scale,
                     const float* bias, float* y) {
  multiply<Plain<W>>(a, m_total, k, [=](int64_t b) { return Plain<W>{packed + b * k * kBlock}; }, blocks, scale,
                     bias, y);
}

// x's rows (..., K) as one contiguous float (M, K), after checking x against a packed (N/16, K, 16) weight
torch::Tensor rows_of(const torch::Tensor& x, const torch::Tensor& packed, at::ScalarType weight_type,
                      const char* op) {
  TORCH_CHECK(packed.scalar_type() == weight_type && packed.dim() == 3 && packed.size(2) == kBlock &&
                  packed.is_contiguous(),
              op, ": packed weight must be contiguous ", weight_type, " (N/16, K, 16), got ", packed.scalar_type(),
              " ", packed.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == packed.size(1), op, ": x must be float32 with ",
              packed.size(1), " features, got ", x.scalar_type(), " ", x.sizes());
  return x.reshape({-1, x.size(-1)}).contiguous();
}

}  // namespace

// (N, K) float (or int8: small_linear_int8's weights) -> (N/16, K, 16): N a multiple of 16
torch::Tensor pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kChar),
              "pack_weight: a 2-D float32 or int8 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kBlock == 0, "pack_weight: out_features must be a multiple of 16, got ", weight.sizes());
  return weight.reshape({n / kBlock, kBlock, k}).permute({0, 2, 1}).contiguous();
}

// x (..., K) float, packed (N/16, K, 16) float, bias (N,) or none -> (..., N) float; with `live`, only the rows of
// x's first `live` entries are multiplied, the others are zeros (small_linear.h)
torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& packed,
                           const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& live) {
  const torch::Tensor rows = rows_of(x, packed, at::kFloat, "small_linear");
  const int64_t blocks = packed.size(0), n = blocks * kBlock;
  const int64_t m_live = live_rows(x, rows.size(0), live);
  const torch::Tensor bias_f = float_bias(bias, n, "small_linear");
  torch::Tensor out = output_rows(x, rows.size(0), m_live, n);
  multiply_packed(rows.data_ptr<float>(), m_live, rows.size(1), packed.data_ptr<float>(), blocks, nullptr,
                  data_or_null(bias_f), out.data_ptr<float>());
  return out.view(out_shape(x, n));
}

// The int8 weights of a self-draft (small_gemm.py's int8_weights) on a float32 model: x (..., K) float, packed
// (N/16, K, 16) int8 in pack_weight's layout, columns (2, N) float whose first row is each column's scale, bias (N,)
// or none -> (..., N) float = (x · Qᵀ) * scale (+ bias); `live` as small_linear's. Weight-only: x stays float32
// (the products are float32 FMAs of the widened weights, so quantising x would save nothing); the draft streams a
// quarter of the float32 bytes.
torch::Tensor small_linear_int8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& columns,
                                const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& live) {
  const torch::Tensor rows = rows_of(x, packed, at::kChar, "small_linear_int8");
  const int64_t blocks = packed.size(0), n = blocks * kBlock;
  const int64_t m_live = live_rows(x, rows.size(0), live);
  TORCH_CHECK(columns.scalar_type() == at::kFloat && columns.dim() == 2 && columns.size(1) == n,
              "small_linear_int8: columns must be float (2, ", n, "), got ", columns.sizes());
  const torch::Tensor scale = columns.select(0, 0).contiguous();
  const torch::Tensor bias_f = float_bias(bias, n, "small_linear_int8");
  torch::Tensor out = output_rows(x, rows.size(0), m_live, n);
  multiply_packed(rows.data_ptr<float>(), m_live, rows.size(1), packed.data_ptr<int8_t>(), blocks,
                  scale.data_ptr<float>(), data_or_null(bias_f), out.data_ptr<float>());
  return out.view(out_shape(x, n));
}

// A GGUF target's quantized weight (gguf_weights.py packs it; layouts: small_linear.h's GgufCall): x (..., K) float,
// packed int8 q (Q8_0, Q5_0, Q6_K) or 4-bit q (Q4_0, Q4_1, Q4_K), params, bias (N,) or none -> (..., N) float,
// bit-identical to small_linear on the dequantized weight; `live` as small_linear's.
torch::Tensor small_linear_q(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& params,
                             const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& live) {
  const GgufCall call = gguf_call(x, packed, params, bias, live, at::kFloat);
  const int64_t blocks = call.blocks, k = call.k, groups = call.groups;  // (plain names: lambdas below capture them)
  const float* p = call.params;
  const auto run = [&](auto block) {  // block(b): a cursor at block b's first k
    multiply<decltype(block(0))>(call.rows.data_ptr<float>(), call.m_live, k, block, blocks, nullptr,
                                 data_or_null(call.bias), call.out.data_ptr<float>());
  };
  if (!call.q8) {
    const uint8_t* q = packed.data_ptr<uint8_t>();
    run([=](int64_t b) { return Q4{q + b * k / 2 * kBlock, p + b * groups * 2 * kBlock}; });
  } else if (call.sixteens) {
    const int8_t* q = packed.data_ptr<int8_t>();
    run([=](int64_t b) { return Q8<16>{q + b * k * kBlock, p + b * groups * 2 * kBlock}; });
  } else {
    const int8_t* q = packed.data_ptr<int8_t>();
    run([=](int64_t b) { return Q8<kGroup>{q + b * k * kBlock, p + b * groups * kBlock}; });
  }
  return call.out.view(out_shape(x, blocks * kBlock));
}

DRAFTHEAD_SMALL_LINEAR_OPS(drafthead_avx2)

TORCH_LIBRARY_FRAGMENT(drafthead_avx2, m) {
  m.def("small_linear_q(Tensor x, Tensor packed, Tensor params, Tensor? bias, Tensor? live=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(drafthead_avx2, CPU, m) { m.impl("small_linear_q", &small_linear_q); }

