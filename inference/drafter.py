"""The drafter protocol: what fills the verification trees of a batch (B rows; batch 1 is B = 1).

The decode loop (decode.py) owns the target runner, the verification rule (verify.py) and the stop handling; a
drafter owns only its own state (a head's KV, a draft model's KV, n-gram indexes) and may read the target runner's
buffers (a self-speculative draft refreshes its KV from them):

    begin(runner, input_ids, attention_mask, features)  after the target's prefill of left-padded prompts; features
                                                        (B, T, F): the target's outputs at `feature_layers`, or None
    propose(roots, params, generator) -> DraftTree      roots (B,): each row's last emitted token
    skip(roots)                                         a plain step instead of propose (switch.py): keep up
    accept(accepted, features)                          the runner committed the Accepted paths; features (B, n, F)
    keep_rows(rows)                                     rows finished: keep only `rows` (indices)
    admit(row, runner, ids, features)                   row `row` holds a new prompt (ids (T,), features (T, F))

A proposed DraftTree (tree.py) holds each row's tokens, parents, depths and ancestors; for speculative sampling
with a stochastic drafter also `q`, the distribution each node was drawn from (deterministic drafters leave it None:
their nodes are point masses); and optionally `origin`, a bit mask per node naming the drafters (`origin_names`)
that proposed it, for per-drafter acceptance statistics. Trees of one step share a size; the size may change from
step to step (the runner pads it to its next verify bucket), up to `tree_size`; a drafter whose trees never go
below a size may say so in `smallest_tree` (optional, 1 when absent), and warmup compiles no bucket below it.

Drafters: PlainDrafter (here: no draft, plain decoding), HeadDrafter (eagle.py, an EAGLE head's dynamic trees,
full or windowed KV), LookupBranch (lookup.py: prompt lookup alone, or beside another drafter's trees),
DraftModelDrafter (draft_model.py) and StreamingSelfDrafter (self_draft.py, MagicDec).
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
    """One verification's outcome for every row: device tensors padded with -1 after each row's `counts`, and the
    same on the host (the loop's one transfer of the step). A finished row has count 0."""

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

        return Accepted(padded(paths), padded(tokens), torch.tensor([len(p) for p in paths]).to(device), paths,
                        tokens)


@runtime_checkable
class Drafter(Protocol):
    """See the module docstring. A class that subclasses it inherits the defaults of a drafter without state: no
    session, and begin, skip, accept, keep_rows and admit doing nothing."""

    name: str
    tree_size: int  # the largest tree propose() returns (root included): the runner's buffers make room for it
    origin_names: tuple[str, ...]  # bit i of DraftTree.origin = origin_names[i]

    @property
    def feature_layers(self) -> list[int]:
        """Target decoder layers whose outputs the drafter reads ([] for none)."""
        ...

    def session(self) -> contextlib.AbstractContextManager:
        """Context around one generation (a draft model's attention kernel, as the target runner's session)."""
        return contextlib.nullcontext()

    def begin(self, runner, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              features: torch.Tensor | None) -> None: ...

    def propose(self, roots: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> DraftTree: ...

    def skip(self, roots: torch.Tensor) -> None: ...

    def accept(self, accepted: Accepted, features: torch.Tensor | None) -> None: ...

    def keep_rows(self, rows: torch.Tensor) -> None: ...

    def admit(self, row: int, runner, ids: torch.Tensor, features: torch.Tensor | None) -> None: ...


class PlainDrafter(Drafter):
    """Drafts nothing: every tree is the root alone, so the loop decodes one token per target step (the engine's
    own plain decoding, the baseline that separates what the runner buys from what speculation buys)."""

    name = "none"
    tree_size = 1
    origin_names: tuple[str, ...] = ()
    feature_layers: list[int] = []

    def propose(self, roots, params=None, generator=None) -> DraftTree:
        return DraftTree.chain(roots)
