"""Target runner: any Hugging Face causal LM driven through its public forward, with a DynamicCache.

prefill() runs the prompt; verify() runs a whole draft tree in ONE forward (4D additive float mask, explicit
position ids) while HiddenStateCapture hooks record the head's features; commit() compacts the KV cache to the
accepted path. Masks are built as (B, 1, n, past+n) so batch > 1 can follow; batch 1 is what is used now.
The reference runner: it works for every architecture (sliding windows included); static_runner.py is the fast one,
and make_runner() picks between them.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn as nn
from transformers import DynamicCache

from drafthead.capture import HiddenStateCapture
from drafthead.masks import to_additive
from drafthead.utils import cache_argument

from .static_runner import DEFAULT_BUCKETS, StaticRunner, static_cache_supported


class TargetRunner:
    """Owns the target's KV cache for one generation. `feature_layers`: decoder-layer outputs the head reads."""

    def __init__(self, model: nn.Module, feature_layers: list[int]):
        self.model = model
        self.cache_argument = cache_argument(model)
        self.feature_layers = list(feature_layers)
        self.capture = HiddenStateCapture(model, self.feature_layers).attach()
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.cache = DynamicCache()
        config = model.config.get_text_config(decoder=True)
        # tree masks are full attention: exact for a sliding-window model only while the sequence fits the window
        self.window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None

    def reserve(self, length: int) -> None:
        """Nothing to preallocate: the DynamicCache grows."""

    def reset(self, length: int = 0) -> None:
        """Start a new sequence (the cache grows as needed, so `length` is only a hint)."""
        self.cache = DynamicCache()

    def session(self) -> contextlib.AbstractContextManager:
        """Context for a decoding session (nothing to switch for the eager runner)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Remove the feature hooks from the model."""
        self.capture.detach()

    @property
    def length(self) -> int:
        """Number of tokens in the KV cache."""
        return self.cache.get_seq_length()

    def _forward(self, input_ids, position_ids, attention_mask, logits_to_keep: int = 0):
        with self.capture as cap:
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                **{self.cache_argument: self.cache},
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
            features = cap.stacked(self.feature_layers) if self.feature_layers else None
        self.cache = getattr(out, self.cache_argument)  # the output field carries the input keyword's name
        return out.logits, features

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh cache; run the prompt (1, T). Returns (last logits (1, V), features (1, T, F))."""
        self.cache = DynamicCache()
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        logits, features = self._forward(input_ids, positions, None, logits_to_keep=1)
        odd = {type(layer).__name__ for layer in self.cache.layers} - {"DynamicLayer"}
        if odd:
            raise NotImplementedError(f"tree verification needs full-attention cache layers, target has {odd}")
        return logits[:, -1], features

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, depths: torch.Tensor,
               ancestors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward over the tree after the cached prefix: tokens (1, n) root first, parents before children;
        depths (n,) with the root at 0; ancestors (n, n) bool, node i attends node j. Returns (logits (1, n, V),
        features (1, n, F), argmax of the logits (1, n))."""
        past = self.length
        n = tokens.shape[1]
        if self.window is not None and past + n > self.window:
            raise NotImplementedError(f"sequence of {past + n} tokens exceeds the target's sliding window "
                                      f"({self.window}); tree verification needs full attention")
        allowed = torch.cat([torch.ones(n, past, dtype=torch.bool, device=tokens.device), ancestors], dim=1)
        mask = to_additive(allowed, self.dtype)  # (1, 1, n, past+n)
        positions = (depths + past).unsqueeze(0)  # (1, n)
        logits, features = self._forward(tokens, positions, mask)
        return logits, features, logits.argmax(dim=-1)

    def truncate(self, length: int) -> None:
        """Forget every committed token from position `length` on (a drafter rolling back its rejected drafts)."""
        if length < self.length:
            self.cache.crop(length - self.length)  # transformers: a negative count of tokens to remove

    @torch.inference_mode()
    def commit(self, keep: torch.Tensor, tree_size: int) -> None:
        """Keep the tree positions `keep` (indices into the last verified tree, in order); drop the rest."""
        past = self.length - tree_size
        m = keep.shape[0]
        keep = keep.to(self.device) + past
        for layer in self.cache.layers:
            # layer.keys / layer.values: (B, kv_heads, S, head_dim); gather first (a copy), then write in place
            layer.keys[:, :, past : past + m] = layer.keys.index_select(2, keep)
            layer.values[:, :, past : past + m] = layer.values.index_select(2, keep)
            layer.keys = layer.keys[:, :, : past + m]
            layer.values = layer.values[:, :, : past + m]


def make_runner(model: nn.Module, feature_layers: list[int], kind: str = "auto", compile: bool = False,
                largest_tree: int = 1):
    """The runner of a causal LM: "static" (preallocated buffers, static_runner.py), "eager" (DynamicCache) or
    "auto" (static where the architecture allows it, else eager with a one-line message). largest_tree: the
    largest verification tree (root included) it must take; the static runner's default buckets get one more
    bucket of that size where they stop short of it."""
    if kind in ("auto", "static"):
        reason = static_cache_supported(model)
        if reason is None:
            buckets = DEFAULT_BUCKETS + ((largest_tree,) if largest_tree > DEFAULT_BUCKETS[-1] else ())
            return StaticRunner(model, feature_layers, buckets=buckets, compile=compile)
        if kind == "static":
            raise NotImplementedError(f"the static runner does not support {reason}")
        print(f"drafthead: {type(model).__name__} has {reason}; using the eager runner (DynamicCache)",
              file=sys.stderr)
    return TargetRunner(model, feature_layers)
