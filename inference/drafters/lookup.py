"""Prompt-lookup drafting: copy what followed the latest earlier occurrence of the last few tokens (n-grams from
`max_ngram` down to `min_ngram`), alone or as one more branch beside another drafter's trees, sharing their nodes.
The rows' trees are padded to the largest with copies of a row's first drafted node (or root), which never changes
what is accepted (greedy keeps the first deepest correct path; sampling meets one more point-mass proposal).
"""

from __future__ import annotations

import torch

from ..drafter import Accepted, PlainDrafter
from ..sampling import SamplingParams
from ..tree import DraftTree, ancestor_matrix


class NgramIndex:
    """One row's tokens with the latest start of every n-gram (1 <= n <= max_ngram) that a token follows."""

    def __init__(self, tokens: list[int], max_ngram: int):
        self.max_ngram = max_ngram
        self.tokens: list[int] = list(tokens)
        self.latest: dict[tuple[int, ...], int] = {}
        seq, length = self.tokens, len(self.tokens)
        for n in range(1, max_ngram + 1):  # in bulk (later starts overwrite), faster than extend()
            grams = zip(*(seq[i: length - n + i] for i in range(n)))  # the n-grams starting at 0 .. length-n-1
            self.latest.update(zip(grams, range(length - n)))

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; every n-gram that now has a token after it points to its newest start."""
        seq = self.tokens
        for token in tokens:
            end = len(seq)  # the position `token` takes: the n-grams ending just before it are now followed
            for n in range(1, min(self.max_ngram, end) + 1):
                self.latest[tuple(seq[end - n: end])] = end - n
            seq.append(token)

    def continuation(self, num_tokens: int, min_ngram: int = 1) -> list[int]:
        """Up to num_tokens tokens after the latest earlier match of the last n tokens (longest n first); [] if none."""
        seq = self.tokens
        for n in range(min(self.max_ngram, len(seq) - 1), min_ngram - 1, -1):
            start = self.latest.get(tuple(seq[len(seq) - n:]))
            if start is not None:
                return seq[start + n: start + n + num_tokens]
        return []


class LookupBranch:
    """A drafter: `drafter`'s trees with each row's prompt-lookup chain of up to `tokens` merged in, adding at most
    `nodes` nodes a row."""

    def __init__(self, drafter, tokens: int = 10, nodes: int | None = None, max_ngram: int = 3, min_ngram: int = 1):
        nodes = tokens if nodes is None else nodes
        if not 1 <= nodes <= tokens:
            raise ValueError(f"need 1 <= nodes <= tokens, got nodes={nodes}, tokens={tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.drafter = drafter
        self.tokens, self.nodes, self.max_ngram, self.min_ngram = tokens, nodes, max_ngram, min_ngram
        self.name = "prompt_lookup" if drafter.tree_size == 1 else f"{drafter.name}+lookup"  # alone: beside plain
        self.origin_names = (*drafter.origin_names, "prompt_lookup")
        self.tree_size = drafter.tree_size + nodes
        self.smallest_tree = getattr(drafter, "smallest_tree", 1)  # no lookup match adds nothing
        self.feature_layers = drafter.feature_layers
        self.session = drafter.session  # the branch lives in the drafter's context and is freed with it
        self.close = getattr(drafter, "close", lambda: None)
        self.rows: list[NgramIndex] = []

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
        for index, root in zip(self.rows, roots.tolist()):
            index.extend([root])

    def accept(self, accepted: Accepted, features: torch.Tensor | None) -> None:
        """The accepted drafted tokens join each row's context (the bonus token joins as the next root)."""
        self.drafter.accept(accepted, features)
        for index, tokens in zip(self.rows, accepted.host_tokens):
            index.extend(tokens[:-1])

    @torch.inference_mode()
    def propose(self, roots: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> DraftTree:
        tree = self.drafter.propose(roots, params, generator)
        for index, root in zip(self.rows, roots.tolist()):
            index.extend([root])
        return self._merge(tree, [index.continuation(self.tokens, self.min_ngram) for index in self.rows])

    def _merge(self, tree: DraftTree, chains: list[list[int]]) -> DraftTree:
        """`tree` with each row's chain hung from its root, sharing the nodes it has and appending up to `nodes` more,
        the rows padded to the largest."""
        b, n = tree.tokens.shape
        lookup = 1 << len(self.drafter.origin_names)  # origin bit; the drafter's own nodes carry bit 0
        tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
        origin = tree.origin.tolist() if tree.origin is not None else [[0] + [1] * (n - 1) for _ in range(b)]
        for row_tokens, row_parents, row_depths, row_origin, chain in zip(tokens, parents, depths, origin, chains):
            child = {(p, t): i for i, (p, t) in enumerate(zip(row_parents, row_tokens)) if i > 0}
            node = 0
            for token in chain:  # down from the root: once off the tree, every token is a new node
                found = child.get((node, token))
                if found is None:
                    if len(row_tokens) >= n + self.nodes:
                        break
                    found = len(row_tokens)
                    row_tokens.append(token)
                    row_parents.append(node)
                    row_depths.append(row_depths[node] + 1)
                    row_origin.append(0)
                row_origin[found] |= lookup
                node = found
        size = max(len(t) for t in tokens)
        if size == 1:  # nothing drafted in any row: the roots alone
            return tree
        for row_tokens, row_parents, row_depths, row_origin in zip(tokens, parents, depths, origin):
            pad = size - len(row_tokens)  # copies of the first drafted node (or of the root): a child of the root
            row_tokens += [row_tokens[min(1, len(row_tokens) - 1)]] * pad
            row_parents += [0] * pad
            row_depths += [1] * pad
            row_origin += [0] * pad
        device = tree.tokens.device
        parents_t = torch.tensor(parents, device=device)
        merged = DraftTree(torch.tensor(tokens, device=device), parents_t, torch.tensor(depths, device=device),
                           ancestor_matrix(parents_t, max(map(max, depths))),
                           origin=torch.tensor(origin, device=device))
        if tree.q is not None:  # the lookup's nodes are point masses
            onehot = torch.nn.functional.one_hot(merged.tokens[:, n:], tree.q.shape[-1]).to(tree.q.dtype)
            merged.q = torch.cat([tree.q, onehot], dim=1)
        return merged


def prompt_lookup(tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1) -> LookupBranch:
    """Prompt lookup on its own: chains of up to `tokens` tokens copied from each row's context."""
    return LookupBranch(PlainDrafter(), tokens, tokens, max_ngram, min_ngram)
