"""Tree verification: greedy (exact argmax match) and lossless sampling (recursive rejection sampling).

Both return (path, new_tokens): path (a+1,) the accepted tree indices, root first; new_tokens (a+1,) the
accepted drafted tokens followed by the bonus token drawn from the target at the last accepted node.

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

from .tree import DraftTree


def verify_greedy(logits: torch.Tensor | None, tree: DraftTree,
                  pred: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (n, V) or their argmax pred (n,): the longest path whose every token is the target's argmax after
    its parent, + bonus."""
    if pred is None:
        pred = logits.argmax(dim=-1)  # (n,)
    tokens = tree.tokens[0]
    correct = tokens == pred[tree.parents.clamp_min(0)]
    correct[0] = True
    path_ok = ~(tree.ancestors & ~correct[None, :]).any(dim=1)  # (n,) every node on the path is correct
    best = torch.where(path_ok, tree.depths, -1).argmax()
    path = tree.ancestors[best].nonzero().squeeze(1)  # index order = depth order
    return path, torch.cat([tokens[path[1:]], pred[best].view(1)])


def children_lists(tree: DraftTree) -> list[list[int]]:
    """Children of each node in index order (the drafter's order: siblings by descending draft score)."""
    kids: list[list[int]] = [[] for _ in range(tree.size)]
    for child, parent in enumerate(tree.parents.tolist()):
        if parent >= 0:
            kids[parent].append(child)
    return kids


def residual(r: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """What is left of distribution r after rejecting `token` drawn from q (None: a point mass): max(0, r - q),
    not normalised."""
    if q is None:
        r = r.clone()
        r[token] = 0
        return r
    return (r - q).clamp_min(0)


def verify_sampling(
    probs: torch.Tensor,  # (n, V) processed target probabilities at every tree node
    tree: DraftTree,
    generator: torch.Generator | None = None,
    children: list[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling down the tree (see the module docstring for the exactness argument)."""
    kids = children_lists(tree) if children is None else children
    tokens = tree.tokens[0]
    token_ids = tokens.tolist()
    node, path = 0, [0]
    r = probs[0]
    while True:
        for child in kids[node]:
            x = token_ids[child]
            q = tree.q[child] if tree.q is not None else None
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
            bonus = torch.multinomial(r, 1, generator=generator)
            break
        node = child
        path.append(node)
        r = probs[node]
    path_t = torch.tensor(path, device=tokens.device)
    return path_t, torch.cat([tokens[path_t[1:]], bonus])
