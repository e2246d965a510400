"""Preallocated KV buffers: transformers' StaticCache with every layer in one tensor, and per-row slots (rows of a
batch advance by different amounts, so their entries sit at different slots of a fixed buffer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers import StaticCache


@dataclass(frozen=True)
class SlotMap:
    """Positions -> slots of a buffer: full (window None), position p at slot p; or streaming (StreamingLLM; Xiao et
    al. 2023), the first `sink` positions at slots 0..sink-1, each later one in a ring of `window` slots after them,
    so the buffer never grows with the context."""

    sink: int = 0
    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and (self.window < 1 or self.sink < 0):
            raise ValueError(f"streaming KV needs window >= 1 and sink >= 0, got sink={self.sink}, "
                             f"window={self.window}")

    def size(self, max_positions: int) -> int:
        """Slots needed to hold positions 0..max_positions-1 (constant sink + window when streaming)."""
        return max_positions if self.window is None else self.sink + self.window

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Slot of each position (any shape, long)."""
        if self.window is None:
            return positions
        return torch.where(positions < self.sink, positions, self.sink + (positions - self.sink).remainder(self.window))

    def needed(self, start: torch.Tensor, stop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions in [start_i, stop_i) of each row that the buffer keeps: all of them (full), or only the
        sinks and the last `window` (streaming). Returns (positions (B, M), valid (B, M) bool), valid ones first."""
        width = max(int((stop - start).max()), 0) if start.numel() else 0
        positions = start[:, None] + torch.arange(width, device=start.device)  # (B, width)
        keep = positions < stop[:, None]
        if self.window is not None:
            keep &= (positions < self.sink) | (positions >= stop[:, None] - self.window)
        order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices  # kept positions first
        positions, keep = positions.gather(1, order), keep.gather(1, order)
        m = int(keep.sum(dim=1).max()) if width else 0
        return positions[:, :m], keep[:, :m]


def keep_leading_rows(kv: torch.Tensor, rows: list[int], used: list[slice] | None = None) -> None:
    """Make rows `rows` of a cache tensor kv (2, layers, B, kv_heads, S, D) its leading rows, in that order: row j
    gets what row rows[j] holds (only its slots used[j], when given). Where no moving row is read after it is
    overwritten (decoding's case), each is copied in place; otherwise they are gathered first (all their slots).
    Rows that stay in place and rows after len(rows) keep what they hold."""
    moved = [j for j, r in enumerate(rows) if r != j]
    if set(moved).isdisjoint(rows[j] for j in moved):
        for j in moved:
            part = slice(None) if used is None else used[j]
            kv[:, :, j, :, part].copy_(kv[:, :, rows[j], :, part])
    elif moved:  # only the rows that move, gathered before any is written
        dst = torch.tensor(moved, device=kv.device)
        kv[:, :, dst] = kv[:, :, torch.tensor([rows[j] for j in moved], device=kv.device)]


MIN_CAPACITY, CAPACITY_STEP = 256, 128


def static_cache_supported(model: nn.Module) -> str | None:
    """None if the model can run on static buffers, else the reason (sliding-window or non-attention layers)."""
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"sliding-window attention (window {config.sliding_window})"
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    return f"layer types {sorted(kinds)}" if kinds != {"full_attention"} else None


def buffer_capacity(need: int) -> int:
    """Slots of a KV buffer holding `need` tokens, kept tight (attention may read all of it)."""
    return max(MIN_CAPACITY, -(-need // CAPACITY_STEP) * CAPACITY_STEP)


def static_cache(model: nn.Module, batch: int, capacity: int) -> StaticCache:
    """transformers' StaticCache for `batch` rows of `capacity` slots, allocated now (so a compiled step sees fixed
    addresses from its first call). Every layer's keys and values are views of ONE tensor, `cache.drafthead_kv`
    (2, layers, batch, kv_heads, capacity, head_dim), and every layer's write position a view of
    `cache.drafthead_lengths` (layers,): moving accepted slots and setting the write slot are one op each."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    ref = next(model.parameters())
    cache = StaticCache(config=config, max_cache_len=capacity)
    cache.early_initialization(batch, heads, head_dim, ref.dtype, ref.device)
    kv = torch.zeros(2, len(cache.layers), batch, heads, capacity, head_dim, dtype=ref.dtype, device=ref.device)
    # each layer's length 16 bytes apart: CUDA graphs keep a fixed address only for an aligned input, and treat a
    # misaligned one written in place as a mutated input (the graph is skipped)
    lengths = torch.zeros(len(cache.layers), 16, dtype=torch.uint8, device=ref.device)
    lengths = lengths.view(cache.layers[0].cumulative_length.dtype)[:, 0]
    for i, layer in enumerate(cache.layers):
        layer.keys, layer.values, layer.cumulative_length = kv[0, i], kv[1, i], lengths[i]
        for t in (layer.keys, layer.values, layer.cumulative_length):  # as StaticLayer does (CUDA graphs)
            torch._dynamo.mark_static_address(t)
    cache.drafthead_kv, cache.drafthead_lengths = kv, lengths
    return cache


def set_write_slot(cache: StaticCache, slot: int) -> None:
    """The next tokens a forward writes into `cache` land at slots slot, slot+1, ... of every layer."""
    cache.drafthead_lengths.fill_(slot)
