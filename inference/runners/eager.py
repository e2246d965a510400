"""The reference runner: any Hugging Face causal LM through its public forward, with a DynamicCache, one row at a
time, for architectures static buffers cannot serve. Same calls as the static runner; verify() runs a whole draft
tree in ONE forward (4D additive mask, explicit positions), commit() compacts the cache to the accepted path.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn as nn
from transformers import DynamicCache

from drafthead.capture import HiddenStateCapture
from drafthead.masks import to_additive
from drafthead.utils import cache_argument

from ..drafter import Accepted


class EagerRunner:
    """Owns the target's KV cache for one row. `feature_layers`: decoder-layer outputs the head reads."""

    batch = 1

    def __init__(self, model: nn.Module, feature_layers: list[int]):
        self.model = model
        self.cache_argument = cache_argument(model)
        self.feature_layers = list(feature_layers)
        self.capture = HiddenStateCapture(model, self.feature_layers).attach()
        self.close = weakref.finalize(self, self.capture.detach)  # the hooks go with the runner, or on close()
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.start = torch.zeros(1, dtype=torch.long, device=self.device)  # one row, from slot 0
        self.reset(1, 0)
        config = model.config.get_text_config(decoder=True)
        # tree masks are full attention: exact for a sliding-window model only while the sequence fits the window
        self.window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None

    def reset(self, batch: int, length: int) -> None:
        """Start a new sequence (the cache grows as needed, so `length` is only a hint)."""
        if batch != 1:
            raise NotImplementedError(f"{type(self.model).__name__} runs on the eager runner, which decodes one "
                                      f"row at a time; got {batch} rows")
        self.cache, self.capacity = DynamicCache(), length

    def session(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @property
    def length(self) -> torch.Tensor:
        return torch.tensor([self.cache.get_seq_length()], device=self.device)

    positions = length  # one row from position 0: its next position is its length

    def _forward(self, input_ids, position_ids, attention_mask, logits_to_keep: int = 0):
        with self.capture as cap:
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                             **{self.cache_argument: self.cache}, use_cache=True, logits_to_keep=logits_to_keep)
            features = cap.stacked(self.feature_layers) if self.feature_layers else None
        self.cache = getattr(out, self.cache_argument)  # the output field carries the input keyword's name
        return out.logits, features

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """Fresh cache; run the prompt (1, T) (no padding). Returns (last logits (1, V), features (1, T, F))."""
        if attention_mask is not None and not bool(torch.as_tensor(attention_mask).all()):
            raise NotImplementedError("the eager runner takes one unpadded prompt")
        self.cache = DynamicCache()
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        logits, features = self._forward(input_ids, positions, None, logits_to_keep=1)
        odd = {type(layer).__name__ for layer in self.cache.layers} - {"DynamicLayer"}
        if odd:
            raise NotImplementedError(f"tree verification needs full-attention cache layers, target has {odd}")
        return logits[:, -1], features

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor, largest: int = 0):
        """One forward over the tree after the cached prefix: tokens (1, n) root first; depths (1, n); ancestors
        (1, n, n) bool; `largest` unused (no padding). Returns (logits (1, n, V), features (1, n, F), argmax (1, n))."""
        past = self.cache.get_seq_length()
        n = tokens.shape[1]
        if self.window is not None and past + n > self.window:
            raise NotImplementedError(f"sequence of {past + n} tokens exceeds the target's sliding window "
                                      f"({self.window}); tree verification needs full attention")
        allowed = torch.cat([torch.ones(1, n, past, dtype=torch.bool, device=tokens.device), ancestors], dim=2)
        logits, features = self._forward(tokens, depths + past, to_additive(allowed.unsqueeze(1), self.dtype))
        return logits, features, logits.argmax(dim=-1)

    def truncate(self, lengths: torch.Tensor) -> None:
        """Forget every committed token from position lengths[0] on (a draft model rolling back its drafts)."""
        drop = self.cache.get_seq_length() - int(lengths[0])
        if drop > 0:  # (crop(0) may still trim a sliding-window layer's states)
            self.cache.crop(-drop)  # transformers: a negative count of tokens to remove

    def keep_rows(self, rows: torch.Tensor) -> None:
        pass  # one row: it only ever leaves when decoding ends

    def admit(self, row: int, kv) -> None:
        raise NotImplementedError("the eager runner decodes one row: continuous batching needs static buffers")

    @torch.inference_mode()
    def commit(self, accepted: Accepted) -> None:
        """Keep the accepted tree positions (indices into the last verified tree, in order); drop the rest."""
        keep = accepted.host_paths[0]
        m, n = len(keep), accepted.paths.shape[1]  # (n: the verified tree's size)
        past = self.cache.get_seq_length() - n
        index = torch.tensor(keep, device=self.device) + past
        for layer in self.cache.layers:  # (B, kv_heads, S, head_dim): gather first (a copy), then write in place
            layer.keys[:, :, past: past + m] = layer.keys.index_select(2, index)
            layer.values[:, :, past: past + m] = layer.values.index_select(2, index)
        self.cache.crop(m - n)  # transformers: a negative count of tokens to remove (0: none)
