// The last pass of the prefix-attention kernels over a long context: each (row, KV head, lane) was computed span by
// span (a task per span of keys, so that the threads share one long row); the spans' partial results (running max,
// running sum, unnormalised weighted values) are combined here in span order, as one softmax over every key.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

// span_max / span_sum (rows * kv_heads * spans, lanes_pad), span_acc (..., dim): the spans' partial results; lane
// `flat` of (row b, KV head kvh) is query flat % n of head kvh * groups + flat / n. store(raw, dim, scale, dst)
// writes one output row (the kernel's dtype).
template <typename Out, typename Store>
void combine_spans(int64_t alive, int64_t kv_heads, int64_t lanes, int64_t lanes_pad, int64_t spans, int64_t dim,
                   int64_t n, int64_t heads, int64_t groups, const std::vector<float>& span_max,
                   const std::vector<float>& span_sum, const std::vector<float>& span_acc, Out* o, Store store) {
  at::parallel_for(0, alive * kv_heads * lanes, 1, [&](int64_t first, int64_t last) {
    alignas(64) float sums[128];
    for (int64_t item = first; item < last; ++item) {
      const int64_t bh = item / lanes, flat = item % lanes;
      const int64_t b = bh / kv_heads, kvh = bh % kv_heads;
      float best = -INFINITY;
      for (int64_t s = 0; s < spans; ++s) best = std::max(best, span_max[(bh * spans + s) * lanes_pad + flat]);
      float total = 0.0f;
      for (int64_t c = 0; c < dim; ++c) sums[c] = 0.0f;
      for (int64_t s = 0; s < spans; ++s) {
        const int64_t at = (bh * spans + s) * lanes_pad + flat;
        const float m = span_max[at];
        const float w = m == -INFINITY ? 0.0f : std::exp(m - best);
        if (w == 0.0f) continue;
        total += w * span_sum[at];
        const float* part = span_acc.data() + at * dim;
        for (int64_t c = 0; c < dim; ++c) sums[c] += w * part[c];
      }
      store(sums, dim, 1.0f / total, o + ((b * n + flat % n) * heads + kvh * groups + flat / n) * dim);
    }
  });
}

// Lanes [lane0, lane1) of one task (row b, KV head kvh, span `piece`) are done: with one span their output rows,
// else their partial results (run_max, run_sum, acc rows of dim floats) wait for combine_spans.
template <typename Out, typename Store>
void finish_lanes(int64_t lane0, int64_t lane1, int64_t piece, int64_t b, int64_t kvh, int64_t spans,
                  int64_t lanes_pad, int64_t dim, int64_t n, int64_t heads, int64_t groups, const float* run_max,
                  const float* run_sum, const float* acc, std::vector<float>& span_max, std::vector<float>& span_sum,
                  std::vector<float>& span_acc, Out* o, Store store) {
  for (int64_t lane = lane0; lane < lane1; ++lane) {
    if (spans == 1) {
      store(acc + lane * dim, dim, 1.0f / run_sum[lane],
            o + ((b * n + lane % n) * heads + kvh * groups + lane / n) * dim);
    } else {
      span_max[piece * lanes_pad + lane] = run_max[lane];
      span_sum[piece * lanes_pad + lane] = run_sum[lane];
      std::copy(acc + lane * dim, acc + (lane + 1) * dim, span_acc.data() + (piece * lanes_pad + lane) * dim);
    }
  }
}

// The op's schema, the same for both kernel libraries (the bf16 one and the float32 one).
#define DRAFTHEAD_PREFIX_ATTENTION_OP(library, function)                                                            \
  TORCH_LIBRARY_FRAGMENT(library, m) {                                                                              \
    m.def("prefix_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scaling, Tensor length, "     \
          "Tensor rows) -> Tensor");                                                                                \
  }                                                                                                                 \
  TORCH_LIBRARY_IMPL(library, CPU, m) { m.impl("prefix_attention", &function); }
