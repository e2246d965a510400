"""Self-speculation with a StreamingLLM draft (MagicDec; Chen et al. 2024).

The target drafts for itself: a chain of `gamma` tokens, each one forward of the target attending only a
constant-size KV — the first `sink` positions (attention sinks) plus the most recent `window` positions — then the
full-KV target verifies the chain as usual (greedy, or lossless speculative sampling with the draft's q). Once the
context is long, each step of the full target reads far more KV than weights, while a draft step reads only
sink + window entries, so drafting stays cheap however long the context grows.

The draft keeps its own buffers (sink + window + gamma slots per row, constant in the context length: slots.py's
streaming layout). They are never computed by the draft itself: after every verification the newly committed
entries are copied from the target's full buffers, so the draft always holds the target's exact KV for the
positions it keeps; only its drafted tokens (written in scratch slots after the ring) are its own.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import StaticCache

from .batch_runner import forward_on_cache, keep_cache_rows
from .batch_tree import BatchTree
from .sampling import SamplingParams, target_probs
from .slots import SlotMap, read_rows, write_rows
from .static_runner import static_cache


class StreamingSelfDrafter:
    """A batched drafter (batch_tree.BatchDrafter): the target with a StreamingLLM KV drafts chains of `gamma`."""

    name = "self"
    feature_layers: list[int] = []

    def __init__(self, model: nn.Module, sink: int = 4, window: int = 512, gamma: int = 3):
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.model = model
        self.layout = SlotMap(sink, window)
        self.gamma = gamma
        self.tree_size = gamma + 1
        self.scratch = self.layout.size(0)  # first draft slot, after the sinks and the ring
        self.capacity = self.scratch + gamma + 1  # + one dummy slot for padded copies
        self.cache: StaticCache | None = None
        self.slot_pos: torch.Tensor | None = None  # (B, capacity) position held by each slot, -1 if none
        self.runner = None
        self.drafted_from: torch.Tensor | None = None  # (B,) the root position of the last chain

    @property
    def dummy(self) -> int:
        return self.capacity - 1

    @property
    def kv_shape(self) -> tuple[int, ...]:
        """Shape of one layer's draft key buffer (B, kv_heads, sink + window + gamma + 1, head_dim)."""
        return tuple(self.cache.layers[0].keys.shape)

    def begin(self, runner, input_ids, attention_mask, features) -> None:
        """Fresh draft buffers for the runner's rows, filled with the prompt's sinks and last `window` entries."""
        self.runner = runner
        b = runner.batch
        self.cache = static_cache(self.model, b, self.capacity)
        self.slot_pos = torch.full((b, self.capacity), -1, dtype=torch.long, device=runner.device)
        self._refresh(torch.zeros_like(runner.positions), runner.positions)

    def _refresh(self, start: torch.Tensor, stop: torch.Tensor) -> None:
        """Copy each row's committed positions [start_i, stop_i) that the layout keeps from the target's buffers."""
        positions, valid = self.layout.needed(start, stop)
        if positions.shape[1] == 0:
            return
        src = torch.where(valid, self.runner.slots_of(positions), self.runner.scratch)
        dst = torch.where(valid, self.layout.slots(positions), self.dummy)
        for (keys, values), layer in zip(self.runner.layers(), self.cache.layers):
            write_rows(layer.keys, dst, read_rows(keys, src))
            write_rows(layer.values, dst, read_rows(values, src))
        self.slot_pos.scatter_(1, dst, torch.where(valid, positions, -1))
        self.slot_pos[:, self.dummy] = -1

    @torch.inference_mode()
    def propose(self, roots: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> BatchTree:
        b = roots.shape[0]
        self.drafted_from = self.runner.positions
        held = self.slot_pos >= 0  # (B, capacity): every held position precedes the root
        tokens, drafted, qs = roots.view(b, 1), [], []
        for d in range(self.gamma):
            allowed = held.clone()
            allowed[:, self.scratch: self.scratch + d + 1] = True  # the chain so far, itself included
            out = forward_on_cache(self.model, self.cache, tokens, (self.drafted_from + d)[:, None],
                                   allowed[:, None, :], self.scratch + d, self.capacity, keep=1)
            logits = out.logits[:, -1]  # (B, V)
            if params.do_sample:
                q = target_probs(logits, params)  # (B, V)
                tokens = torch.multinomial(q, 1, generator=generator)
                qs.append(q)
            else:
                tokens = logits.argmax(dim=-1, keepdim=True)
            drafted.append(tokens)
        return BatchTree.chain(roots, torch.cat(drafted, dim=1), torch.stack(qs, dim=1) if qs else None)

    def accept(self, paths, new_tokens, features) -> None:
        """The runner has committed each row's accepted path: copy those entries into the draft buffers."""
        self._refresh(self.drafted_from, self.runner.positions)

    def keep_rows(self, rows: torch.Tensor) -> None:
        keep_cache_rows(self.cache, rows)
        self.slot_pos = self.slot_pos[rows]
