"""EAGLE-3 training-time test: unroll the head on its own outputs over a whole sequence.

Sequence x_0..x_{T-1} with target features f_t. Step 0 sees the pairs (f_t, x_{t+1}) at position t and
predicts x_{t+2}. Step i feeds the head's own step-(i-1) output at index t together with the true token
x_{t+i+1}, at position t+i, and predicts x_{t+i+2}. Attention at step i sees the real prefix (step-0 keys
0..t) plus the diagonal of every earlier step: the chain a drafted tree would hold (see masks.ttt_allowed).

The attention of step i is computed as that structure, not as a dense mask over its (i+1)·L keys: one causal
L × L block against the step-0 keys, plus one score per later block (query t against that block's key t), all
under one softmax (`ttt_attention`). A dense masked attention does (i+1) times the work of the first block; over
7 steps that is 28 blocks where this does 7 plus the diagonals (the attention's share of a training step fell about
fourfold: docs/results/HISTORY.md).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from .masks import causal_mask
from .model import DraftHead, HeadKVCache

TTT_ATTENTION = "drafthead_ttt"


def ttt_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of one unroll step: query (B, heads, L, D); key/value (B, kv_heads, blocks·L, D), the blocks of
    steps 0..blocks-1 in order; attention_mask (B or 1, 1, L, L) additive over the step-0 block (causal). Query t
    sees the step-0 keys its mask allows and key t of every later block. Returns ((B, L, heads, D), None)."""
    b, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    groups, blocks = heads // kv_heads, key.shape[2] // length
    scaling = dim**-0.5 if scaling is None else scaling
    q = (query * scaling).reshape(b, kv_heads, groups, length, dim)  # query head h reads KV head h // groups
    first_keys, first_values = key[:, :, :length], value[:, :, :length]
    later_keys = key[:, :, length:].reshape(b, kv_heads, blocks - 1, length, dim)
    later_values = value[:, :, length:].reshape(b, kv_heads, blocks - 1, length, dim)
    prefix = torch.matmul(q.reshape(b, kv_heads, groups * length, dim), first_keys.transpose(2, 3))
    prefix = prefix.view(b, kv_heads, groups, length, length)
    if attention_mask is not None:
        prefix = prefix + attention_mask[:, :, None, :, :length]
    diagonal = torch.einsum("bkgld,bksld->bkgls", q, later_keys)  # (B, kv, groups, L, blocks-1)
    probs = torch.cat([prefix, diagonal], dim=-1).softmax(-1)  # (low precision: computed in float, rounded once)
    out = torch.matmul(probs[..., :length].reshape(b, kv_heads, groups * length, length), first_values)
    out = out.view(b, kv_heads, groups, length, dim)
    out = out + torch.einsum("bkgls,bksld->bkgld", probs[..., length:], later_values)
    return out.reshape(b, heads, length, dim).transpose(1, 2), None


AttentionInterface.register(TTT_ATTENTION, ttt_attention)


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
    mask = causal_mask(length, 0, hidden.dtype, input_ids.device)  # the step-0 block's; later blocks: diagonal
    cache = HeadKVCache()
    outputs = []
    config = head.midlayer.self_attn.config
    previous, config._attn_implementation = config._attn_implementation, TTT_ATTENTION
    try:
        for step in range(steps):
            tokens = input_ids[:, 1 + step :]  # true tokens x_{t+step+1}
            tokens = torch.nn.functional.pad(tokens, (0, length - tokens.shape[1]), value=0)
            hidden = head(tokens, hidden, base_positions + step, mask, cache)
            outputs.append(hidden)
    finally:
        config._attn_implementation = previous
    return outputs
