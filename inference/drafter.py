"""The drafter protocol: what fills the verification tree.

The generator owns the target runner, the verification rule (verify.py), KV compaction and stop handling; a
drafter owns only its own state and answers three calls per sequence:

    drafter.begin(input_ids, features, max_length)   after the target's prefill; features: the target's hidden
                                                      states at `feature_layers` over the prompt (None if none)
    tree = drafter.propose(root, params, generator)   root (1,): the last emitted token, not yet seen by the target
    drafter.accept(path, new_tokens, features)        after verification: path (a+1,) accepted tree indices (root
                                                      first), new_tokens (a+1,) accepted drafts + the bonus token
                                                      (the next root), features (1, n, F) at the tree's nodes

A proposed DraftTree (tree.py) holds the tokens, each node's parent, depth and ancestors; for speculative
sampling with a stochastic drafter also `q`, the distribution each node was drawn from (deterministic drafters
leave it None: their nodes are point masses); and optionally `origin`, a bit mask per node naming the drafters
(`origin_names`) that proposed it, for per-drafter acceptance statistics.

Drafters: PlainDrafter (here: no draft, plain decoding on the engine's runner), TreeDrafter (tree.py, the EAGLE
head's dynamic tree), PromptLookupDrafter (prompt_lookup.py), DraftModelDrafter (draft_model.py) and
HybridDrafter (hybrid.py: the head's tree plus the prompt-lookup branch).
"""

from __future__ import annotations

import contextlib
from typing import Protocol, runtime_checkable

import torch

from .sampling import SamplingParams
from .tree import DraftTree


@runtime_checkable
class Drafter(Protocol):
    """See the module docstring."""

    name: str
    origin_names: tuple[str, ...]  # bit i of DraftTree.origin = origin_names[i]

    @property
    def feature_layers(self) -> list[int]:
        """Target decoder layers whose outputs the drafter reads ([] for none)."""
        ...

    def tree_sizes(self) -> list[int]:
        """Every tree size (root included) propose() may return: the verify shapes to prepare."""
        ...

    def warmup(self, max_length: int) -> None:
        """Size buffers for sequences of `max_length` tokens and compile the drafter's own steps, if any."""
        ...

    def session(self) -> contextlib.AbstractContextManager:
        """Context around one generation (a draft model's attention kernel, as the target runner's session)."""
        ...

    def begin(self, input_ids: torch.Tensor, features: torch.Tensor | None, max_length: int) -> None: ...

    def propose(self, root: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> DraftTree: ...

    def accept(self, path: torch.Tensor, new_tokens: torch.Tensor, features: torch.Tensor | None) -> None: ...


class PlainDrafter:
    """Drafts nothing: every tree is the root alone, so the generator decodes one token per target step (the
    engine's own plain decoding, the baseline that separates what the runner buys from what speculation buys)."""

    name = "none"
    origin_names: tuple[str, ...] = ()
    feature_layers: list[int] = []

    def tree_sizes(self) -> list[int]:
        return [1]

    def warmup(self, max_length: int) -> None:
        pass

    def session(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def begin(self, input_ids, features, max_length) -> None:
        pass

    def propose(self, root, params, generator=None) -> DraftTree:
        return DraftTree.root_only(root)

    def accept(self, path, new_tokens, features) -> None:
        pass


def chain_tree(root: torch.Tensor, tokens: list[int] | torch.Tensor, q: torch.Tensor | None = None,
               origin: int | None = None) -> DraftTree:
    """A chain: root, then `tokens` each the child of the one before. q (len(tokens), V): the distribution each
    drafted token was drawn from (None for deterministic drafts); origin: one bit mask for every drafted node."""
    device = root.device
    drafted = torch.as_tensor(tokens, dtype=torch.long, device=device).view(-1)
    n = 1 + drafted.shape[0]
    tree = DraftTree(torch.cat([root.view(1), drafted]).view(1, n),
                     torch.arange(-1, n - 1, device=device),
                     torch.arange(n, device=device),
                     torch.ones(n, n, dtype=torch.bool, device=device).tril())
    if q is not None:  # row i: the distribution node i was drawn from (the root's row is never read)
        tree.q = torch.cat([torch.zeros_like(q[:1]), q])
    if origin is not None:
        tree.origin = torch.full((n,), origin, dtype=torch.long, device=device)
        tree.origin[0] = 0
    return tree
