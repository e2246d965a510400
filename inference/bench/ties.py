"""Explain a greedy divergence between speculative and plain decoding (bf16 benchmarks).

In low precision a tree forward and a one-token forward sum the same numbers in different orders, so greedy outputs
may part only where the target's two candidates are (nearly) tied; anything else is a bug.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn


def bf16_resolution(x: float) -> float:
    """Spacing between adjacent bfloat16 numbers at |x| (8 significant bits: 2^(floor(log2|x|) - 7))."""
    x = abs(float(x))
    return 2.0 ** (math.floor(math.log2(x)) - 7) if x else 2.0**-133  # 0: the smallest bf16 subnormal


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First index where two 1-D token sequences differ (a length difference counts), else None."""
    a, b = a.reshape(-1), b.reshape(-1)
    n = min(a.numel(), b.numel())
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0, 0]) if diff.numel() else (None if a.numel() == b.numel() else n)


@dataclass
class Divergence:
    position: int  # index into the full sequence where the outputs first differ
    spec_token: int
    ref_token: int
    spec_logit: float  # target logits at that position from a fresh forward over the common prefix
    ref_logit: float
    top2: tuple[int, int]  # the fresh forward's two best tokens (ties broken arbitrarily)
    gap: float  # |spec_logit - ref_logit|
    resolution: float  # bf16 spacing at the top logit's magnitude
    is_near_tie: bool  # see explain_divergence
    exact_gap: float | None = None  # float32 reference (when given): logit(ref token) - logit(spec token)
    precision_error: float | None = None  # largest |low-precision - float32| logit error of the two tokens


@torch.inference_mode()
def explain_divergence(target: nn.Module, spec_sequence: torch.Tensor, ref_sequence: torch.Tensor,
                       tolerance_ulps: float = 1.0, reference: nn.Module | None = None) -> Divergence | None:
    """spec_sequence, ref_sequence ((1, n) or (n,)): the prompt + the speculative / plain greedy output. None when
    equal (or one stops early on an equal prefix); else the target's logits at the first differing position, from
    one forward over the common prefix in the target's dtype. A near-tie: both chosen tokens within `tolerance_ulps`
    bf16 steps of the top logit, or, given `reference` (the target in float32), float32 prefers the plain token by
    no more than twice the larger |low - float32| error of the two logits (each path may err that much, in opposite
    directions) plus one bf16 step."""
    spec, ref = spec_sequence.reshape(-1), ref_sequence.reshape(-1)
    pos = first_divergence(spec, ref)
    if pos is None or pos >= min(spec.numel(), ref.numel()):
        return None
    prefix = ref[:pos].view(1, -1).to(next(target.parameters()).device)
    logits = target(prefix, logits_to_keep=1).logits[0, -1]  # (V,) model dtype
    a, b = int(spec[pos]), int(ref[pos])
    la, lb = float(logits[a]), float(logits[b])
    top = torch.topk(logits.float(), 2)
    best = float(top.values[0])
    res = bf16_resolution(best)
    tie = best - min(la, lb) <= tolerance_ulps * res  # both chosen tokens are (nearly) tied for the top
    exact_gap = error = None
    if reference is not None:
        exact = reference(prefix, logits_to_keep=1).logits[0, -1].float()  # (V,)
        exact_gap = float(exact[b] - exact[a])
        error = max(abs(la - float(exact[a])), abs(lb - float(exact[b])))
        tie = tie or exact_gap <= 2 * error + res
    return Divergence(pos, a, b, la, lb, tuple(int(i) for i in top.indices), abs(la - lb), res, tie, exact_gap, error)
