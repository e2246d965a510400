"""A prompt-lookup branch beside any batched drafter's trees (batch_tree.BatchDrafter).

Long-context requests copy from their context (a continued conversation repeats its names and phrases, a summary
its source), and a streaming draft that keeps only the last few hundred positions cannot see what lies further
back. Prompt lookup can: it proposes what followed the latest earlier occurrence of the row's last n tokens
(prompt_lookup.lookup_continuation's rule), at no model cost. Each row's lookup chain is walked down from the root
of that row's drafted tree, sharing the nodes the drafter already proposed, and the rest of the chain hangs from
the first token the drafter did not propose (hybrid.merge_chain's rule, per row). Every row's tree then has the
drafter's size plus `tokens` nodes (a batch verifies trees of one size): a row whose chain adds fewer nodes is padded
with copies of its root's first child, which can never change what is accepted (greedy: the deepest correct path,
first in index order, is kept; sampling: a copy is one more point-mass proposal against the residual, which is
exact for any sequence of proposals, and is always rejected when its token has already been rejected).

The n-gram search is prompt_lookup.NgramIndex per row, extended as tokens are committed: a lookup costs a few
dictionary reads however long the context is.
"""

from __future__ import annotations

import torch

from .batch_tree import BatchTree
from .hybrid import hang_chain
from .prompt_lookup import NgramIndex
from .sampling import SamplingParams


class BatchLookupBranch:
    """A batch_tree.BatchDrafter: `drafter`'s trees with each row's prompt-lookup chain of up to `tokens` merged in
    (module docstring)."""

    def __init__(self, drafter, tokens: int = 3, nodes: int | None = None, max_ngram: int = 3, min_ngram: int = 1):
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        nodes = tokens if nodes is None else nodes
        if not 1 <= nodes <= tokens:
            raise ValueError(f"need 1 <= nodes <= tokens, got nodes={nodes}, tokens={tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.drafter = drafter
        self.tokens, self.nodes, self.max_ngram, self.min_ngram = tokens, nodes, max_ngram, min_ngram
        self.name = f"{drafter.name}+lookup"
        self.tree_size = drafter.tree_size + nodes
        self.rows: list[NgramIndex] = []
        self._added: list[int] = []  # per row, the lookup nodes the last tree added (after the drafter's nodes)
        self._base_size = 0  # nodes of the drafter's own trees in the last step
        self.proposed = 0  # lookup nodes added to the trees (not already proposed by the drafter), summed over rows
        self.accepted = 0  # of those, accepted

    @property
    def feature_layers(self) -> list[int]:
        return self.drafter.feature_layers

    def begin(self, runner, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              features: torch.Tensor | None) -> None:
        self.drafter.begin(runner, input_ids, attention_mask, features)
        self.rows = [NgramIndex(ids[mask.bool()].tolist(), self.max_ngram)
                     for ids, mask in zip(input_ids, attention_mask)]

    def admit(self, row: int, runner, ids: torch.Tensor, features: torch.Tensor | None) -> None:
        self.drafter.admit(row, runner, ids, features)
        self.rows[row] = NgramIndex(ids.tolist(), self.max_ngram)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.drafter.keep_rows(rows)
        self.rows = [self.rows[k] for k in rows.tolist()]

    def skip(self, roots: torch.Tensor) -> None:
        self.drafter.skip(roots)
        self._added = [0] * len(self.rows)
        for index, root in zip(self.rows, roots.tolist()):
            index.extend([root])

    def accept(self, paths: list[torch.Tensor], new_tokens: list[torch.Tensor],
               features: torch.Tensor | None) -> None:
        """The accepted drafted tokens join each row's context (the bonus token joins as the next root)."""
        self.drafter.accept(paths, new_tokens, features)
        for index, tokens, path, added in zip(self.rows, new_tokens, paths, self._added):
            index.extend(tokens[:-1].tolist())
            self.accepted += int(((path >= self._base_size) & (path < self._base_size + added)).sum())

    @torch.inference_mode()
    def propose(self, roots: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> BatchTree:
        tree = self.drafter.propose(roots, params, generator)
        chains = []
        for index, root in zip(self.rows, roots.tolist()):
            index.extend([root])
            chains.append(index.continuation(self.tokens, self.min_ngram))
        return self._merge(tree, chains)

    def _merge(self, tree: BatchTree, chains: list[list[int]]) -> BatchTree:
        """`tree` with each row's chain hung from its root (shared nodes reused), padded to tree.size + nodes."""
        b, n = tree.tokens.shape
        size = n + self.nodes
        self._base_size, self._added = n, []
        tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
        for k, chain in enumerate(chains):
            row_tokens, row_parents, row_depths = tokens[k], parents[k], depths[k]
            hang_chain(row_tokens, row_parents, row_depths, chain, limit=size)
            self._added.append(len(row_tokens) - n)
            first = 1 if n > 1 else 0  # padding: copies of the root's first child (or of the root, alone)
            while len(row_tokens) < size:
                row_tokens.append(row_tokens[first])
                row_parents.append(row_parents[first] if first else 0)
                row_depths.append(row_depths[first] if first else 1)
        self.proposed += sum(self._added)
        device = tree.tokens.device
        parents_t = torch.tensor(parents, device=device)
        ancestors = torch.zeros(b, size, size, dtype=torch.bool, device=device)
        ancestors[:, :n, :n] = tree.ancestors
        rows = torch.arange(b, device=device)
        for i in range(n, size):  # parents before children: each new node's parent row is complete
            ancestors[:, i] = ancestors[rows, parents_t[:, i]]
            ancestors[:, i, i] = True
        merged = BatchTree(torch.tensor(tokens, device=device), parents_t, torch.tensor(depths, device=device),
                           ancestors)
        if tree.q is not None:  # the lookup's nodes are point masses
            onehot = torch.zeros(b, size - n, tree.q.shape[-1], dtype=tree.q.dtype, device=device)
            onehot.scatter_(2, merged.tokens[:, n:, None], 1.0)
            merged.q = torch.cat([tree.q, onehot], dim=1)
        return merged
