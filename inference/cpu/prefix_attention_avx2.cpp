// softmax(q·kᵀ·scaling + mask)·v in float32 for a few queries over the used prefix of a preallocated KV buffer,
// with AVX2 + FMA: prefix_attention.cpp's idea for CPUs without AVX512-BF16, where float32 is the fast dtype.
//
// A long-context decoding step is mostly attention: each query reads its sequence's whole KV cache. PyTorch's
// matmuls over a prefix of the buffer copy it or read all of it, and a tree of 4 queries costs about 1.6× one.
// Here the keys and values of each (row, KV head) are read once, in place, whatever the number of queries: every
// (query head, query) lane of that KV head scores a block of keys while it is in L1, and weighs a chunk of values
// while it is in L2.
//
// Per (row, KV head), chunk of kChunk keys and lane (online softmax, as flash attention does):
//   scores[j] = dot(k_j, q) · scaling + mask[query][j], 8 keys a vector: each key's products summed by vector of
//     the head dimension in order, then across the vector by a fixed tree (scores by key: a decoding step's 3 lanes
//     would leave most of a vector of lanes idle)
//   max rises to the chunk's max: what was summed so far is scaled by e^(old max - new max)
//   probs = exp(scores - max), summed by key position then across; out += Σ_j probs[j] · v_j in key order;
//   at the end out / sum.
// A lane's arithmetic never involves another lane, chunk and span boundaries are absolute slot numbers, and masked
// keys add exact zeros: each output row depends only on its own query, keys and mask row, so a token decoded alone
// and the same token verified inside a tree get the same bits.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "spans.h"

namespace {

constexpr int kKeys = 8;          // keys per vector of scores
constexpr int kMaxQueries = 16;   // queries per call (decoding steps and trees; prompts go elsewhere)
constexpr int64_t kChunk = 256;   // keys per block: its keys and values (64 KB each at head_dim 64) stay in L2
constexpr int64_t kSplit = 4096;  // keys per task: a long context is shared by the threads (a multiple of kChunk)

// e^x for x <= 0 (a softmax's shifted scores): 2^k · p(r), degree-6 polynomial, relative error ~1e-7; exactly 0
// below float's range and for NaN (masked slots: -inf - -inf)
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.0f);
  const __m256 alive = _mm256_cmp_ps(x, lowest, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^k as float bits: k >= -126 here, a normal number
  const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_k)), alive);
}

// one vector of 8 sums: element t = the sum of acc[t]'s 8 elements, by a fixed tree
inline __m256 sum_each(const __m256* acc) {
  const __m256 t01 = _mm256_hadd_ps(acc[0], acc[1]), t23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 t45 = _mm256_hadd_ps(acc[4], acc[5]), t67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_hadd_ps(t01, t23), u1 = _mm256_hadd_ps(t45, t67);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// the sum of a vector's 8 elements, by the same tree
inline float sum_all(__m256 x) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 p = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_hadd_ps(p, p));
}

inline float max_all(__m256 x) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// the scores of 8 keys k[0..8) (row stride kDim) against one query q: element t = dot(k_t, q), each key's products
// summed by vector of the head dimension in order, then across the vector (sum_each)
template <int kDim>
inline __m256 score_keys(const float* k, const float* q) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k + t * kDim));
#pragma GCC unroll 16
  for (int c = 8; c < kDim; c += 8) {
    const __m256 qc = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + t * kDim + c), acc[t]);
  }
  return sum_each(acc);
}

// acc[r][0..kDim) += Σ_j probs[(lane0 + r) · kChunk + j] · v_j over `count` keys (row stride kDim), in key order,
// for kRows lanes at a time, 32 of the head dimension at a time (kRows · 4 accumulators)
template <int kRows, int kDim>
void weigh_lanes(const float* probs, int lane0, const float* v, int64_t count, float* acc) {
  for (int d0 = 0; d0 < kDim; d0 += 32) {
    __m256 a[kRows][4];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < 4; ++c) a[r][c] = _mm256_loadu_ps(acc + r * kDim + d0 + c * 8);
    for (int64_t j = 0; j < count; ++j) {
      const float* row = v + j * kDim + d0;
      __m256 x[4];
      for (int c = 0; c < 4; ++c) x[c] = _mm256_loadu_ps(row + c * 8);
#pragma GCC unroll 3
      for (int r = 0; r < kRows; ++r) {
        const __m256 p = _mm256_broadcast_ss(probs + (lane0 + r) * kChunk + j);
        for (int c = 0; c < 4; ++c) a[r][c] = _mm256_fmadd_ps(p, x[c], a[r][c]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + r * kDim + d0 + c * 8, a[r][c]);
  }
}

// every lane, 3 at a time (12 accumulators + 4 values in 16 registers)
template <int kDim>
void weigh_all(const float* probs, int lanes, const float* v, int64_t count, float* acc) {
  int l = 0;
  for (; l + 3 <= lanes; l += 3) weigh_lanes<3, kDim>(probs, l, v, count, acc + l * kDim);
  if (lanes - l == 2) weigh_lanes<2, kDim>(probs, l, v, count, acc + l * kDim);
  if (lanes - l == 1) weigh_lanes<1, kDim>(probs, l, v, count, acc + l * kDim);
}

struct Kernels {
  __m256 (*score)(const float*, const float*);
  void (*weigh)(const float*, int, const float*, int64_t, float*);
};

template <int kDim>
constexpr Kernels kernels_for() {
  return {score_keys<kDim>, weigh_all<kDim>};
}

inline void store_row(const float* raw, int64_t dim, float scale, float* dst) {
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t c = 0; c < dim; c += 8) _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_loadu_ps(raw + c), s));
}

// The op's alive rows into call.out, in float32 (the arguments: PrefixCall in spans.h).
//
// Work: one task per (row, KV head, span of kSplit keys); a task walks its span in blocks of kChunk keys with a
// running max per lane. Spans of a long context are combined after (flash-decoding): the threads share the keys
// of one row and head.
void attend(const PrefixCall& call, const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
            const torch::Tensor& mask, double scaling) {
  const int64_t n = call.n, dim = call.dim, kv_heads = call.kv_heads, slots = call.slots, used = call.used;
  const int64_t groups = call.groups, spans = call.spans, lanes = groups * n;
  const float* q = query.data_ptr<float>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  float* o = call.out.data_ptr<float>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), qs2 = query.stride(2), qs3 = query.stride(3);
  const float* mask_base = mask.data_ptr<float>();
  const int64_t ms0 = mask.size(0) == 1 ? 0 : mask.stride(0), ms2 = mask.stride(2), ms3 = mask.stride(3);
  const __m256 vscale = _mm256_set1_ps(static_cast<float>(scaling));

  // spans of one (row, KV head) leave their running max, sum and raw sums here, combined after
  const int64_t pieces = call.alive * kv_heads * spans;
  SpanResults results(call, lanes, lanes);
  const Kernels kernels = dim == 32 ? kernels_for<32>() : dim == 64 ? kernels_for<64>() : kernels_for<128>();

  at::parallel_for(0, pieces, 1, [&](int64_t first, int64_t last) {
    thread_local std::vector<float> queries_buffer, probs_buffer, mask_block, acc_buffer, tail_buffer;
    thread_local std::vector<float> max_buffer, sum_buffer;
    thread_local std::vector<__m256> tops_buffer;
    queries_buffer.resize(static_cast<size_t>(lanes * dim));
    probs_buffer.resize(static_cast<size_t>(lanes * kChunk));
    mask_block.resize(static_cast<size_t>(n * kChunk));
    acc_buffer.resize(static_cast<size_t>(lanes * dim));
    tail_buffer.resize(static_cast<size_t>(kKeys * dim));
    max_buffer.resize(static_cast<size_t>(lanes));
    sum_buffer.resize(static_cast<size_t>(lanes));
    tops_buffer.resize(static_cast<size_t>(lanes));
    float* qd = queries_buffer.data();  // each lane's query, contiguous: qd[lane · dim + d]
    float* probs = probs_buffer.data();  // [lane][key]: the chunk's scores, then its exponentials in place
    float* mq = mask_block.data();       // the chunk's mask as [query][key]
    float* acc = acc_buffer.data();
    float* tail = tail_buffer.data();    // the chunk's last keys (fewer than 8), zero-padded
    float* run_max = max_buffer.data();  // per lane: the running max and sum of its exponentials
    float* run_sum = sum_buffer.data();
    __m256* tops = tops_buffer.data();   // per lane: the chunk's max so far, by key position
    for (int64_t piece = first; piece < last; ++piece) {
      const int64_t b = piece / (kv_heads * spans), kvh = (piece / spans) % kv_heads, span = piece % spans;
      const int64_t k0 = span * kSplit, k1 = std::min<int64_t>(used, k0 + kSplit);
      for (int64_t lane = 0; lane < lanes; ++lane) {  // lane = (query head in the group) · n + query
        const float* row = q + b * qs0 + (kvh * groups + lane / n) * qs1 + (lane % n) * qs2;
        for (int64_t d = 0; d < dim; ++d) qd[lane * dim + d] = row[d * qs3];
      }
      std::fill(run_max, run_max + lanes, -INFINITY);
      std::fill(run_sum, run_sum + lanes, 0.0f);
      std::fill(acc, acc + lanes * dim, 0.0f);
      const float* keys = kp + (b * kv_heads + kvh) * slots * dim;
      const float* values = vp + (b * kv_heads + kvh) * slots * dim;
      const float* mask_row = mask_base + b * ms0;

      for (int64_t c0 = k0; c0 < k1; c0 += kChunk) {
        const int64_t count = std::min<int64_t>(kChunk, k1 - c0), blocks = (count + kKeys - 1) / kKeys;
        // the chunk's mask entries per query; none when they are all zero (the committed prefix of a row: only
        // tree slots and padding are masked)
        bool masked = false;
        for (int64_t i = 0; i < n && !masked; ++i)
          for (int64_t j = 0; j < count && !masked; ++j) masked = mask_row[i * ms2 + (c0 + j) * ms3] != 0.0f;
        if (masked)
          for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < count; ++j) mq[i * kChunk + j] = mask_row[i * ms2 + (c0 + j) * ms3];
        if (count % kKeys) {
          const int64_t whole = count - count % kKeys;
          std::fill(tail, tail + kKeys * dim, 0.0f);
          std::memcpy(tail, keys + (c0 + whole) * dim, (count - whole) * dim * sizeof(float));
        }
        // scores by key, scaled and masked (keys past the chunk: -inf), and each lane's max: block by block, every
        // lane while the block's keys are in L1
        std::fill(tops, tops + lanes, _mm256_set1_ps(-INFINITY));
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const int64_t j = blk * kKeys;
          const bool whole = j + kKeys <= count;
          if (whole) {  // this block's values, into L2 while its keys are scored
            const char* vn = reinterpret_cast<const char*>(values + (c0 + j) * dim);
            for (int64_t line = 0; line < kKeys * dim * 4; line += 64) _mm_prefetch(vn + line, _MM_HINT_T1);
          }
          const float* kb = whole ? keys + (c0 + j) * dim : tail;
          __m256 live = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
          if (!whole) {
            alignas(32) int32_t flags[kKeys];
            for (int t = 0; t < kKeys; ++t) flags[t] = j + t < count ? -1 : 0;
            live = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(flags)));
          }
          for (int64_t lane = 0; lane < lanes; ++lane) {
            const __m256 dots = kernels.score(kb, qd + lane * dim);
            __m256 sc = masked ? _mm256_fmadd_ps(dots, vscale, _mm256_loadu_ps(mq + (lane % n) * kChunk + j))
                               : _mm256_mul_ps(dots, vscale);
            sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc, live);
            tops[lane] = _mm256_max_ps(tops[lane], sc);
            _mm256_storeu_ps(probs + lane * kChunk + j, sc);
          }
        }
        for (int64_t lane = 0; lane < lanes; ++lane) {
          float* pl = probs + lane * kChunk;
          const __m256 top = tops[lane];
          // the max rises: what was summed so far shrinks by e^(old - new); then the exponentials, summed by key
          // position (8 partial sums in key order) and then across (sum_all)
          const float old_max = run_max[lane], new_max = std::max(old_max, max_all(top));
          if (new_max != old_max) {
            const float shrink = _mm256_cvtss_f32(exp_nonpositive(_mm256_set1_ps(old_max - new_max)));
            run_sum[lane] *= shrink;
            const __m256 f = _mm256_set1_ps(shrink);
            float* row = acc + lane * dim;
            for (int64_t c = 0; c < dim; c += 8) _mm256_storeu_ps(row + c, _mm256_mul_ps(_mm256_loadu_ps(row + c), f));
            run_max[lane] = new_max;
          }
          const __m256 vmax = _mm256_set1_ps(new_max);
          __m256 partial = _mm256_setzero_ps();
          for (int64_t blk = 0; blk < blocks; ++blk) {
            const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(pl + blk * kKeys), vmax));
            partial = _mm256_add_ps(partial, e);
            _mm256_storeu_ps(pl + blk * kKeys, e);
          }
          run_sum[lane] += sum_all(partial);
        }
        // weighted values, 3 lanes at a time (the chunk's values are in cache after the first)
        kernels.weigh(probs, static_cast<int>(lanes), values + c0 * dim, count, acc);
      }

      results.finish(0, lanes, piece, b, kvh, run_max, run_sum, acc, o, store_row);
    }
  });

  results.combine(call.alive, o, store_row);
}

}  // namespace

DRAFTHEAD_PREFIX_ATTENTION_OP(drafthead_avx2, at::kFloat, kMaxQueries, kSplit, attend)
