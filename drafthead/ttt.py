"""EAGLE-3 training-time test: unroll the head on its own outputs over a whole sequence.

Sequence x_0..x_{T-1} with target features f_t. Step 0 sees the pairs (f_t, x_{t+1}) at position t and
predicts x_{t+2}. Step i feeds the head's own step-(i-1) output at index t together with the true token
x_{t+i+1}, at position t+i, and predicts x_{t+i+2}. Attention at step i sees the real prefix (step-0 keys
0..t) plus the diagonal of every earlier step: the chain a drafted tree would hold (see masks.ttt_allowed).
"""

from __future__ import annotations

import torch

from .masks import ttt_mask
from .model import DraftHead, HeadKVCache


def ttt_unroll(
    head: DraftHead,
    input_ids: torch.Tensor,  # (B, T)
    target_features: torch.Tensor,  # (B, T, k·TH) aux hidden states (EAGLE-1: last hidden, (B, T, H))
    steps: int,
) -> list[torch.Tensor]:
    """Return the head's output hidden states per unroll step, each (B, T-1, H).

    Output index t of step i predicts token t+i+2 (logits via head.logits). Positions past the end of the
    sequence are fed token 0 and must be masked out of any loss (t+i+2 >= T).
    """
    bsz, seq_len = input_ids.shape
    length = seq_len - 1
    hidden = head.fuse(target_features[:, :-1])  # (B, L, H)
    base_positions = torch.arange(length, device=input_ids.device).expand(bsz, length)
    cache = HeadKVCache()
    outputs = []
    for step in range(steps):
        tokens = input_ids[:, 1 + step :]  # true tokens x_{t+step+1}
        tokens = torch.nn.functional.pad(tokens, (0, length - tokens.shape[1]), value=0)
        mask = ttt_mask(length, step, hidden.dtype, input_ids.device)
        hidden = head(tokens, hidden, base_positions + step, mask, cache)
        outputs.append(hidden)
    return outputs
