// What the two prefix-attention kernels (bf16 and float32) share outside their arithmetic: the checks of their
// arguments, and the last pass over a long context, whose (row, KV head, lane) results were computed span by span
// (a task per span of keys, so that the threads share one long row) and are combined here in span order, as one
// softmax over every key.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

// One call's sizes, after checking its arguments: query (B, H, n, D) (any strides), key/value (B, KVH, S, D)
// contiguous, all of `dtype`, mask (B or 1, 1, n, >= S) additive, of `dtype` or float; length (0-dim): the used
// slots, rows (0-dim): the leading batch rows in use; `spans` of `split` keys cover the used slots. `out`
// (B, n, H, D) of `dtype` starts as zeros (rows past `alive` stay so).
struct PrefixCall {
  int64_t batch, heads, n, dim, kv_heads, slots, used, alive, groups, spans;
  torch::Tensor out;

  PrefixCall(const char* name, const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
             const torch::Tensor& mask, const torch::Tensor& length, const torch::Tensor& rows, at::ScalarType dtype,
             int64_t max_queries, int64_t split) {
    TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && mask.dim() == 4, name,
                ": 4-D query, key, value and mask expected");
    TORCH_CHECK(key.is_contiguous() && value.is_contiguous(), name, ": contiguous key/value buffers");
    batch = query.size(0), heads = query.size(1), n = query.size(2), dim = query.size(3);
    kv_heads = key.size(1), slots = key.size(2);
    TORCH_CHECK(n <= max_queries, name, ": at most ", max_queries, " queries, got ", n);
    TORCH_CHECK(dim == 32 || dim == 64 || dim == 128, name, ": head_dim 32, 64 or 128, got ", dim);
    TORCH_CHECK(heads % kv_heads == 0 && key.size(3) == dim && value.sizes() == key.sizes() && key.size(0) == batch,
                name, ": shapes do not match: query ", query.sizes(), " key ", key.sizes());
    TORCH_CHECK(mask.size(2) == n && mask.size(3) >= slots && (mask.size(0) == batch || mask.size(0) == 1), name,
                ": mask ", mask.sizes(), " for query ", query.sizes(), " and ", slots, " slots");
    TORCH_CHECK(query.scalar_type() == dtype && key.scalar_type() == dtype && value.scalar_type() == dtype &&
                    (mask.scalar_type() == dtype || mask.scalar_type() == at::kFloat),
                name, ": ", dtype, " query, key and value and a ", dtype, " or float mask expected");
    used = std::min<int64_t>(length.item<int64_t>(), slots);
    alive = std::min<int64_t>(rows.item<int64_t>(), batch);
    groups = heads / kv_heads;
    spans = std::max<int64_t>(1, (used + split - 1) / split);
    out = torch::zeros({batch, n, heads, dim}, query.options());
  }

  bool empty() const { return used == 0 || alive == 0; }
};

// The partial results of every (row, KV head, span): each lane's running max and sum and its unnormalised weighted
// values (dim floats). Lane `lane` of (row b, KV head kvh) is query lane % n of head kvh * groups + lane / n; lanes
// are laid out `lanes_pad` apart. With one span nothing is kept: finish() writes the output rows at once.
struct SpanResults {
  int64_t kv_heads, lanes, lanes_pad, spans, dim, n, heads, groups;
  std::vector<float> max, sum, acc;

  SpanResults(const PrefixCall& call, int64_t lanes, int64_t lanes_pad)
      : kv_heads(call.kv_heads), lanes(lanes), lanes_pad(lanes_pad), spans(call.spans), dim(call.dim), n(call.n),
        heads(call.heads), groups(call.groups) {
    if (spans > 1) {
      const size_t pieces = static_cast<size_t>(call.alive * kv_heads * spans * lanes_pad);
      max.resize(pieces);
      sum.resize(pieces);
      acc.resize(pieces * static_cast<size_t>(dim));
    }
  }

  int64_t output_row(int64_t b, int64_t kvh, int64_t lane) const {
    return ((b * n + lane % n) * heads + kvh * groups + lane / n) * dim;
  }

  // lanes [lane0, lane1) of task `piece` (row b, KV head kvh, one span) are done: run_max, run_sum per lane and
  // acc_rows (dim floats a lane); store(raw, dim, scale, dst) writes one output row in the kernel's dtype
  template <typename Out, typename Store>
  void finish(int64_t lane0, int64_t lane1, int64_t piece, int64_t b, int64_t kvh, const float* run_max,
              const float* run_sum, const float* acc_rows, Out* o, Store store) {
    for (int64_t lane = lane0; lane < lane1; ++lane) {
      if (spans == 1) {
        store(acc_rows + lane * dim, dim, 1.0f / run_sum[lane], o + output_row(b, kvh, lane));
      } else {
        max[piece * lanes_pad + lane] = run_max[lane];
        sum[piece * lanes_pad + lane] = run_sum[lane];
        std::copy(acc_rows + lane * dim, acc_rows + (lane + 1) * dim, acc.data() + (piece * lanes_pad + lane) * dim);
      }
    }
  }

  // with several spans: each (row, KV head, lane) of the `alive` rows combined over its spans, in span order
  template <typename Out, typename Store>
  void combine(int64_t alive, Out* o, Store store) const {
    if (spans == 1) return;
    at::parallel_for(0, alive * kv_heads * lanes, 1, [&](int64_t first, int64_t last) {
      alignas(64) float sums[128];
      for (int64_t item = first; item < last; ++item) {
        const int64_t bh = item / lanes, lane = item % lanes;
        float best = -INFINITY;
        for (int64_t s = 0; s < spans; ++s) best = std::max(best, max[(bh * spans + s) * lanes_pad + lane]);
        float total = 0.0f;
        for (int64_t c = 0; c < dim; ++c) sums[c] = 0.0f;
        for (int64_t s = 0; s < spans; ++s) {
          const int64_t at = (bh * spans + s) * lanes_pad + lane;
          const float w = max[at] == -INFINITY ? 0.0f : std::exp(max[at] - best);
          if (w == 0.0f) continue;
          total += w * sum[at];
          const float* part = acc.data() + at * dim;
          for (int64_t c = 0; c < dim; ++c) sums[c] += w * part[c];
        }
        store(sums, dim, 1.0f / total, o + output_row(bh / kv_heads, bh % kv_heads, lane));
      }
    });
  }
};

// The prefix_attention op of one kernel library (the same schema for both): its arguments checked (PrefixCall), then
// attend(call, query, key, value, mask, scaling) writes the alive rows of call.out.
#define DRAFTHEAD_PREFIX_ATTENTION_OP(library, dtype, max_queries, split, attend)                                  \
  namespace {                                                                                                       \
  torch::Tensor prefix_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,  \
                                 const torch::Tensor& mask, double scaling, const torch::Tensor& length,          \
                                 const torch::Tensor& rows) {                                                     \
    const PrefixCall call(#library "::prefix_attention", query, key, value, mask, length, rows, dtype, max_queries, \
                          split);                                                                                   \
    if (!call.empty()) attend(call, query, key, value, mask, scaling);                                              \
    return call.out;                                                                                                \
  }                                                                                                                 \
  }                                                                                                                 \
  TORCH_LIBRARY_FRAGMENT(library, m) {                                                                              \
    m.def("prefix_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scaling, Tensor length, "     \
          "Tensor rows) -> Tensor");                                                                                \
  }                                                                                                                 \
  TORCH_LIBRARY_IMPL(library, CPU, m) { m.impl("prefix_attention", &prefix_attention); }
