"""Target runners: the static runner (preallocated KV buffers, B rows, fixed-shape steps, optionally compiled) and
the eager reference runner (any causal LM, one row, DynamicCache)."""

from __future__ import annotations

import sys

import torch.nn as nn

from .eager import EagerRunner
from .kv import static_cache_supported
from .static import DEFAULT_BUCKETS, StaticRunner


def make_runner(model: nn.Module, feature_layers: list[int], kind: str = "auto", compile: bool = False,
                largest_tree: int = 1):
    """The runner of a causal LM: "static", "eager" or "auto" (static where the architecture allows it, else eager
    with a one-line message). largest_tree (root included) is added as a bucket where the default ones stop short."""
    reason = static_cache_supported(model)
    if kind == "static" or (kind == "auto" and reason is None):  # StaticRunner refuses what it cannot serve
        buckets = DEFAULT_BUCKETS + ((largest_tree,) if largest_tree > DEFAULT_BUCKETS[-1] else ())
        return StaticRunner(model, feature_layers, compile=compile, buckets=buckets)
    if kind == "auto":
        print(f"drafthead: {type(model).__name__} has {reason}; using the eager runner (DynamicCache)", file=sys.stderr)
    return EagerRunner(model, feature_layers)


__all__ = ["EagerRunner", "StaticRunner", "make_runner"]
