// softmax(q·kᵀ·scaling + mask)·v in bf16 for a few queries over the used prefix of a preallocated KV buffer, with
// AVX512-BF16 dot products (vdpbf16ps) and float32 softmax and accumulation.
//
// Decoding and tree verification send 1-16 queries per sequence, and PyTorch's matmuls over a prefix of the
// buffer either read the whole buffer (the unused slots too) or copy the strided prefix first. This kernel reads
// the keys and values of the used slots in place, once per KV head whatever the number of queries, and never
// materialises a mask over the whole buffer. Grouped-query attention: the query heads of a KV head and the queries
// share one pass over its keys, 16 (query head, query) pairs per vector lane set.
//
// Per KV head, block of keys and lane set (online softmax, as flash attention does):
//   scores[j][lane] = dot(k_j, q_lane) (bf16 pairs, float sums) · scaling + mask[query(lane)][j]
//   max[lane] rises to the block's max: what was summed so far is scaled by e^(old max - new max)
//   probs = exp(scores - max) (float, rounded to bf16 pairs for the value sums), sums per lane
//   out[lane] += Σ_j probs[j][lane] · v_j (float); at the end out / sum, rounded to bf16 once.
// Two layouts of the scores, one arithmetic: with many lanes (a tree of queries) a vector holds 16 lanes of one
// key (each key broadcast); with few (decoding: 3 lanes for SmolLM2's 3 query heads per KV head) a vector of 16
// lanes of one key would be mostly idle, so a vector holds 16 keys of one lane (the keys transposed to pairs by
// key, each lane's query broadcast). Either way a lane's score is the same products summed in the same order, its
// exponentials are summed in one fixed order (sum_partials), and its values weighed alike: each output row
// depends only on its own query, keys and mask row, whatever the number of queries, so a token's attention does
// not depend on the tree verified beside it (a token decoded alone and verified in a tree get the same bits).
//
// Measurements of this design against the previous ones: docs/results/HISTORY_LONG_CONTEXT.md.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "spans.h"

namespace {

constexpr int kLanes = 16;      // (query head, query) pairs per pass over a KV head's keys
constexpr int kKeyBlock = 8;    // keys scored at once by lane (8 accumulators)
constexpr int kByKeyLanes = 8;  // at most this many lanes in all: scores by key (16 keys a vector)
constexpr int kMaxQueries = 16; // queries per call (decoding steps and trees; prompts go elsewhere)
constexpr int64_t kChunk = 512;   // keys per block: its keys and values (64 KB each at head_dim 64) stay in L2
constexpr int64_t kSplit = 4096;  // keys per task: a long context is shared by the threads (a multiple of kChunk)
constexpr int64_t kAhead = 1024;  // keys ahead of the scoring whose keys and values are prefetched into L2

// e^x for x <= 0 (a softmax's shifted scores): 2^k · p(r), |r| <= ln2/2, degree-5 polynomial (relative error
// ~2.5e-6, far below the bf16 rounding of the probabilities and outputs); x below -110 (masked slots: -inf, or NaN
// where a whole lane is masked) gives exactly 0 (2^k·p lies below float's smallest denormal). Against the degree-6
// version with a compare and a masked move (1e-7; those 3 of ~15 operations fewer, and every exponential runs once
// per (key, lane)): 8 rows × 8k keys, SmolLM2's shapes, 2-core Zen 4 EPYC, medians of 21 interleaved runs of two
// builds, two such A/Bs: 5 queries (15 lanes) -6 to -8 % a layer, 1 query -3 to -8 %.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-110.0f));  // (max_ps returns its second operand for a NaN)
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);  // x - k·ln2 in two parts
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 120);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

// mask entry j (stride `step`) of a bf16 or float mask row, as float
inline float mask_entry(const char* src, int64_t j, int64_t step, bool float_mask) {
  if (float_mask) return reinterpret_cast<const float*>(src)[j * step];
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(src)[j * step]) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// whether any of `count` mask entries (stride `step`, bf16 or float) is nonzero (-0 counts as zero)
inline bool any_nonzero(const char* src, int64_t count, int64_t step, bool float_mask) {
  int64_t j = 0;
  if (step == 1 && float_mask)
    for (; j + 16 <= count; j += 16)
      if (_mm512_test_epi32_mask(_mm512_loadu_si512(src + 4 * j), _mm512_set1_epi32(0x7fffffff))) return true;
  if (step == 1 && !float_mask)
    for (; j + 32 <= count; j += 32)
      if (_mm512_test_epi16_mask(_mm512_loadu_si512(src + 2 * j), _mm512_set1_epi16(0x7fff))) return true;
  for (; j < count; ++j)
    if (mask_entry(src, j, step, float_mask) != 0.0f) return true;
  return false;
}

// scores (kKeyBlock keys × 16 lanes) of keys k[0..kKeys) (row stride ldk) against the packed queries qp[pairs]
template <int kKeys>
inline void score_block(const uint16_t* k, int64_t ldk, const __m512bh* qp, int pairs, __m512* out) {
  __m512 acc[kKeys];
  for (int t = 0; t < kKeys; ++t) acc[t] = _mm512_setzero_ps();
  for (int p = 0; p < pairs; ++p) {
    const __m512bh q = (__m512bh)_mm512_loadu_si512(qp + p);
#pragma GCC unroll 8
    for (int t = 0; t < kKeys; ++t)
      acc[t] = _mm512_dpbf16_ps(acc[t], q, (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(k + t * ldk + 2 * p)));
  }
  for (int t = 0; t < kKeys; ++t) out[t] = acc[t];
}
// the same for a lane set of at most 8 lanes, at half the vector width (half the work on CPUs that split 512-bit
// operations in two); lanes 8-15 of the result are zero
template <int kKeys>
inline void score_block_half(const uint16_t* k, int64_t ldk, const __m512bh* qp, int pairs, __m512* out) {
  __m256 acc[kKeys];
  for (int t = 0; t < kKeys; ++t) acc[t] = _mm256_setzero_ps();
  for (int p = 0; p < pairs; ++p) {
    const __m256bh q = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp + p));
#pragma GCC unroll 8
    for (int t = 0; t < kKeys; ++t)
      acc[t] = _mm256_dpbf16_ps(acc[t], q,
                                (__m256bh)_mm256_set1_epi32(*reinterpret_cast<const int32_t*>(k + t * ldk + 2 * p)));
  }
  for (int t = 0; t < kKeys; ++t) out[t] = _mm512_zextps256_ps512(acc[t]);
}
// probabilities of two keys as bf16 pairs per lane: pair[lane] = (p0[lane], p1[lane]) (the operand layout of
// vdpbf16ps over two keys)
inline __m512i pair_probs(__m512 p0, __m512 p1) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // p0 in elements 0-15, p1 in 16-31
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, both);
}

// A lane's sum of a chunk's exponentials is summed in one order whichever way its scores were laid out: 16 partial
// sums by key (key index mod 16, keys in order), then a fixed tree: (i, i + 8), (i, i + 4), (i, i + 2), (0, 1).
// Lane by lane over 16 vectors of partial sums (scores by lane):
inline __m512 sum_partials(const __m512* partial) {
  __m512 half[8];
  for (int i = 0; i < 8; ++i) half[i] = _mm512_add_ps(partial[i], partial[i + 8]);
  for (int i = 0; i < 4; ++i) half[i] = _mm512_add_ps(half[i], half[i + 4]);
  for (int i = 0; i < 2; ++i) half[i] = _mm512_add_ps(half[i], half[i + 2]);
  return _mm512_add_ps(half[0], half[1]);
}

// and within one vector of 16 partial sums (scores by key)
inline float sum_partials(__m512 partial) {
  alignas(64) float x[16];
  _mm512_store_ps(x, partial);
  for (int i = 0; i < 8; ++i) x[i] += x[i + 8];
  for (int i = 0; i < 4; ++i) x[i] += x[i + 4];
  for (int i = 0; i < 2; ++i) x[i] += x[i + 2];
  return x[0] + x[1];
}

// out[c] = dword c of rows in[0..16): a 16 × 16 transpose of 32-bit elements (in 64 shuffles)
inline void transpose16(const __m512i* in, __m512i* out) {
  __m512i a[16], b[16];
  for (int k = 0; k < 8; ++k) {  // a[2k] lane L: rows 2k, 2k+1 of columns 4L, 4L+1; a[2k+1]: of 4L+2, 4L+3
    a[2 * k] = _mm512_unpacklo_epi32(in[2 * k], in[2 * k + 1]);
    a[2 * k + 1] = _mm512_unpackhi_epi32(in[2 * k], in[2 * k + 1]);
  }
  for (int m = 0; m < 4; ++m) {  // b[4m + t] lane L: rows 4m..4m+3 of column 4L + t
    b[4 * m] = _mm512_unpacklo_epi64(a[4 * m], a[4 * m + 2]);
    b[4 * m + 1] = _mm512_unpackhi_epi64(a[4 * m], a[4 * m + 2]);
    b[4 * m + 2] = _mm512_unpacklo_epi64(a[4 * m + 1], a[4 * m + 3]);
    b[4 * m + 3] = _mm512_unpackhi_epi64(a[4 * m + 1], a[4 * m + 3]);
  }
  for (int t = 0; t < 4; ++t) {  // out[4L + t] lane m = b[4m + t] lane L: a 4 × 4 transpose of 128-bit lanes
    const __m512i c0 = _mm512_shuffle_i32x4(b[t], b[4 + t], 0x44), c1 = _mm512_shuffle_i32x4(b[t], b[4 + t], 0xEE);
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + t], b[12 + t], 0x44);
    const __m512i c3 = _mm512_shuffle_i32x4(b[8 + t], b[12 + t], 0xEE);
    out[t] = _mm512_shuffle_i32x4(c0, c2, 0x88);
    out[4 + t] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
    out[8 + t] = _mm512_shuffle_i32x4(c1, c3, 0x88);
    out[12 + t] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
  }
}

// keys k[0..count) (row stride ldk, count <= 16; missing keys read as zeros) as bf16 pairs by key: kt[p] lane j =
// (k_j[2p], k_j[2p + 1])
inline void key_pairs_by_key(const uint16_t* k, int64_t ldk, int64_t count, int pairs, __m512i* kt) {
  __m512i rows[16];
  for (int p0 = 0; p0 < pairs; p0 += 16) {
    for (int j = 0; j < 16; ++j)
      rows[j] = j < count ? _mm512_loadu_si512(k + j * ldk + 2 * p0) : _mm512_setzero_si512();
    transpose16(rows, kt + p0);
  }
}

// scores of kLanes (query head, query) lanes against 16 keys: out[l] lane j = dot(k_j, q_l) in float, from the
// keys' pairs by key (kt) and each lane's query pairs (qpairs[p * 16 + l] = (q_l[2p], q_l[2p + 1]))
template <int kLanesNow>
inline void score_keys(const __m512i* kt, const int32_t* qpairs, int pairs, __m512* out) {
  __m512 acc[kLanesNow];
  for (int l = 0; l < kLanesNow; ++l) acc[l] = _mm512_setzero_ps();
  for (int p = 0; p < pairs; ++p) {
    const __m512bh keys = (__m512bh)kt[p];
    const int32_t* qp = qpairs + p * kLanes;
#pragma GCC unroll 16
    for (int l = 0; l < kLanesNow; ++l) acc[l] = _mm512_dpbf16_ps(acc[l], keys, (__m512bh)_mm512_set1_epi32(qp[l]));
  }
  for (int l = 0; l < kLanesNow; ++l) out[l] = acc[l];
}

using ScoreKeys = void (*)(const __m512i*, const int32_t*, int, __m512*);
const ScoreKeys kScoreKeys[kLanes + 1] = {
    nullptr,        score_keys<1>,  score_keys<2>,  score_keys<3>,  score_keys<4>,  score_keys<5>,
    score_keys<6>,  score_keys<7>,  score_keys<8>,  score_keys<9>,  score_keys<10>, score_keys<11>,
    score_keys<12>, score_keys<13>, score_keys<14>, score_keys<15>, score_keys<16>};

// acc rows (kRows lanes from lane0) += Σ_j probs[j][lane] · v_j over key pairs (probs as bf16 pairs of keys,
// lane l's of key pair jp at pairs[l * lane_stride + jp * pair_stride]; values interleaved pairwise in registers);
// kVec = head_dim / 16. The rows are kept in the order unpacklo/unpackhi leave a row's outputs ("raw" order,
// restored by store_row).
template <int kVec, int kRows>
void weigh_values(const int32_t* pairs, int64_t pair_stride, int64_t lane_stride, int lane0, const uint16_t* v,
                  int64_t ldv, int64_t key_pairs, float* acc_rows) {
  __m512 acc[kRows][kVec];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVec; ++c) acc[r][c] = _mm512_loadu_ps(acc_rows + ((lane0 + r) * kVec + c) * 16);
  const int32_t* lanes = pairs + lane0 * lane_stride;
  for (int64_t jp = 0; jp < key_pairs; ++jp) {
    const uint16_t* v0 = v + 2 * jp * ldv;
    const uint16_t* v1 = v0 + ldv;
    __m512bh vv[kVec];
    for (int c = 0; c < kVec / 2; ++c) {
      const __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
      vv[2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      vv[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(lanes[r * lane_stride + jp * pair_stride]);
      for (int c = 0; c < kVec; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, vv[c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVec; ++c) _mm512_storeu_ps(acc_rows + ((lane0 + r) * kVec + c) * 16, acc[r][c]);
}

template <int kVec>
void weigh_all(const int32_t* pairs, int64_t pair_stride, int64_t lane_stride, int lanes, const uint16_t* v,
               int64_t ldv, int64_t key_pairs, float* acc_rows) {
  constexpr int kRows = 24 / kVec;  // kRows·kVec accumulators + kVec values in 32 registers
  int lane0 = 0;
  for (; lane0 + kRows <= lanes; lane0 += kRows)
    weigh_values<kVec, kRows>(pairs, pair_stride, lane_stride, lane0, v, ldv, key_pairs, acc_rows);
  switch (lanes - lane0) {  // the rest, without idle accumulators
    case 0: break;
#define REST(k)                                                                                 \
  case k:                                                                                       \
    if constexpr (k < kRows)                                                                    \
      weigh_values<kVec, k>(pairs, pair_stride, lane_stride, lane0, v, ldv, key_pairs, acc_rows); \
    break;
    REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7) REST(8) REST(9) REST(10) REST(11)
#undef REST
  }
}

// one row of head_dim outputs from raw order (weigh_values) to d order, times `scale`, rounded to bf16: unpacklo
// holds d = 8t + {0..3} of each 128-bit lane t, unpackhi 8t + {4..7}: interleave their 4-float groups
inline void store_row(const float* raw, int64_t dim, float scale, uint16_t* dst) {
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < dim; c += 32) {
    const __m512 a = _mm512_loadu_ps(raw + c), b = _mm512_loadu_ps(raw + c + 16);
    const __m512 x = _mm512_mul_ps(_mm512_permutex2var_ps(a, first, b), s);
    const __m512 y = _mm512_mul_ps(_mm512_permutex2var_ps(a, second, b), s);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), (__m256i)_mm512_cvtneps_pbh(x));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c + 16), (__m256i)_mm512_cvtneps_pbh(y));
  }
}

// The op's alive rows into call.out, in bf16 (the arguments: PrefixCall in spans.h; the mask bf16 or float, any
// strides; keys at or after the used slots are not read).
//
// Work: one task per (row, KV head, span of kSplit keys) (and lane set, when those are few); a task walks its span
// in blocks of kChunk keys (keys and values of a block stay in cache while every lane set reads them: each byte of
// the cache is read from memory once whatever the number of queries) with a running max per lane (online softmax:
// the sums so far are rescaled when the max rises). Spans of a long context are combined after (flash-decoding):
// the threads share the keys of one row and head. Block and span boundaries are absolute slot numbers, so a
// query's output depends only on its own keys and mask row: not on the other queries, nor on masked slots after
// its own (a token decoded alone and the same token verified inside a tree get the same bits).
void attend(const PrefixCall& call, const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
            const torch::Tensor& mask, double scaling) {
  const int64_t n = call.n, dim = call.dim, kv_heads = call.kv_heads, slots = call.slots, used = call.used;
  const int64_t groups = call.groups, spans = call.spans, pairs = dim / 2;
  const int64_t lanes_total = groups * n, lane_sets = (lanes_total + kLanes - 1) / kLanes;
  const int64_t lanes_pad = lane_sets * kLanes;
  const uint16_t* q = reinterpret_cast<const uint16_t*>(query.data_ptr());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(key.data_ptr());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(value.data_ptr());
  uint16_t* o = reinterpret_cast<uint16_t*>(call.out.data_ptr());
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), qs2 = query.stride(2), qs3 = query.stride(3);
  const bool float_mask = mask.scalar_type() == at::kFloat;
  const char* mask_base = reinterpret_cast<const char*>(mask.data_ptr());
  const int64_t mask_item = float_mask ? 4 : 2;
  const int64_t ms0 = mask.size(0) == 1 ? 0 : mask.stride(0), ms2 = mask.stride(2), ms3 = mask.stride(3);
  const float scale = static_cast<float>(scaling);

  // spans of one (row, KV head) leave their running max, sum and raw sums here, combined after
  const int64_t pieces = call.alive * kv_heads * spans;
  SpanResults results(call, lanes_total, lanes_pad);
  // few pieces (one short row, many queries): the lane sets become tasks of their own, each reading the keys
  // (then in cache) again, so that both threads have work; a lane's arithmetic is the same either way
  const int64_t set_tasks = pieces < 4 * at::get_num_threads() ? lane_sets : 1;
  const int64_t tasks = pieces * set_tasks;

  // few lanes (decoding: one query per sequence): scores with the keys along the vector (16 keys a vector, each
  // lane's query broadcast), where scores by lane (16 lanes a vector, each key broadcast) would leave most of a
  // vector idle; the arithmetic of a lane is the same either way (the same products summed in the same order)
  const bool by_key = lanes_total <= kByKeyLanes;
  const int64_t pair_stride = by_key ? 1 : lanes_pad, lane_stride = by_key ? kChunk / 2 : 1;
  // scores by lane: each lane set's query index per lane (to gather the mask entries of a key)
  std::vector<__m512i> gathers(static_cast<size_t>(lane_sets));
  for (int64_t set = 0; set < lane_sets; ++set) {
    alignas(64) int32_t lane_query[kLanes];
    for (int l = 0; l < kLanes; ++l) lane_query[l] = static_cast<int32_t>((set * kLanes + l) % n);
    gathers[set] = _mm512_load_si512(lane_query);
  }

  at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
    constexpr int64_t kBlocks = kChunk / kLanes;  // blocks of 16 keys in a chunk
    thread_local std::vector<__m512i> keys_buffer;  // by key: a block of 16 keys as pairs by key
    thread_local std::vector<__m512> scores_buffer, best_buffer;
    thread_local std::vector<int32_t> queries_buffer, pairs_buffer;
    thread_local std::vector<float> acc_buffer, mask_block, max_buffer, sum_buffer;
    keys_buffer.resize(static_cast<size_t>(pairs));
    // by key: [lane][block] (16 keys a vector); by lane: [key] (16 lanes a vector), one lane set at a time
    scores_buffer.resize(static_cast<size_t>(std::max<int64_t>(lanes_pad * kBlocks, kChunk + 2)));
    best_buffer.resize(static_cast<size_t>(lanes_pad));
    queries_buffer.resize(static_cast<size_t>(lane_sets * pairs * kLanes));
    pairs_buffer.resize(static_cast<size_t>(lanes_pad * kChunk / 2));
    acc_buffer.resize(static_cast<size_t>(lanes_pad * dim));
    mask_block.resize(static_cast<size_t>(std::max<int64_t>(n, kLanes) * kChunk));
    max_buffer.resize(static_cast<size_t>(lanes_pad));
    sum_buffer.resize(static_cast<size_t>(lanes_pad));
    // (plain pointers: a thread_local's address is looked up again at each use)
    __m512i* keys_by_key = keys_buffer.data();
    __m512* scores = scores_buffer.data();
    __m512* best = best_buffer.data();  // by key: each lane's max so far in the chunk, per key position
    int32_t* query_pairs = queries_buffer.data();
    int32_t* pairs_p = pairs_buffer.data();  // bf16 probabilities of key pairs: lane l, pair jp at l·lane_stride +
                                             // jp·pair_stride
    float* acc = acc_buffer.data();
    float* mq = mask_block.data();  // the chunk's mask as float: by key [query][key], by lane [key][query]
    float* run_max = max_buffer.data();  // per lane: the running max and sum of its exponentials
    float* run_sum = sum_buffer.data();
    for (int64_t task = first; task < last; ++task) {
      const int64_t piece = task / set_tasks;  // (row, KV head, span)
      const int64_t b = piece / (kv_heads * spans), kvh = (piece / spans) % kv_heads, span = piece % spans;
      const int64_t set0 = set_tasks == 1 ? 0 : task % set_tasks, set1 = set_tasks == 1 ? lane_sets : set0 + 1;
      const int64_t lane0 = set0 * kLanes, lane1 = std::min<int64_t>(lanes_total, set1 * kLanes);
      const int64_t k0 = span * kSplit, k1 = std::min<int64_t>(used, k0 + kSplit);
      // each lane's query as bf16 pairs: query_pairs[(set · pairs + p) · 16 + l] = (q[2p], q[2p+1]) of
      // (query head, query) set·16 + l (zero past the last lane): by lane, vector set · pairs + p
      std::fill(query_pairs + set0 * pairs * kLanes, query_pairs + set1 * pairs * kLanes, 0);
      for (int64_t flat = lane0; flat < lane1; ++flat) {
        const uint16_t* row = q + b * qs0 + (kvh * groups + flat / n) * qs1 + (flat % n) * qs2;
        const int64_t set = flat / kLanes, l = flat % kLanes;
        for (int64_t p = 0; p < pairs; ++p) {
          const uint32_t lo = row[2 * p * qs3], hi = row[(2 * p + 1) * qs3];
          query_pairs[(set * pairs + p) * kLanes + l] = static_cast<int32_t>(lo | (hi << 16));
        }
      }
      std::fill(run_max, run_max + lanes_pad, -INFINITY);
      std::fill(run_sum, run_sum + lanes_pad, 0.0f);
      std::fill(acc, acc + lanes_pad * dim, 0.0f);
      const uint16_t* keys = kp + (b * kv_heads + kvh) * slots * dim;
      const uint16_t* values = vp + (b * kv_heads + kvh) * slots * dim;
      const char* mask_row = mask_base + b * ms0 * mask_item;
      const __m512 vscale = _mm512_set1_ps(scale);
      // the next task's first keys and values, prefetched while this one ends (scores by lane: each task would
      // otherwise start cold; 8 rows × 8k keys × 4 queries 2.96-2.97 -> 2.57-2.69 ms a layer)
      const uint16_t* next_keys = nullptr;
      const uint16_t* next_values = nullptr;
      int64_t next_count = 0;
      if (!by_key && task + 1 < last && (task + 1) / set_tasks != piece) {  // (scores by key read none)
        const int64_t np = (task + 1) / set_tasks;
        const int64_t nb = np / (kv_heads * spans), nh = (np / spans) % kv_heads, ns = np % spans;
        next_keys = kp + ((nb * kv_heads + nh) * slots + ns * kSplit) * dim;
        next_values = vp + ((nb * kv_heads + nh) * slots + ns * kSplit) * dim;
        next_count = std::min<int64_t>(used, (ns + 1) * kSplit) - ns * kSplit;
      }

      // the max of each lane's scores over the chunk rises: rescale what was summed so far (e^(old - new); 0
      // while nothing was seen); then the chunk's exponentials are summed by key (sum_partials)
      auto rescale = [&](int64_t flat, float chunk_max) {
        const float old_max = run_max[flat], new_max = std::max(old_max, chunk_max);
        if (new_max == old_max) return;
        alignas(64) float shrink[kLanes];
        _mm512_store_ps(shrink, exp_nonpositive(_mm512_set1_ps(old_max - new_max)));
        run_sum[flat] *= shrink[0];
        const __m512 f = _mm512_set1_ps(shrink[0]);
        float* row = acc + flat * dim;
        for (int64_t c = 0; c < dim; c += 16) _mm512_storeu_ps(row + c, _mm512_mul_ps(_mm512_loadu_ps(row + c), f));
        run_max[flat] = new_max;
      };
      for (int64_t c0 = k0; c0 < k1; c0 += kChunk) {
        const int64_t count = std::min<int64_t>(kChunk, k1 - c0), blocks = (count + kLanes - 1) / kLanes;
        // the chunk's mask entries as float; none when they are all zero (the committed prefix of a row: only
        // tree slots and padding are masked)
        bool masked = false;
        for (int64_t i = 0; i < n && !masked; ++i) {
          const char* src = mask_row + (i * ms2 + c0 * ms3) * mask_item;
          masked = any_nonzero(src, count, ms3, float_mask);
        }
        for (int64_t i = 0; masked && i < n; ++i) {
          const char* src = mask_row + (i * ms2 + c0 * ms3) * mask_item;
          for (int64_t j = 0; j < count; ++j) {
            const float entry = mask_entry(src, j, ms3, float_mask);
            if (by_key) mq[i * kChunk + j] = entry;
            else mq[j * kLanes + i] = entry;
          }
        }
        if (by_key) {
          // per block of 16 keys: its keys as pairs by key, then every lane's scores, scaled and masked (keys past
          // the chunk: -inf), and each lane's max
          const __mmask16 tail = count % kLanes ? static_cast<__mmask16>((1u << (count % kLanes)) - 1) : 0xFFFF;
          const int lanes = static_cast<int>(lane1 - lane0);  // one lane set
          for (int64_t flat = lane0; flat < lane1; ++flat) best[flat] = _mm512_set1_ps(-INFINITY);
          for (int64_t blk = 0; blk < blocks; ++blk) {
            // (no prefetching here: the hardware prefetcher keeps up with this path's row-by-row reads, and
            // explicit prefetches cost it 10-20 % at 8 rows × 8k keys)
            const int64_t j = c0 + blk * kLanes;
            key_pairs_by_key(keys + j * dim, dim, std::min<int64_t>(kLanes, c0 + count - j), static_cast<int>(pairs),
                             keys_by_key);
            const __mmask16 live = blk == blocks - 1 ? tail : 0xFFFF;
            alignas(64) __m512 block[kLanes];
            kScoreKeys[lanes](keys_by_key, query_pairs + set0 * pairs * kLanes, static_cast<int>(pairs),
                              block);
            for (int l = 0; l < lanes; ++l) {
              const int64_t flat = lane0 + l;
              const float* mask_keys = mq + flat % n * kChunk + blk * kLanes;
              __m512 s = masked ? _mm512_fmadd_ps(block[l], vscale, _mm512_loadu_ps(mask_keys))
                                : _mm512_mul_ps(block[l], vscale);
              s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, s);
              best[flat] = _mm512_max_ps(best[flat], s);
              scores[flat * kBlocks + blk] = s;
            }
          }
          for (int64_t flat = lane0; flat < lane1; ++flat) {
            rescale(flat, _mm512_reduce_max_ps(best[flat]));
            // exponentials (keys past the chunk: 0), summed by key, and as bf16 pairs of keys for the values
            const __m512 top = _mm512_set1_ps(run_max[flat]);
            __m512 partial = _mm512_setzero_ps();
            int32_t* lane_pairs = pairs_p + flat * lane_stride;
            for (int64_t blk = 0; blk < blocks; ++blk) {
              const __m512 e = exp_nonpositive(_mm512_sub_ps(scores[flat * kBlocks + blk], top));
              partial = _mm512_add_ps(partial, e);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(lane_pairs + blk * kLanes / 2),
                                  (__m256i)_mm512_cvtneps_pbh(e));
            }
            run_sum[flat] += sum_partials(partial);
          }
        } else {
          for (int64_t set = set0; set < set1; ++set) {
            const __m512bh* qp = reinterpret_cast<const __m512bh*>(query_pairs + set * pairs * kLanes);
            const __m512i gather = gathers[set];
            // scores, scaled and masked (keys past the chunk: -inf), and the chunk's max per lane
            __m512 top = _mm512_set1_ps(-INFINITY);
            __m512 block[kKeyBlock];
            auto keep = [&](int64_t j, int keys_in_block) {
              for (int t = 0; t < keys_in_block; ++t) {
                const __m512 s =
                    masked ? _mm512_fmadd_ps(block[t], vscale,
                                             _mm512_permutexvar_ps(gather, _mm512_loadu_ps(mq + (j + t) * kLanes)))
                           : _mm512_mul_ps(block[t], vscale);
                top = _mm512_max_ps(top, s);
                scores[j + t] = s;
              }
            };
            const bool half = lanes_total - set * kLanes <= kLanes / 2;
            const int pair_count = static_cast<int>(pairs);
            int64_t j = 0;
            for (; j + kKeyBlock <= count; j += kKeyBlock) {
              if (set == set0) {  // the hardware prefetcher alone leaves gaps
                const uint16_t* kb = nullptr;
                const uint16_t* vb = nullptr;
                if (c0 + j + kAhead + kKeyBlock <= k1) {
                  kb = keys + (c0 + j + kAhead) * dim;
                  vb = values + (c0 + j + kAhead) * dim;
                } else if (next_keys != nullptr && c0 + j + kAhead - k1 + kKeyBlock <= next_count) {
                  kb = next_keys + (c0 + j + kAhead - k1) * dim;
                  vb = next_values + (c0 + j + kAhead - k1) * dim;
                }
                if (kb != nullptr) {
                  const char* kn = reinterpret_cast<const char*>(kb);
                  const char* vn = reinterpret_cast<const char*>(vb);
                  for (int64_t line = 0; line < kKeyBlock * dim * 2; line += 64) {
                    _mm_prefetch(kn + line, _MM_HINT_T1);
                    _mm_prefetch(vn + line, _MM_HINT_T1);
                  }
                }
              }
              if (half) score_block_half<kKeyBlock>(keys + (c0 + j) * dim, dim, qp, pair_count, block);
              else score_block<kKeyBlock>(keys + (c0 + j) * dim, dim, qp, pair_count, block);
              keep(j, kKeyBlock);
            }
            for (; j < count; ++j) {
              score_block<1>(keys + (c0 + j) * dim, dim, qp, pair_count, block);
              keep(j, 1);
            }
            for (; j < blocks * kLanes; ++j) scores[j] = _mm512_set1_ps(-INFINITY);  // pad keys: weight 0
            alignas(64) float tops[kLanes];
            _mm512_store_ps(tops, top);
            for (int l = 0; l < kLanes; ++l) rescale(set * kLanes + l, tops[l]);  // (padding lanes: finite)
            const int lanes = static_cast<int>(std::min<int64_t>(kLanes, lanes_total - set * kLanes));
            // exponentials as bf16 pairs of keys, summed by key (16 partial sums, as scores by key sum them)
            const __m512 new_max = _mm512_loadu_ps(run_max + set * kLanes);
            __m512 partial[kLanes];
            for (int k = 0; k < kLanes; ++k) partial[k] = _mm512_setzero_ps();
            for (int64_t blk = 0; blk < blocks; ++blk) {
#pragma GCC unroll 8
              for (int t = 0; t < kLanes / 2; ++t) {
                const int64_t jp = blk * kLanes / 2 + t;
                const __m512 e0 = exp_nonpositive(_mm512_sub_ps(scores[2 * jp], new_max));
                const __m512 e1 = exp_nonpositive(_mm512_sub_ps(scores[2 * jp + 1], new_max));
                partial[2 * t] = _mm512_add_ps(partial[2 * t], e0);
                partial[2 * t + 1] = _mm512_add_ps(partial[2 * t + 1], e1);
                _mm512_storeu_si512(pairs_p + jp * pair_stride + set * kLanes, pair_probs(e0, e1));
              }
            }
            alignas(64) float sums[kLanes];
            _mm512_store_ps(sums, sum_partials(partial));
            for (int l = 0; l < lanes; ++l) run_sum[set * kLanes + l] += sums[l];
          }
        }
        // weighted values (an odd last key alone: the pad slot may lie past the buffer)
        const uint16_t* block_values = values + c0 * dim;
        const int64_t whole_pairs = count / 2;
        const int lanes = static_cast<int>(lane1 - lane0);
        const int32_t* task_pairs = pairs_p + lane0 * lane_stride;
        float* task_acc = acc + lane0 * dim;
        const auto weigh = dim == 32 ? weigh_all<2> : dim == 64 ? weigh_all<4> : weigh_all<8>;
        weigh(task_pairs, pair_stride, lane_stride, lanes, block_values, dim, whole_pairs, task_acc);
        if (count % 2) {  // the last key alone: weight its lane's bf16 probability (the pair's first half)
          const uint16_t* v_last = block_values + (count - 1) * dim;
          for (int l = 0; l < lanes; ++l) {
            uint32_t bits = static_cast<uint32_t>(task_pairs[l * lane_stride + whole_pairs * pair_stride]) << 16;
            float w;
            std::memcpy(&w, &bits, sizeof w);
            const __m512 wv = _mm512_set1_ps(w);
            float* row = task_acc + l * dim;
            // raw order within each group of 32 outputs: unpacklo's 16 (d = 8t + 0..3), then unpackhi's
            for (int64_t c = 0; c < dim; c += 32) {
              const __m512i idx_lo = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
              const __m512i idx_hi = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
              const __m512 x0 = bf16x16_to_float(v_last + c), x1 = bf16x16_to_float(v_last + c + 16);
              const __m512 lo = _mm512_permutex2var_ps(x0, idx_lo, x1), hi = _mm512_permutex2var_ps(x0, idx_hi, x1);
              _mm512_storeu_ps(row + c, _mm512_fmadd_ps(wv, lo, _mm512_loadu_ps(row + c)));
              _mm512_storeu_ps(row + c + 16, _mm512_fmadd_ps(wv, hi, _mm512_loadu_ps(row + c + 16)));
            }
          }
        }
      }

      results.finish(lane0, lane1, piece, b, kvh, run_max, run_sum, acc, o, store_row);
    }
  });

  results.combine(call.alive, o, store_row);
}

}  // namespace

DRAFTHEAD_PREFIX_ATTENTION_OP(drafthead_kernels, at::kBFloat16, kMaxQueries, kSplit, attend)
