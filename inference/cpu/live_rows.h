// The rows of a small linear's input that are computed: a batch whose later rows have stopped decoding still
// passes all of its rows (a compiled step keeps its shapes), with `live` (0-dim int64, optional) saying how many
// leading entries of x's first dimension are still decoding. Their rows of the flattened (M, K) input come first.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

// rows of the flattened input (m_total of them) that belong to the first `live` entries of x's dimension 0
inline int64_t live_rows(const torch::Tensor& x, int64_t m_total, const c10::optional<torch::Tensor>& live) {
  if (!live.has_value() || !live->defined() || x.dim() < 2 || x.size(0) == 0) return m_total;
  TORCH_CHECK(live->scalar_type() == at::kLong && live->numel() == 1 && live->device().is_cpu(),
              "live: a one-element int64 CPU tensor expected");
  const int64_t entries = std::clamp<int64_t>(*live->data_ptr<int64_t>(), 0, x.size(0));  // (no dispatch: a read)
  return entries * (m_total / x.size(0));
}
