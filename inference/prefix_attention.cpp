// softmax(q·kᵀ·scaling + mask)·v in bf16 for a few queries over the used prefix of a preallocated KV buffer, with
// AVX512-BF16 dot products (vdpbf16ps) and float32 softmax and accumulation.
//
// Decoding and tree verification send 1-16 queries per sequence, and PyTorch's matmuls over a prefix of the
// buffer either read the whole buffer (the unused slots too) or copy the strided prefix first. This kernel reads
// the keys and values of the used slots in place, once per KV head, and never materialises a mask over the whole
// buffer. Grouped-query attention: the query heads of a KV head and the queries share one pass over its keys, 16
// (query head, query) pairs per vector lane set.
//
// Per KV head and lane set:
//   scores[j][lane] = dot(k_j, q_lane) (bf16 pairs, float sums) · scaling + mask[query(lane)][j]
//   probs = exp(scores - max) (float), sums per lane
//   out[lane] = Σ_j probs[j][lane] · v_j (float) / sum[lane], rounded to bf16 once.
// Each output row depends only on its own query, keys and mask row, summed in the same order whatever the number
// of queries: a token's attention does not depend on the tree verified beside it.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;      // (query head, query) pairs per pass over a KV head's keys
constexpr int kMaxQueries = 16; // queries per call (decoding steps and trees; prompts go elsewhere)
constexpr int kKeyBlock = 8;    // keys scored at once (8 accumulators)

inline __m512 bf16x16_to_float(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// e^x for x <= 0 (a softmax's shifted scores): 2^k · p(r), degree-6 polynomial, relative error ~1e-7; exactly 0
// below float's range (masked slots)
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(-87.0f);
  const __mmask16 alive = _mm512_cmp_ps_mask(x, lowest, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lowest);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(alive, _mm512_scalef_ps(p, k));
}

// scores (kKeyBlock keys × 16 lanes) of keys k[0..kKeys) (row stride ldk) against the packed queries qp[pairs]
template <int kKeys>
inline void score_block(const uint16_t* k, int64_t ldk, const __m512bh* qp, int pairs, __m512* out) {
  __m512 acc[kKeys];
  for (int t = 0; t < kKeys; ++t) acc[t] = _mm512_setzero_ps();
  for (int p = 0; p < pairs; ++p) {
    const __m512bh q = qp[p];
#pragma GCC unroll 8
    for (int t = 0; t < kKeys; ++t)
      acc[t] = _mm512_dpbf16_ps(acc[t], q, (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(k + t * ldk + 2 * p)));
  }
  for (int t = 0; t < kKeys; ++t) out[t] = acc[t];
}

// probabilities of two keys as bf16 pairs per lane: pair[lane] = (p0[lane], p1[lane]) (the operand layout of
// vdpbf16ps over two keys)
inline __m512i pair_probs(__m512 p0, __m512 p1) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // p0 in elements 0-15, p1 in 16-31
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, both);
}

// out rows (kRows lanes from lane0) = Σ_j probs[j][lane] · v_j over key pairs (probs as bf16 pairs per lane,
// values interleaved pairwise in registers); kVec = head_dim / 16. Each accumulator holds 16 of a row's outputs in
// the order unpacklo/unpackhi leave them (restored in finish_rows).
template <int kVec, int kRows>
void weigh_values(const int32_t* pairs, int lane0, const uint16_t* v, int64_t ldv, int64_t key_pairs, float* out) {
  __m512 acc[kRows][kVec];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVec; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t jp = 0; jp < key_pairs; ++jp) {
    const uint16_t* v0 = v + 2 * jp * ldv;
    const uint16_t* v1 = v0 + ldv;
    __m512bh vv[kVec];
    for (int c = 0; c < kVec / 2; ++c) {
      const __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
      vv[2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      vv[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    const int32_t* pj = pairs + jp * kLanes + lane0;
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(pj[r]);
      for (int c = 0; c < kVec; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, vv[c]);
    }
  }
  // unpacklo holds d = 8t + {0..3} of each 128-bit lane t, unpackhi 8t + {4..7}: interleave their 4-float groups
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int r = 0; r < kRows; ++r) {
    float* row = out + (lane0 + r) * kVec * 16;
    for (int c = 0; c < kVec; c += 2) {
      _mm512_storeu_ps(row + 16 * c, _mm512_permutex2var_ps(acc[r][c], first, acc[r][c + 1]));
      _mm512_storeu_ps(row + 16 * c + 16, _mm512_permutex2var_ps(acc[r][c], second, acc[r][c + 1]));
    }
  }
}

template <int kVec>
void weigh_all(const int32_t* pairs, int lanes, const uint16_t* v, int64_t ldv, int64_t key_pairs, float* out) {
  constexpr int kRows = 24 / kVec;  // kRows·kVec accumulators + kVec values in 32 registers
  int lane0 = 0;
  for (; lane0 + kRows <= lanes; lane0 += kRows) weigh_values<kVec, kRows>(pairs, lane0, v, ldv, key_pairs, out);
  switch (lanes - lane0) {  // the rest, without idle accumulators
    case 0: break;
#define REST(k) case k: if constexpr (k < kRows) weigh_values<kVec, k>(pairs, lane0, v, ldv, key_pairs, out); break;
    REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7) REST(8) REST(9) REST(10) REST(11)
#undef REST
  }
}

}  // namespace

// query (B, H, n, D) bf16 (any strides), key/value (B, KVH, S, D) bf16 contiguous, mask (B or 1, 1, n, S)
// additive (bf16 or float, any strides), length: the used slots (keys at or after it are not read), rows: the
// leading batch rows in use (later rows get zeros). Returns (B, n, H, D) bf16.
torch::Tensor prefix_attention_bf16(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                    const torch::Tensor& mask, double scaling, const torch::Tensor& length,
                                    const torch::Tensor& rows) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && mask.dim() == 4,
              "prefix_attention_bf16: 4-D query, key, value and mask expected");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                  value.scalar_type() == at::kBFloat16,
              "prefix_attention_bf16: bf16 query, key and value expected");
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous(), "prefix_attention_bf16: contiguous key/value buffers");
  const int64_t batch = query.size(0), heads = query.size(1), n = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1), slots = key.size(2);
  TORCH_CHECK(n <= kMaxQueries, "prefix_attention_bf16: at most ", kMaxQueries, " queries, got ", n);
  TORCH_CHECK(dim == 32 || dim == 64 || dim == 128, "prefix_attention_bf16: head_dim 32, 64 or 128, got ", dim);
  TORCH_CHECK(heads % kv_heads == 0 && key.size(3) == dim && value.sizes() == key.sizes() && key.size(0) == batch,
              "prefix_attention_bf16: shapes do not match: query ", query.sizes(), " key ", key.sizes());
  TORCH_CHECK(mask.size(2) == n && mask.size(3) >= slots && (mask.size(0) == batch || mask.size(0) == 1),
              "prefix_attention_bf16: mask ", mask.sizes(), " for query ", query.sizes(), " and ", slots, " slots");
  const int64_t used = std::min<int64_t>(length.item<int64_t>(), slots);
  const int64_t alive = std::min<int64_t>(rows.item<int64_t>(), batch);
  const int64_t groups = heads / kv_heads, pairs = dim / 2;
  const int64_t lanes_total = groups * n, lane_sets = (lanes_total + kLanes - 1) / kLanes;

  // the mask rows as float, transposed to (mask batch, used, 16): one vector of the queries' entries per key
  TORCH_CHECK(mask.scalar_type() == at::kBFloat16 || mask.scalar_type() == at::kFloat,
              "prefix_attention_bf16: bf16 or float mask expected");
  const int64_t mask_batch = mask.size(0);
  thread_local std::vector<float> mask_buffer;
  mask_buffer.resize(static_cast<size_t>(mask_batch * std::max<int64_t>(used, 1) * kLanes));
  float* mk = mask_buffer.data();
  for (int64_t bm = 0; bm < mask_batch; ++bm)
    for (int64_t i = 0; i < n; ++i) {
      float* dst = mk + bm * used * kLanes + i;
      if (mask.scalar_type() == at::kFloat) {
        const float* src = mask.data_ptr<float>() + bm * mask.stride(0) + i * mask.stride(2);
        for (int64_t j = 0; j < used; ++j) dst[j * kLanes] = src[j * mask.stride(3)];
      } else {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(mask.data_ptr()) + bm * mask.stride(0) + i * mask.stride(2);
        for (int64_t j = 0; j < used; ++j) {
          const uint32_t bits = static_cast<uint32_t>(src[j * mask.stride(3)]) << 16;
          std::memcpy(dst + j * kLanes, &bits, sizeof(float));
        }
      }
    }

  torch::Tensor out = torch::zeros({batch, n, heads, dim}, query.options());
  const uint16_t* q = reinterpret_cast<const uint16_t*>(query.data_ptr());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(key.data_ptr());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(value.data_ptr());
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), qs2 = query.stride(2), qs3 = query.stride(3);
  const int64_t mask_batch_stride = mask.size(0) == 1 ? 0 : used * kLanes;
  const float scale = static_cast<float>(scaling);

  const int64_t key_pairs = (used + 1) / 2;
  at::parallel_for(0, alive * kv_heads * lane_sets, 1, [&](int64_t first, int64_t last) {
    thread_local std::vector<float> scores_buffer;
    thread_local std::vector<int32_t> pairs_buffer;
    scores_buffer.resize(static_cast<size_t>(key_pairs) * 2 * kLanes);
    pairs_buffer.resize(static_cast<size_t>(key_pairs) * kLanes);
    float* scores = scores_buffer.data();
    int32_t* pairs_p = pairs_buffer.data();
    alignas(64) float acc[kLanes * 128];
    alignas(64) __m512bh qp[64];
    alignas(64) int32_t lane_query[kLanes];
    alignas(64) int32_t packed[64][kLanes];
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / (kv_heads * lane_sets), kvh = (task / lane_sets) % kv_heads, set = task % lane_sets;
      const int lanes = static_cast<int>(std::min<int64_t>(kLanes, lanes_total - set * kLanes));
      // pack the lanes' queries as bf16 pairs: qp[p] lane l = (q[2p], q[2p+1]) of (query head, query) l
      for (int l = 0; l < kLanes; ++l) {
        const int64_t flat = set * kLanes + l;
        lane_query[l] = l < lanes ? static_cast<int32_t>(flat % n) : 0;
        const uint16_t* row = l < lanes ? q + b * qs0 + (kvh * groups + flat / n) * qs1 + (flat % n) * qs2 : nullptr;
        for (int64_t p = 0; p < pairs; ++p) {
          uint32_t lo = row ? row[2 * p * qs3] : 0, hi = row ? row[(2 * p + 1) * qs3] : 0;
          packed[p][l] = static_cast<int32_t>(lo | (hi << 16));
        }
      }
      for (int64_t p = 0; p < pairs; ++p) qp[p] = (__m512bh)_mm512_load_si512(packed[p]);
      const __m512i gather = _mm512_load_si512(lane_query);

      // scores, scaled and masked, and their running max per lane
      const uint16_t* keys = kp + (b * kv_heads + kvh) * slots * dim;
      const float* mask_rows = mk + b * mask_batch_stride;
      __m512 best = _mm512_set1_ps(-INFINITY);
      const __m512 vscale = _mm512_set1_ps(scale);
      __m512 block[kKeyBlock];
      auto keep = [&](int64_t j, int count) {  // scale, mask, track the max, store the scores of keys j..j+count
        for (int t = 0; t < count; ++t) {
          const __m512 m = _mm512_permutexvar_ps(gather, _mm512_loadu_ps(mask_rows + (j + t) * kLanes));
          const __m512 s = _mm512_fmadd_ps(block[t], vscale, m);
          best = _mm512_max_ps(best, s);
          _mm512_storeu_ps(scores + (j + t) * kLanes, s);
        }
      };
      int64_t j = 0;
      for (; j + kKeyBlock <= used; j += kKeyBlock) {
        score_block<kKeyBlock>(keys + j * dim, dim, qp, static_cast<int>(pairs), block);
        keep(j, kKeyBlock);
      }
      for (; j < used; ++j) {
        score_block<1>(keys + j * dim, dim, qp, static_cast<int>(pairs), block);
        keep(j, 1);
      }
      if (used % 2) _mm512_storeu_ps(scores + used * kLanes, _mm512_set1_ps(-INFINITY));  // a zero-weight pad key
      // exponentials as bf16 pairs of keys, and their sums per lane
      __m512 total = _mm512_setzero_ps();
      for (int64_t jp = 0; jp < key_pairs; ++jp) {
        const __m512 e0 = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + 2 * jp * kLanes), best));
        const __m512 e1 = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + (2 * jp + 1) * kLanes), best));
        total = _mm512_add_ps(total, _mm512_add_ps(e0, e1));
        _mm512_storeu_si512(pairs_p + jp * kLanes, pair_probs(e0, e1));
      }
      // weighted values (an odd last key is paired with zeros: the pad slot may lie past the buffer)
      const uint16_t* values = vp + (b * kv_heads + kvh) * slots * dim;
      const int64_t whole_pairs = used / 2;
      if (dim == 32) weigh_all<2>(pairs_p, lanes, values, dim, whole_pairs, acc);
      else if (dim == 64) weigh_all<4>(pairs_p, lanes, values, dim, whole_pairs, acc);
      else weigh_all<8>(pairs_p, lanes, values, dim, whole_pairs, acc);
      if (used % 2) {  // the last key alone: weight its lane's bf16 probability (the pair's first half)
        const uint16_t* v_last = values + (used - 1) * dim;
        const int32_t* p_last = pairs_p + whole_pairs * kLanes;
        for (int l = 0; l < lanes; ++l) {
          uint32_t bits = static_cast<uint32_t>(p_last[l]) << 16;
          float w;
          std::memcpy(&w, &bits, sizeof w);
          const __m512 wv = _mm512_set1_ps(w);
          for (int64_t c = 0; c < dim; c += 16) {
            __m512 a = _mm512_loadu_ps(acc + l * dim + c);
            _mm512_storeu_ps(acc + l * dim + c, _mm512_fmadd_ps(wv, bf16x16_to_float(v_last + c), a));
          }
        }
      }
      alignas(64) float totals[kLanes];
      _mm512_store_ps(totals, total);
      for (int l = 0; l < lanes; ++l) {
        const int64_t flat = set * kLanes + l;
        const __m512 inv = _mm512_set1_ps(1.0f / totals[l]);
        uint16_t* dst = o + ((b * n + flat % n) * heads + kvh * groups + flat / n) * dim;
        for (int64_t c = 0; c < dim; c += 16) {
          const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(acc + l * dim + c), inv);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), (__m256i)_mm512_cvtneps_pbh(x));
        }
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(drafthead_kernels, m) {
  m.def("prefix_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scaling, Tensor length, "
        "Tensor rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(drafthead_kernels, CPU, m) {
  m.impl("prefix_attention", &prefix_attention_bf16);
}
