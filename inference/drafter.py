"""The drafter protocol: what fills the verification trees of a batch (B rows; batch 1 is B = 1).

The decode loop (decode.py) owns the target runner, the verification rule and the stop handling; a drafter owns
only its own state (a head's KV, a draft model's KV, n-gram indexes) and may read the target runner's buffers:

    begin(runner, input_ids, attention_mask, features)  after the target's prefill of left-padded prompts; features
                                                        (B, T, F): the target's outputs at `feature_layers`, or None
    propose(roots, params, generator) -> DraftTree      roots (B,): each row's last emitted token
    skip(roots)                                         a plain step instead of propose (switch.py): keep up
    accept(accepted, features)                          the runner committed the Accepted paths; features (B, n, F)
    keep_rows(rows)                                     rows finished: keep only `rows` (indices)
    admit(row, runner, ids, features)                   row `row` holds a new prompt (ids (T,), features (T, F))

Trees of one step share a size, which may change from step to step up to `tree_size`; `smallest_tree` (optional,
1 when absent) bounds it from below, and warmup compiles no verify bucket below it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .sampling import SamplingParams
from .tree import DraftTree


@dataclass
class Accepted:
    """One verification's outcome for every row: device tensors padded with -1 after each row's `counts` (0 for a
    finished row), and the same on the host."""

    paths: torch.Tensor  # (B, W) accepted tree indices, root first
    tokens: torch.Tensor  # (B, W) the accepted drafted tokens, then the bonus token (the next root)
    counts: torch.Tensor  # (B,)
    host_paths: list[list[int]]
    host_tokens: list[list[int]]

    @staticmethod
    def from_host(paths: list[list[int]], tokens: list[list[int]], width: int, device: torch.device) -> "Accepted":
        """From each row's host lists, padded with -1 to `width` columns on the device."""
        def padded(rows: list[list[int]]) -> torch.Tensor:
            return torch.tensor([row + [-1] * (width - len(row)) for row in rows], dtype=torch.long).to(device)

        return Accepted(padded(paths), padded(tokens), torch.tensor([len(p) for p in paths]).to(device), paths, tokens)


@runtime_checkable
class Drafter(Protocol):
    """See the module docstring. A subclass inherits a stateless drafter's defaults (no-op methods, root-only trees)."""

    name: str
    tree_size: int = 1  # the largest tree propose() returns (root included): the runner's buffers make room for it
    origin_names: tuple[str, ...] = ()  # bit i of DraftTree.origin = origin_names[i]
    feature_layers: list[int] = []  # target decoder layers whose outputs the drafter reads ([] for none)

    def session(self) -> contextlib.AbstractContextManager:
        """Context around one generation (e.g. a draft model's attention kernel)."""
        return contextlib.nullcontext()

    def begin(self, runner, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              features: torch.Tensor | None) -> None: ...

    def propose(self, roots: torch.Tensor, params: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> DraftTree:
        return DraftTree.chain(roots)

    def skip(self, roots: torch.Tensor) -> None: ...
    def accept(self, accepted: Accepted, features: torch.Tensor | None) -> None: ...
    def keep_rows(self, rows: torch.Tensor) -> None: ...
    def admit(self, row: int, runner, ids: torch.Tensor, features: torch.Tensor | None) -> None: ...


class PlainDrafter(Drafter):
    """Drafts nothing: every tree is the root alone (the engine's own plain decoding baseline)."""

    name = "none"
