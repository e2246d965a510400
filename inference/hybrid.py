"""Hybrid drafting: the EAGLE head's dynamic tree plus the prompt-lookup continuation as one more branch.

The two guess different things (fluent continuations vs. copies from the context), and one verification tree can
hold both. The lookup chain is walked down from the root through the head's tree: where the head already proposed
the same token under the same parent the node is shared (deduplicated, its origin gets both bits), and from the
first token the head did not propose the rest of the chain hangs as new nodes. The tree budget counts both: at most
the head's tree plus `num_tokens` lookup nodes, and only what the lookup adds beyond the head's nodes.
"""

from __future__ import annotations

import contextlib

import torch

from .prompt_lookup import PromptLookupDrafter
from .tree import DraftTree, TreeDrafter

HEAD, LOOKUP = 1, 2  # origin bits


def hang_chain(tokens: list[int], parents: list[int], depths: list[int], chain: list[int],
               limit: int | None = None) -> list[int]:
    """Walk `chain` down from the root of the tree (tokens, parents, depths: lists, parents before children),
    sharing the nodes it already has and appending the rest in place, until the tree has `limit` nodes. Returns the
    nodes the chain went through."""
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i > 0}
    node, path = 0, []
    for token in chain:
        found = child.get((node, token))
        if found is None:
            if limit is not None and len(tokens) >= limit:
                break
            found = len(tokens)
            tokens.append(token)
            parents.append(node)
            depths.append(depths[node] + 1)
            child[(node, token)] = found
        path.append(found)
        node = found
    return path


def merge_chain(tree: DraftTree, chain: list[int]) -> DraftTree:
    """`tree` (origin bit HEAD on drafted nodes) with `chain` hung from its root, sharing the nodes it already
    has. Nodes keep parents-before-children order: new nodes are appended."""
    device = tree.tokens.device
    tokens = tree.tokens[0].tolist()
    parents = tree.parents.tolist()
    depths = tree.depths.tolist()
    origin = [0] + [HEAD] * (len(tokens) - 1)
    path = hang_chain(tokens, parents, depths, chain)
    origin += [0] * (len(tokens) - len(origin))
    for node in path:
        origin[node] |= LOOKUP
    if len(tokens) == tree.size:  # nothing new: only the origins change
        tree.origin = torch.tensor(origin, device=device)
        return tree
    merged = DraftTree.build(torch.tensor([tokens], device=device), torch.tensor(parents, device=device),
                             torch.tensor(depths, device=device))
    merged.origin = torch.tensor(origin, device=device)
    return merged


class HybridDrafter:
    """A drafter.Drafter: a TreeDrafter's tree with a PromptLookupDrafter's chain merged in (module docstring)."""

    name = "hybrid"
    origin_names = ("head", "prompt_lookup")

    def __init__(self, head: TreeDrafter, lookup: PromptLookupDrafter):
        self.head, self.lookup = head, lookup

    @property
    def feature_layers(self) -> list[int]:
        return self.head.feature_layers

    def tree_sizes(self) -> list[int]:
        base = self.head.opt.tree_size
        return list(range(base, base + self.lookup.num_tokens + 1))

    def warmup(self, max_length: int) -> None:
        self.head.warmup(max_length)

    def session(self) -> contextlib.AbstractContextManager:
        return self.head.session()

    def begin(self, input_ids: torch.Tensor, features: torch.Tensor, max_length: int) -> None:
        self.head.begin(input_ids, features, max_length)
        self.lookup.begin(input_ids, None, max_length)

    def propose(self, root: torch.Tensor, params=None, generator=None) -> DraftTree:
        return merge_chain(self.head.propose(root), self.lookup.continuation(root))

    def accept(self, path: torch.Tensor, new_tokens: torch.Tensor, features: torch.Tensor) -> None:
        self.head.accept(path, new_tokens, features)
        self.lookup.accept(path, new_tokens, None)
