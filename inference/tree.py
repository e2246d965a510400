"""EAGLE-2 dynamic draft tree.

The head keeps its KV cache across steps. Its stable part holds the pairs (true target feature at t, token t+1)
at positions 0..P-1, where P is the position of the tree root (the last emitted token, not yet seen by the target).
A drafting step (DraftStep) first feeds the true pairs of the last verification (their last token is the root):
the head's output at the root gives depth 1. Each further depth is ONE head forward over the top_k frontier nodes
(best cumulative draft log-prob), attending the stable cache plus their own drafted ancestors. All candidates are
reranked by cumulative log-prob and the best `total_tokens` kept; a child's score is never above its parent's and
a stable sort puts parents first on ties, so the kept set is always a tree.
The cache is a fixed buffer (head_runner.py): drafted nodes are written after the stable part and simply
overwritten later, so "cropping" is only moving the stable length. Positions and slots are tensors computed from
the stable length (a 0-dim tensor), so a step compiled whole is one graph per tree shape at every length.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable

import torch

from drafthead.masks import causal_allowed
from drafthead.model import DraftHead

from .head_runner import HeadRunner
from .static_runner import SMALL_GEMM_ROWS, compile_step


@dataclass(frozen=True)
class TreeOptions:
    """depth: max drafted tokens on a path (= head forwards per draft); top_k: children per expanded node and
    nodes expanded per depth; total_tokens: drafted nodes sent to the target (the root comes on top)."""

    depth: int = 5
    top_k: int = 8
    total_tokens: int = 24

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise ValueError(f"tree options must all be >= 1, got {self}")

    @property
    def tree_size(self) -> int:
        """Nodes of every verification tree (root included): the budget, or all candidates if there are fewer
        (top_k at depth 1, top_k² at each further depth). Constant per option set, so one verify shape."""
        candidates = self.top_k + (self.depth - 1) * self.top_k**2
        return 1 + min(self.total_tokens, candidates)


TREE_PRESETS = {
    "cpu": TreeOptions(depth=5, top_k=8, total_tokens=24),  # verifying ~25 tokens costs ~2 decode steps on CPU
    "gpu": TreeOptions(depth=6, top_k=10, total_tokens=60),  # EAGLE-2's GPU setting
    "chain": TreeOptions(depth=5, top_k=1, total_tokens=5),
}


def tree_options(tree: str | TreeOptions | None = "cpu", **overrides: int | None) -> TreeOptions:
    """A preset by name ("cpu", "gpu", "chain"), "depth,top_k,total_tokens", or a TreeOptions, with
    depth/top_k/total_tokens overrides."""
    if tree is None:
        tree = "cpu"
    if isinstance(tree, str) and "," in tree:  # "depth,top_k,total_tokens", e.g. "2,4,3"
        try:
            depth, top_k, total = (int(x) for x in tree.split(","))
        except ValueError:
            raise ValueError(f"a tree as numbers is 'depth,top_k,total_tokens', got {tree!r}") from None
        tree = TreeOptions(depth, top_k, total)
    if isinstance(tree, str):
        if tree not in TREE_PRESETS:
            raise ValueError(f"unknown tree preset {tree!r}; choose from {sorted(TREE_PRESETS)}")
        tree = TREE_PRESETS[tree]
    return replace(tree, **{k: v for k, v in overrides.items() if v is not None})


@dataclass
class DraftTree:
    """A verification tree. Node 0 is the root; parents come before children (so ancestors[i] in index order
    is the path to i)."""

    tokens: torch.Tensor  # (1, n) target token ids
    parents: torch.Tensor  # (n,) parent index, -1 for the root
    depths: torch.Tensor  # (n,) root 0
    ancestors: torch.Tensor  # (n, n) bool: j is i or an ancestor of i
    scores: torch.Tensor | None = None  # (n,) cumulative draft log-prob (root 0), for budget calibration
    q: torch.Tensor | None = None  # (n, V) distribution node i was sampled from; None: every node deterministic
    origin: torch.Tensor | None = None  # (n,) bit mask of the drafters that proposed node i (drafter.py)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    @staticmethod
    def root_only(root: torch.Tensor) -> "DraftTree":
        """The one-node tree of plain decoding: verify the last emitted token, draft nothing."""
        zero = torch.zeros(1, dtype=torch.long, device=root.device)
        return DraftTree(root.view(1, 1), zero - 1, zero, torch.ones(1, 1, dtype=torch.bool, device=root.device))

    @staticmethod
    def build(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
              max_depth: int | None = None, scores: torch.Tensor | None = None) -> "DraftTree":
        """Tree from tokens (1, n), parents (n,) (-1 at the root), depths (n,) and an upper bound on the depth."""
        steps = int(depths.max()) if max_depth is None else max_depth
        return DraftTree(tokens, parents, depths, ancestor_matrix(parents, steps), scores)


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
    last_hidden (B, 1, H): the head output they came from. At every further depth d the k best frontier nodes of
    each row go through the head in ONE forward: step(d, f, frontier_tokens (B, k), parent_hidden (B, k, H),
    rows (B, k, f+k)) with `rows` saying which of the f drafted nodes fed so far, and of this depth's k, each node
    attends (its fed ancestors and itself); it returns (out (B, k, H), child log-probs (B, k, k'), child target ids
    (B, k, k')). Returns every candidate's cumulative log-prob, token, parent candidate (-1: the root) and depth,
    each (B, N). A child's score is never above its parent's."""
    b, k = scores.shape
    device = scores.device
    cand_scores, cand_tokens = [scores], [tokens]
    cand_parents = [torch.full((b, k), -1, dtype=torch.long, device=device)]
    cand_depths = [torch.ones(b, k, dtype=torch.long, device=device)]
    frontier = torch.arange(k, device=device).expand(b, k)  # candidate ids of the nodes to expand
    frontier_scores, frontier_tokens = scores, tokens
    parent_hidden = last_hidden.expand(b, k, -1).contiguous()  # contiguous: a compiled step guards on strides
    parent_fed = None  # (B, k) each frontier node's parent among the fed nodes (None at depth 1)
    fed_allowed = torch.zeros(b, 0, 0, dtype=torch.bool, device=device)  # (B, f, f) ancestry among fed nodes
    eye = torch.eye(k, dtype=torch.bool, device=device).expand(b, k, k)
    num = k
    for d in range(1, depth):
        f = fed_allowed.shape[1]
        rows = (torch.zeros(b, k, f, dtype=torch.bool, device=device) if parent_fed is None
                else fed_allowed.gather(1, parent_fed[:, :, None].expand(-1, -1, f)))
        rows = torch.cat([rows, eye], dim=2)  # (B, k, f+k)
        fed_allowed = torch.cat([torch.cat([fed_allowed, torch.zeros(b, f, k, dtype=torch.bool, device=device)],
                                           dim=2), rows], dim=1)
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
    """Each row keeps its best `keep` candidates of expand_tree (stable sort: parents before children on ties),
    under its root (B,). Returns the trees' tokens (B, n), parents (B, n), depths (B, n), ancestors (B, n, n) and
    cumulative scores (B, n), root first."""
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


class DraftStep:
    """One drafting step of a tree shape, on a HeadRunner: feed the true pairs, expand depth by depth, select the
    tree. `whole`: compiled as one graph (the runner compiles; what decoding uses) or eager glue around the
    runner's own passes (compiled piecewise when the runner compiles; what the tree tuner prices shapes with)."""

    def __init__(self, runner: HeadRunner, options: TreeOptions, whole: bool):
        self.runner, self.opt, self.whole = runner, options, whole
        # a tree whose head passes are all a few rows (the feed: depth + 1 pairs; each depth: top_k nodes) takes
        # inductor's C++ GEMMs on CPU, as the target's small verify buckets do (2/3/3 drafting, 2-core Zen 4 EPYC,
        # bf16, inside decoding: ~2.4-3.0 -> 2.1 ms a step; 1/1/1: 2.1 -> 1.3 ms)
        small = max(options.depth + 1, options.top_k) <= SMALL_GEMM_ROWS and not runner.small_rows
        name = f"tree{options.depth}_{options.top_k}_{options.total_tokens}"
        # a drafting step is many small kernels: called from C++ on CPU (compile_step)
        self.run = (compile_step(self._run, runner.device, small_gemm=small, name=name,
                                 cpp_wrapper=runner.device.type == "cpu", unguarded=("self.runner.cache",))
                    if whole and runner.compiled else self._run)

    def _run(self, tokens, features, last, start, root):
        """tokens (1, p), features (1, p, F): the true pairs, padded to depth + 1 (padding lands in slots the tree
        overwrites); last (1,): the index of the last real pair (its token is the root); start: 0-dim tensor, the
        position of the first pair; root (1,). Returns select_tree's (tokens, parents, depths, ancestors, scores)."""
        runner, opt = self.runner, self.opt
        feed, expand = runner.passes(self.whole)
        device = tokens.device
        p = tokens.shape[1]
        positions = (start + torch.arange(p, device=device)).unsqueeze(0)
        mask = runner.mask(causal_allowed(p, 0, device), start)
        last_hidden, scores, first = feed(tokens, features, positions, mask, positions[0], last, opt.top_k)
        stable = start + last[0] + 1  # the root's position: the tree's nodes start at this slot

        def step(d, f, frontier_tokens, parent_hidden, rows):
            # the frontier (depth d) at slots stable+f.., position stable-1+d, attending the stable prefix + rows
            k = frontier_tokens.shape[1]
            where = (stable - 1 + d).view(1, 1).expand(1, k)
            slots = stable + f + torch.arange(k, device=device)
            out, logp, child = expand(frontier_tokens, parent_hidden, where, runner.mask(rows[0], stable), slots, k)
            return out, logp[None], child[None]

        candidates = expand_tree(scores, first, last_hidden, opt.depth, step)
        return select_tree(root.view(1), *candidates, opt.total_tokens, opt.depth)


class TreeDrafter:
    """Drafts EAGLE-2 trees with a DraftHead, keeping the head's KV cache across steps (a drafter.Drafter). The
    head's buffer and (compiled) steps live in a HeadRunner, which may be shared by several drafters of the same
    head. whole=False drafts with the piecewise-compiled passes (see DraftStep)."""

    name = "eagle"
    origin_names = ("head",)

    def __init__(self, head: DraftHead, options: TreeOptions, head_runner: HeadRunner | None = None,
                 whole: bool = True):
        self.head = head
        self.opt = options
        self.dtype = next(head.parameters()).dtype
        self.runner = head_runner if head_runner is not None else HeadRunner(head)
        self.step = self.runner.draft_step((options, whole), lambda: DraftStep(self.runner, options, whole))
        self.stable = 0  # positions 0..stable-1 hold true pairs
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # true pairs not fed yet (features, tokens)

    # ------------------------------------------------------------------------------ the drafter protocol
    @property
    def feature_layers(self) -> list[int]:
        return list(self.head.config.aux_layer_ids)

    def tree_sizes(self) -> list[int]:
        return [self.opt.tree_size]

    def warmup(self, max_length: int) -> None:
        self.reset(max_length)

    def session(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the head runs its own forward, not the model's attention dispatch

    def begin(self, input_ids: torch.Tensor, features: torch.Tensor, max_length: int) -> None:
        """The prompt's pairs (feature at t, token t+1) wait for the first root, the token after the prompt."""
        self.reset(max_length)
        self.pending = (features, input_ids[:, 1:])

    @torch.inference_mode()
    def propose(self, root: torch.Tensor, params=None, generator=None) -> DraftTree:
        """Feed the pending true pairs (their last token is the root) and draft the tree, in one drafting step;
        a prompt's pairs before the last depth + 1 go into the head's cache first."""
        features, tokens = self.pending
        tokens = torch.cat([tokens, root.view(1, 1)], dim=1)
        features = features.to(self.dtype)
        size = self.opt.depth + 1  # at most depth accepted drafts + the bonus token per verification
        m = tokens.shape[1]
        self.runner.reserve(self.stable + max(m, size) + self._tree_room)
        if m > size:
            self.runner.append(tokens[:, : m - size], features[:, : m - size], self.stable)
            self.stable += m - size
            tokens, features, m = tokens[:, m - size:], features[:, m - size:], size
        device = root.device
        padded = torch.zeros(1, size, dtype=torch.long, device=device)
        padded[:, :m] = tokens
        feats = torch.zeros(1, size, features.shape[-1], dtype=self.dtype, device=device)
        feats[:, :m] = features
        last = torch.tensor([m - 1], device=device)
        start = torch.tensor(self.stable, device=device)
        tokens, parents, depths, ancestors, scores = self.step.run(padded, feats, last, start, root)
        self.stable += m
        return DraftTree(tokens, parents[0], depths[0], ancestors[0], scores[0])

    def accept(self, path: torch.Tensor, new_tokens: torch.Tensor, features: torch.Tensor) -> None:
        """The accepted nodes' true features, each paired with the token after it (the last one: the next root)."""
        self.pending = (features[:, path], new_tokens[:-1].view(1, -1))

    @property
    def stable_length(self) -> int:
        return self.stable

    @property
    def _tree_room(self) -> int:
        """Head slots the drafted nodes of one tree occupy after the stable prefix (the frontier of every depth)."""
        return self.opt.depth * self.opt.top_k + 1

    def reset(self, length: int) -> None:
        """Start a new sequence of up to `length` tokens (room for its deepest tree too)."""
        self.runner.reserve(length + self._tree_room)
        self.stable = 0
