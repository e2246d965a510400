"""Verification trees for a batch, and the batched drafter protocol.

A BatchTree holds one tree per row, all of the same size n (each drafter proposes a fixed shape), so the target
verifies every row's tree in one forward. `row(i)` is row i's DraftTree (tree.py) for the per-row verification
rule (verify.py).

The batched drafter protocol mirrors drafter.Drafter with a batch axis, and lets a drafter read the target
runner's buffers (a self-speculative draft refreshes its own KV from them):

    drafter.begin(runner, input_ids, attention_mask, features)  after the target's prefill
    tree = drafter.propose(roots, params, generator)           roots (B,): each row's last emitted token
    drafter.skip(roots)                                        instead of propose: a plain step (only the roots
                                                               are verified; batch_switch.py), the drafter keeps
                                                               up with the committed tokens
    drafter.accept(paths, new_tokens, features)                after the runner committed the accepted paths
    drafter.keep_rows(rows)                                    rows finished: keep only `rows` (indices)
    drafter.admit(row, runner, ids, features)                  row `row` holds a new prompt (ids (T,)) in the
                                                               runner, its features (T, F) or None
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .sampling import SamplingParams
from .tree import DraftTree


@dataclass
class BatchTree:
    """One tree per row, parents before children in every row."""

    tokens: torch.Tensor  # (B, n) target token ids, root first
    parents: torch.Tensor  # (B, n) parent index, -1 at the root
    depths: torch.Tensor  # (B, n)
    ancestors: torch.Tensor  # (B, n, n) bool: j is i or an ancestor of i
    q: torch.Tensor | None = None  # (B, n, V) the distribution each node was sampled from (None: point masses)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def row(self, i: int) -> DraftTree:
        """Row i as a single tree."""
        q = self.q[i] if self.q is not None else None
        return DraftTree(self.tokens[i: i + 1], self.parents[i], self.depths[i], self.ancestors[i], q=q)

    @staticmethod
    def chain(roots: torch.Tensor, drafted: torch.Tensor | None = None, q: torch.Tensor | None = None) -> "BatchTree":
        """Every row a chain: its root, then drafted (B, γ) each the child of the one before; q (B, γ, V) the
        distribution each drafted token was sampled from. No drafts: plain decoding."""
        b = roots.shape[0]
        if drafted is None:
            drafted = roots.new_zeros(b, 0)
        n = 1 + drafted.shape[1]
        device = roots.device
        line = torch.arange(n, device=device)
        tree = BatchTree(torch.cat([roots.view(b, 1), drafted], dim=1), (line - 1).expand(b, n),
                         line.expand(b, n), torch.ones(n, n, dtype=torch.bool, device=device).tril().expand(b, n, n))
        if q is not None:  # row 0 (the root) is never read
            tree.q = torch.cat([torch.zeros_like(q[:, :1]), q], dim=1)
        return tree


class BatchDrafter(Protocol):
    """See the module docstring."""

    name: str
    tree_size: int  # nodes of every tree, root included

    @property
    def feature_layers(self) -> list[int]: ...

    def begin(self, runner, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              features: torch.Tensor | None) -> None: ...

    def propose(self, roots: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> BatchTree: ...

    def skip(self, roots: torch.Tensor) -> None: ...

    def accept(self, paths: list[torch.Tensor], new_tokens: list[torch.Tensor],
               features: torch.Tensor | None) -> None: ...

    def keep_rows(self, rows: torch.Tensor) -> None: ...

    def admit(self, row: int, runner, ids: torch.Tensor, features: torch.Tensor | None) -> None: ...


class PlainBatchDrafter:
    """No drafts: plain batched decoding on the batch runner (the baseline)."""

    name = "none"
    tree_size = 1
    feature_layers: list[int] = []

    def begin(self, runner, input_ids, attention_mask, features) -> None:
        pass

    def propose(self, roots, params, generator=None) -> BatchTree:
        return BatchTree.chain(roots)

    def skip(self, roots) -> None:
        pass

    def accept(self, paths, new_tokens, features) -> None:
        pass

    def keep_rows(self, rows) -> None:
        pass

    def admit(self, row, runner, ids, features) -> None:
        pass
