"""EAGLE-2 dynamic draft tree.

The head keeps its KV cache across steps. Its stable part holds the pairs (true target feature at t, token t+1)
at positions 0..P-1, where P is the position of the tree root (the last emitted token, not yet seen by the target).
draft() expands the tree: depth 1 comes from the head's last output; each further depth is ONE head forward over
the top_k frontier nodes (best cumulative draft log-prob), attending the stable cache plus their own drafted
ancestors. All candidates are reranked by cumulative log-prob and the best `total_tokens` kept; a child's score is
never above its parent's and a stable sort puts parents first on ties, so the kept set is always a tree.
After verification, feed() crops the cache back to P and appends the accepted pairs with their TRUE features.
The cache is a fixed buffer (head_runner.py): drafted nodes are written after the stable part and simply
overwritten later, so "cropping" is only moving the stable length.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch

from drafthead.model import DraftHead

from .head_runner import HeadRunner


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
        n = parents.shape[0]
        eye = torch.eye(n, dtype=torch.bool, device=parents.device)
        up = parents.clamp_min(0)
        anc = eye
        for _ in range(int(depths.max()) if max_depth is None else max_depth):  # anc_{k+1}[i] = {i} | anc_k[parent(i)]
            anc = eye | anc[up]
        return DraftTree(tokens, parents, depths, anc, scores)


class TreeDrafter:
    """Drafts EAGLE-2 trees with a DraftHead, keeping the head's KV cache across steps (a drafter.Drafter). The
    head's buffer and (compiled) step live in a HeadRunner, which may be shared by several drafters of the same
    head."""

    name = "eagle"
    origin_names = ("head",)

    def __init__(self, head: DraftHead, options: TreeOptions, head_runner: HeadRunner | None = None):
        self.head = head
        self.opt = options
        self.dtype = next(head.parameters()).dtype
        self.runner = head_runner if head_runner is not None else HeadRunner(head)
        self.stable = 0  # positions 0..stable-1 hold true pairs
        self.last_hidden: torch.Tensor | None = None  # (1, 1, H) head output at the last true position
        self.first_scores = self.first_tokens = None  # (1, k): its top-k, depth 1 of the next tree
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

    def propose(self, root: torch.Tensor, params=None, generator=None) -> DraftTree:
        """Feed the pending true pairs (their last token is the root), then draft the tree."""
        features, tokens = self.pending
        self.feed(features, torch.cat([tokens, root.view(1, 1)], dim=1), self.stable)
        return self.draft(root)

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
        self.last_hidden = None

    @torch.inference_mode()
    def feed(self, features: torch.Tensor, tokens: torch.Tensor, start: int) -> None:
        """Crop the cache to `start`, then append true pairs: features (1, m, F) at positions start.., tokens (1, m)
        = the token after each feature. Also drafts depth 1 of the next tree (the last pair's top-k)."""
        m = tokens.shape[1]
        pad_to = self.opt.depth + 1  # at most depth accepted drafts + the bonus token per verification
        self.runner.reserve(start + max(m, pad_to) + self._tree_room)
        self.last_hidden, self.first_scores, self.first_tokens = self.runner.feed(
            tokens, features.to(self.dtype), start, self.opt.top_k, pad_to)
        self.stable = start + m

    @torch.inference_mode()
    def draft(self, root: torch.Tensor) -> DraftTree:
        """root: (1,) the last emitted token. Returns the verification tree (root + up to total_tokens nodes)."""
        k, device = self.opt.top_k, root.device
        stable = self.stable  # the root sits at position `stable`
        scores, tokens = self.first_scores, self.first_tokens  # (1, k): depth 1, drafted by feed()
        k = scores.shape[1]
        cand_scores, cand_tokens = [scores[0]], [tokens[0]]
        cand_parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
        cand_depths = [torch.ones(k, dtype=torch.long, device=device)]
        frontier = torch.arange(k, device=device)  # candidate ids of the nodes to expand
        frontier_scores = scores[0]  # (k,)
        frontier_tokens = tokens[0]  # (k,)
        parent_hidden = self.last_hidden.expand(1, k, -1).contiguous()  # (1, k, H)
        parent_fed = None  # (k,) index of each frontier node's parent among fed nodes (None at depth 1)
        fed_allowed = torch.zeros(0, 0, dtype=torch.bool, device=device)  # (f, f) ancestry among fed nodes
        num_cands = k
        for d in range(1, self.opt.depth):
            # feed the frontier (depth d) at slots stable+f.., position stable-1+d; it attends the stable
            # prefix + its fed ancestors + itself
            f = fed_allowed.shape[0]
            eye = torch.eye(k, dtype=torch.bool, device=device)
            rows = torch.zeros(k, f, dtype=torch.bool, device=device) if parent_fed is None else fed_allowed[parent_fed]
            rows = torch.cat([rows, eye], dim=1)  # (k, f+k)
            fed_allowed = torch.cat([torch.cat([fed_allowed, torch.zeros(f, k, dtype=torch.bool, device=device)], 1),
                                     rows], dim=0)
            positions = torch.full((1, k), stable - 1 + d, dtype=torch.long, device=device)
            slots = torch.arange(stable + f, stable + f + k, device=device)
            out, logp, child_tokens = self.runner.expand(frontier_tokens.unsqueeze(0), parent_hidden, positions,
                                                         self.runner.mask(rows, stable), slots, k)  # (k, k)
            child_scores = (frontier_scores[:, None] + logp).flatten()  # (k·k,)
            cand_scores.append(child_scores)
            cand_tokens.append(child_tokens.flatten())
            cand_parents.append(frontier.repeat_interleave(logp.shape[1]))
            cand_depths.append(torch.full_like(child_scores, d + 1, dtype=torch.long))
            best = torch.topk(child_scores, k).indices  # (k,) new frontier, within this depth's block
            owner = best // logp.shape[1]  # which fed node is each new frontier node's parent
            frontier = num_cands + best
            frontier_scores = child_scores[best]
            frontier_tokens = cand_tokens[-1][best]
            parent_hidden = out[:, owner]
            parent_fed = f + owner
            num_cands += child_scores.shape[0]
        return self._select(root, torch.cat(cand_scores), torch.cat(cand_tokens), torch.cat(cand_parents),
                            torch.cat(cand_depths))

    def _select(self, root, scores, tokens, parents, depths) -> DraftTree:
        """Keep the best total_tokens candidates (stable sort: parents before children on ties)."""
        keep = min(self.opt.total_tokens, scores.shape[0])
        order = torch.sort(scores, descending=True, stable=True).indices[:keep]
        chosen = torch.sort(order).values  # candidate order: parents before children
        where = torch.full_like(scores, -1, dtype=torch.long)
        where[chosen] = torch.arange(1, keep + 1, device=scores.device)
        par = parents[chosen]
        tree_parents = torch.where(par < 0, torch.zeros_like(par), where[par.clamp_min(0)])
        minus1 = torch.full((1,), -1, dtype=torch.long, device=scores.device)
        return DraftTree.build(
            torch.cat([root.view(1), tokens[chosen]]).unsqueeze(0),
            torch.cat([minus1, tree_parents]),
            torch.cat([torch.zeros(1, dtype=torch.long, device=scores.device), depths[chosen]]),
            max_depth=self.opt.depth,
            scores=torch.cat([torch.zeros(1, dtype=scores.dtype, device=scores.device), scores[chosen]]),
        )
