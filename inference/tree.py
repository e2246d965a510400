"""The verification tree (one type for every drafter and batch size) and the EAGLE-2 tree search: expand_tree
grows every row's top_k frontier depth by depth, select_tree keeps each row's best `total_tokens` candidates."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

import torch


@dataclass(frozen=True)
class TreeOptions:
    """depth: max drafted tokens on a path; top_k: children per expanded node and nodes expanded per depth;
    total_tokens: drafted nodes sent to the target (plus the root)."""

    depth: int = 5
    top_k: int = 8
    total_tokens: int = 24

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise ValueError(f"tree options must all be >= 1, got {self}")

    @property
    def tree_size(self) -> int:
        """Nodes of every verification tree (root included): the budget, or all candidates if there are fewer."""
        return 1 + min(self.total_tokens, self.top_k + (self.depth - 1) * self.top_k**2)


TREE_PRESETS = {
    "cpu": TreeOptions(depth=5, top_k=8, total_tokens=24),  # verifying ~25 tokens costs ~2 decode steps on CPU
    "gpu": TreeOptions(depth=6, top_k=10, total_tokens=60),  # EAGLE-2's GPU setting
    "chain": TreeOptions(depth=5, top_k=1, total_tokens=5),
}


def tree_options(tree: str | TreeOptions | None = "cpu", **overrides: int | None) -> TreeOptions:
    """A preset by name ("cpu", "gpu", "chain"; None: "cpu"), "depth,top_k,total_tokens" (e.g. "2,4,3"), or a
    TreeOptions, with depth/top_k/total_tokens overrides."""
    if tree is None or tree in TREE_PRESETS:
        tree = TREE_PRESETS[tree or "cpu"]
    elif isinstance(tree, str):
        try:
            depth, top_k, total = (int(x) for x in tree.split(","))
        except ValueError:
            raise ValueError(f"tree {tree!r} is neither a preset ({sorted(TREE_PRESETS)}) nor "
                             "'depth,top_k,total_tokens'") from None
        tree = TreeOptions(depth, top_k, total)
    return replace(tree, **{k: v for k, v in overrides.items() if v is not None})


@dataclass
class DraftTree:
    """One verification tree per row of a batch, all of size n; node 0 is each row's root, parents precede children."""

    tokens: torch.Tensor  # (B, n) target token ids, root first
    parents: torch.Tensor  # (B, n) parent index, -1 at the root
    depths: torch.Tensor  # (B, n) root 0
    ancestors: torch.Tensor  # (B, n, n) bool: j is i or an ancestor of i
    scores: torch.Tensor | None = None  # (B, n) cumulative draft log-prob (root 0), for budget calibration
    q: torch.Tensor | None = None  # (B, n, V) the distribution node i was sampled from; None: point masses
    origin: torch.Tensor | None = None  # (B, n) bit mask of the drafters that proposed node i (drafter.py)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def row(self, i: int) -> "DraftTree":
        """Row i alone, as a one-row tree."""
        values = (getattr(self, f.name) for f in fields(self))
        return DraftTree(*(None if t is None else t[i: i + 1] for t in values))

    @staticmethod
    def chain(roots: torch.Tensor, drafted: torch.Tensor | None = None, q: torch.Tensor | None = None,
              origin: int | None = None) -> "DraftTree":
        """Every row a chain: its root (B,), then drafted (B, g) (None: the root alone); q (B, g, V) the
        distribution each drafted token was sampled from; origin: one bit mask for every drafted node."""
        b = roots.shape[0]
        drafted = roots.new_zeros(b, 0) if drafted is None else drafted
        n = 1 + drafted.shape[1]
        device = roots.device
        line = torch.arange(n, device=device)
        tree = DraftTree(torch.cat([roots.view(b, 1), drafted.to(device)], dim=1), (line - 1).expand(b, n),
                         line.expand(b, n), torch.ones(n, n, dtype=torch.bool, device=device).tril().expand(b, n, n))
        if q is not None:  # row 0 (the root) is never read
            tree.q = torch.cat([torch.zeros_like(q[:, :1]), q], dim=1)
        if origin is not None:
            tree.origin = torch.where(line > 0, origin, 0).expand(b, n)
        return tree


def ancestor_matrix(parents: torch.Tensor, steps: int) -> torch.Tensor:
    """parents (..., n), -1 at the root -> bool (..., n, n): j is i or an ancestor of i. `steps` >= the depth."""
    n = parents.shape[-1]
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)
    up = parents.clamp_min(0).unsqueeze(-1).expand(*parents.shape, n)
    anc = eye.expand(*parents.shape[:-1], n, n)
    for _ in range(steps):  # anc_{k+1}[i] = {i} | anc_k[parent(i)]
        anc = eye | anc.gather(-2, up)
    return anc


def expand_tree(scores: torch.Tensor, tokens: torch.Tensor, last_hidden: torch.Tensor, depth: int,
                step: Callable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2 expansion for B rows at once. scores, tokens (B, k): depth 1 (cumulative log-probs, target ids);
    last_hidden (B, 1, H): the head output they came from. At each further depth d, one forward for the batch:
    step(d, f, frontier_tokens (B, k), parent_hidden (B, k, H), rows (B, k, f+k): which of the f nodes fed so far
    and of this depth's k each node attends) -> (out (B, k, H), child log-probs and target ids (B, k, k')).
    Returns every candidate's cumulative log-prob, token, parent candidate (-1: the root) and depth, each (B, N)."""
    b, k = scores.shape
    device = scores.device
    cand_scores, cand_tokens = [scores], [tokens]
    cand_parents = [torch.full((b, k), -1, dtype=torch.long, device=device)]
    cand_depths = [torch.ones(b, k, dtype=torch.long, device=device)]
    frontier = torch.arange(k, device=device).expand(b, k)  # candidate ids of the nodes to expand
    frontier_scores, frontier_tokens = scores, tokens
    parent_hidden = last_hidden.expand(b, k, -1).contiguous()  # contiguous: a compiled step guards on strides
    parent_fed = torch.zeros(b, k, dtype=torch.long, device=device)  # (B, k) each frontier node's parent among fed
    fed_allowed = torch.zeros(b, 0, 0, dtype=torch.bool, device=device)  # (B, f, f) ancestry among fed nodes
    eye = torch.eye(k, dtype=torch.bool, device=device).expand(b, k, k)
    num = k
    for d in range(1, depth):
        f = fed_allowed.shape[1]
        rows = torch.cat([fed_allowed.gather(1, parent_fed[:, :, None].expand(-1, -1, f)), eye], dim=2)  # (B, k, f+k)
        fed_allowed = torch.cat([torch.nn.functional.pad(fed_allowed, (0, k)), rows], dim=1)
        out, logp, child = step(d, f, frontier_tokens, parent_hidden, rows)
        kk = logp.shape[2]
        child_scores = (frontier_scores[:, :, None] + logp).flatten(1)  # (B, k·k')
        cand_scores.append(child_scores)
        cand_tokens.append(child.flatten(1))
        cand_parents.append(frontier.repeat_interleave(kk, dim=1))
        cand_depths.append(torch.full_like(child_scores, d + 1, dtype=torch.long))
        best = torch.topk(child_scores, k, dim=1).indices  # (B, k) the next frontier, within this depth's block
        owner = best // kk  # each new frontier node's parent among this depth's fed nodes
        frontier = num + best
        frontier_scores = child_scores.gather(1, best)
        frontier_tokens = cand_tokens[-1].gather(1, best)
        parent_hidden = out.gather(1, owner[:, :, None].expand(-1, -1, out.shape[-1]))
        parent_fed = f + owner
        num += child_scores.shape[1]
    return tuple(torch.cat(c, dim=1) for c in (cand_scores, cand_tokens, cand_parents, cand_depths))


def select_tree(roots: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                depths: torch.Tensor, keep: int, max_depth: int) -> tuple[torch.Tensor, ...]:
    """Each row keeps its best `keep` candidates of expand_tree under its root (B,); a child never outscores its
    parent and the stable sort puts parents first on ties, so the kept set is a tree. Returns its tokens, parents,
    depths (B, n), ancestors (B, n, n) and cumulative scores (B, n), root first."""
    b, num = scores.shape
    device = scores.device
    keep = min(keep, num)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :keep]
    chosen = torch.sort(order, dim=1).values  # (B, keep) candidate order: parents before children
    where = torch.full((b, num), -1, dtype=torch.long, device=device)
    where.scatter_(1, chosen, torch.arange(1, keep + 1, device=device).expand(b, keep))
    par = parents.gather(1, chosen)
    column = torch.zeros(b, 1, dtype=torch.long, device=device)
    tree_parents = torch.cat([column - 1, torch.where(par < 0, 0, where.gather(1, par.clamp_min(0)))], dim=1)
    return (torch.cat([roots.view(b, 1), tokens.gather(1, chosen)], dim=1), tree_parents,
            torch.cat([column, depths.gather(1, chosen)], dim=1), ancestor_matrix(tree_parents, max_depth),
            torch.cat([column.to(scores.dtype), scores.gather(1, chosen)], dim=1))
