"""Per-row KV slots: where each row of a batch keeps a logical position in a fixed KV buffer.

Rows of a batch advance by different amounts, so their entries sit at different buffer slots. Two layouts:

- full: position p at slot p (the buffer holds every position);
- streaming (StreamingLLM; Xiao et al. 2023): the first `sink` positions at slots 0..sink-1, every later position
  in a ring of `window` slots after them, so the buffer holds the attention sinks plus the most recent `window`
  positions and never grows with the context.

`SlotMap.slots` maps positions to slots; `write_rows` writes per-row entries of (B, kv_heads, S, D) buffers with one
advanced-indexing op, whatever the rows' offsets; `keep_leading_rows` moves whole rows of a cache tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotMap:
    """Positions -> slots of a buffer: full (window None) or sink + ring of `window` slots."""

    sink: int = 0
    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and (self.window < 1 or self.sink < 0):
            raise ValueError(f"streaming KV needs window >= 1 and sink >= 0, got sink={self.sink}, "
                             f"window={self.window}")

    @property
    def streaming(self) -> bool:
        return self.window is not None

    def size(self, max_positions: int) -> int:
        """Slots needed to hold positions 0..max_positions-1 (constant sink + window when streaming)."""
        return self.sink + self.window if self.streaming else max_positions

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Slot of each position (any shape, long)."""
        if not self.streaming:
            return positions
        ring = self.sink + (positions - self.sink).remainder(self.window)
        return torch.where(positions < self.sink, positions, ring)

    def needed(self, start: torch.Tensor, stop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions in [start_i, stop_i) of each row that the buffer keeps: all of them (full), or only the
        sinks and the last `window` (streaming). Returns (positions (B, M), valid (B, M) bool), valid ones first."""
        width = max(int((stop - start).max()), 0) if start.numel() else 0
        positions = start[:, None] + torch.arange(width, device=start.device)  # (B, width)
        keep = positions < stop[:, None]
        if self.streaming:
            keep &= (positions < self.sink) | (positions >= stop[:, None] - self.window)
        order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices  # kept positions first
        positions, keep = positions.gather(1, order), keep.gather(1, order)
        m = int(keep.sum(dim=1).max()) if width else 0
        return positions[:, :m], keep[:, :m]


def write_rows(buffer: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor) -> None:
    """Write entries (B, M, H, D) into buffer (B, H, S, D) at each row's own slots (B, M), in place."""
    rows = torch.arange(buffer.shape[0], device=buffer.device).unsqueeze(1)
    buffer[rows, :, slots] = entries


def keep_leading_rows(kv: torch.Tensor, rows: list[int], used: list[slice] | None = None) -> None:
    """Make rows `rows` of a cache tensor kv (2, layers, B, kv_heads, S, D) its leading rows, in that order: row j
    gets what row rows[j] holds (only its slots used[j], when given). Where no row is read after it is overwritten
    (decoding's case: rows from the back move into the places of rows that stopped), each moving row is copied in
    place, reading and writing its entries once; otherwise the moving rows are gathered first (all their slots).
    Rows that stay in place and rows after len(rows) keep what they hold."""
    moved = [j for j, r in enumerate(rows) if r != j]
    if set(moved).isdisjoint(rows[j] for j in moved):
        for j in moved:
            part = slice(None) if used is None else used[j]
            kv[:, :, j, :, part].copy_(kv[:, :, rows[j], :, part])
    elif moved:  # only the rows that move, gathered before any is written
        dst = torch.tensor(moved, device=kv.device)
        kv[:, :, dst] = kv[:, :, torch.tensor([rows[j] for j in moved], device=kv.device)]
