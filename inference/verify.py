"""Tree verification for every row of a batch: greedy (exact argmax match) and lossless sampling (recursive
rejection sampling). Both give an Accepted (drafter.py), the bonus token drawn from the target at the last accepted
node, moved to the host once.

Greedy is vectorised over rows: a node is correct when its token is the target's argmax after its parent, and each
row keeps its deepest node whose whole path is correct (the first in index order on ties), read up to the root on the
host after the step's one transfer (a few list steps cost less than the tensor ops that would gather it).

Sampling. At a node with target distribution p, try its children c1, c2, ... in order. Child c_j was drawn from a
proposal q_j: the drafter's distribution (tree.q, e.g. a draft model's sampled chain), or a point mass on c_j for
deterministic drafts (the head's top-k, prompt lookup). Each try is one step of speculative sampling against the
CURRENT residual r (r = p at first): accept c_j with probability min(1, r(c_j)/q_j(c_j)); on rejection
r <- norm(max(0, r - q_j)). One such step emits a token distributed exactly as r (Leviathan et al. 2023,
Theorem 1), and a rejection leaves the residual whose further sampling completes that law; by induction over the
children the emitted token has law p, and if every child is rejected the bonus is drawn from the final residual.
For point masses the rule is SpecInfer's: accept c with probability r(c), else zero r(c) and renormalise. The walk
continues at the accepted child with the target's distribution there, so every emitted token is distributed
exactly as the target's next token given the prefix.
"""

from __future__ import annotations

import torch

from .drafter import Accepted
from .tree import DraftTree


def verify_greedy(tree: DraftTree, greedy: torch.Tensor) -> Accepted:
    """greedy (B, n): the target's argmax at every node."""
    b, n = tree.tokens.shape
    if n == 1:  # the root alone (plain decoding): kept, and the target's token follows; a few ops, not twenty
        emitted = greedy[:, :1]
        return Accepted(torch.zeros_like(emitted), emitted, torch.ones(b, dtype=torch.long, device=greedy.device),
                        [[0] for _ in range(b)], emitted.tolist())  # the step's one transfer to the host
    correct = tree.tokens == greedy.gather(1, tree.parents.clamp_min(0))
    correct[:, 0] = True
    path_ok = ~(tree.ancestors & ~correct[:, None, :]).any(dim=2)  # (B, n) every node on the path is correct
    best = torch.where(path_ok, tree.depths, -1).argmax(dim=1)  # (B,)
    host = torch.cat([best[:, None], tree.parents, tree.tokens, greedy], dim=1).tolist()
    paths, tokens = [], []
    for row in host:
        path, parents = [row[0]], row[1: 1 + n]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        paths.append(path)
        tokens.append([row[1 + n + i] for i in path[1:]] + [row[1 + 2 * n + path[-1]]])
    return Accepted.from_host(paths, tokens, n, greedy.device)


def verify_sampling_rows(probs: torch.Tensor, tree: DraftTree, generator: torch.Generator | None) -> Accepted:
    """probs (B, n, V): processed target probabilities at every node; each row walks its own tree (host)."""
    paths, tokens = zip(*(verify_sampling(probs[k], tree.row(k), generator) for k in range(tree.tokens.shape[0])))
    return Accepted.from_host(list(paths), list(tokens), tree.size, tree.tokens.device)


def children_lists(tree: DraftTree) -> list[list[int]]:
    """Children of each node of a one-row tree in index order (the drafter's: siblings by descending draft score)."""
    kids: list[list[int]] = [[] for _ in range(tree.size)]
    for child, parent in enumerate(tree.parents[0].tolist()):
        if parent >= 0:
            kids[parent].append(child)
    return kids


def residual(r: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """What is left of distribution r after rejecting `token` drawn from q (None: a point mass): max(0, r - q),
    not normalised."""
    return r.index_fill(0, torch.tensor([token], device=r.device), 0.0) if q is None else (r - q).clamp_min(0)


def verify_sampling(probs: torch.Tensor, tree: DraftTree,
                    generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """Recursive rejection sampling down a one-row tree (see the module docstring for the exactness argument), with
    probs (n, V) the processed target probabilities at every node. Returns the accepted node indices (root first)
    and the emitted tokens (accepted drafts + the bonus)."""
    kids = children_lists(tree)
    token_ids = tree.tokens[0].tolist()
    path = [0]
    r = probs[0]
    while True:
        for child in kids[path[-1]]:
            x = token_ids[child]
            q = tree.q[0, child] if tree.q is not None else None
            u = torch.rand((), generator=generator, device=r.device, dtype=r.dtype)
            # accept with probability min(1, r(x) / q(x)); a point mass has q(x) = 1
            if bool(u * (q[x] if q is not None else 1) < r[x]):
                break
            rest = residual(r, x, q)
            mass = rest.sum()
            if not bool(mass > 0):  # only reachable through float rounding when x held all of r's mass
                break
            r = rest / mass
        else:  # no child accepted (or none): the bonus comes from the residual
            bonus = int(torch.multinomial(r, 1, generator=generator))
            break
        path.append(child)
        r = probs[child]
    return path, [token_ids[i] for i in path[1:]] + [bonus]
