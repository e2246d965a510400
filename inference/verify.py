"""Tree verification: greedy (exact argmax match) and lossless sampling (recursive rejection sampling).

Both return (path, new_tokens): path (a+1,) the accepted tree indices, root first; new_tokens (a+1,) the
accepted drafted tokens followed by the bonus token drawn from the target at the last accepted node.

Sampling, for a tree whose children are deterministic (top-k of the draft, distinct tokens): at a node with
target distribution p, try the children c1, c2, ... in order. Each proposal is a point mass (q(c)=1), so the
SpecInfer/EAGLE rule min(1, p(c)/q(c)) accepts c with probability p(c) under the CURRENT residual; on rejection
p(c) is set to 0 and p renormalised. Then P(emit c_j) = p(c_j) exactly: by induction the residual after
rejecting c1..c_{j-1} is p restricted to the other tokens, renormalised; accepting c_j there has probability
p(c_j)/(1 - sum_{i<j} p(c_i)), and reaching it has probability 1 - sum_{i<j} p(c_i). If every child is rejected
the bonus is drawn from the final residual, which gives each remaining token x probability p(x). The emitted
token therefore has law p; the walk continues at the accepted child with the target's distribution there, so
every emitted token is distributed exactly as the target's next token given the prefix.
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


def verify_sampling(
    probs: torch.Tensor,  # (n, V) processed target probabilities at every tree node
    tree: DraftTree,
    generator: torch.Generator | None = None,
    children: list[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling down the tree (see the module docstring for the exactness argument)."""
    kids = children_lists(tree) if children is None else children
    tokens = tree.tokens[0]
    node, path = 0, [0]
    p = probs[0]
    while True:
        ch = kids[node]
        if ch:
            ch_t = torch.tensor(ch, device=tokens.device)
            toks = tokens[ch_t]  # (m,)
            pc = p[toks]
            left = p.sum() - (torch.cumsum(pc, 0) - pc)  # residual mass before trying each child
            u = torch.rand(len(ch), generator=generator, device=p.device, dtype=p.dtype)
            accept = u * left < pc  # u < p(c) / residual, without dividing by a residual that may be 0
            hit = int(torch.argmax(accept.to(torch.uint8)))
            if bool(accept[hit]):
                node = ch[hit]
                path.append(node)
                p = probs[node]
                continue
            p = p.clone()
            p[toks] = 0
            if not bool(p.any()):  # only reachable through float rounding when the children hold all the mass
                node = ch[int(torch.argmax(pc))]
                path.append(node)
                p = probs[node]
                continue
        bonus = torch.multinomial(p, 1, generator=generator)  # multinomial normalises p itself
        break
    path_t = torch.tensor(path, device=tokens.device)
    return path_t, torch.cat([tokens[path_t[1:]], bonus])
