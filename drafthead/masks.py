"""Additive float attention masks (0 = attend, finfo.min = blocked), shaped (B, 1, queries, keys).

transformers' sdpa and eager attention both honour a 4D additive float mask in the model dtype; a bool
mask is silently wrong under eager. Every mask in this project is built here.
"""

from __future__ import annotations

import torch


def to_additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (…, Q, K) allowed-matrix -> additive float mask (B, 1, Q, K) in `dtype`."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask


def buffer_mask(allowed: torch.Tensor, start: int | torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (1, 1, n, capacity) over a preallocated KV buffer: every slot before `start`, then the bool
    pattern `allowed` (n, m) in slots start..start+m-1, nothing after. `start` may be a 0-dim tensor (a compiled
    step then keeps one graph whatever the sequence length): the mask is arithmetic on slot offsets, no slicing."""
    n, m = allowed.shape
    offset = torch.arange(capacity, device=allowed.device) - start  # slot - start
    visible = offset < 0
    if m:
        visible = visible | ((offset < m) & allowed.index_select(1, offset.clamp(0, m - 1)))
    return to_additive(visible.expand(n, capacity), dtype)


def causal_allowed(q_len: int, past_len: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """bool (q_len, past_len + q_len): query i sees every past key and new keys 0..i."""
    new = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    past = torch.ones(q_len, past_len, dtype=torch.bool, device=device)
    return torch.cat([past, new], dim=1)


def causal_mask(q_len: int, past_len: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive causal mask (1, 1, q_len, past_len + q_len)."""
    return to_additive(causal_allowed(q_len, past_len, device), dtype)


def ttt_allowed(length: int, step: int, device=None) -> torch.Tensor:
    """bool (L, (step+1)·L) for training-time-test step `step` (0-based).

    Keys are laid out as [step-0 block | step-1 block | ... | step-`step` block], each L long. A query at
    index t sees the step-0 keys 0..t (the real prefix) and, in every later block, only index t: its own
    chain of drafted ancestors, exactly what it would see in a drafted tree at inference.
    """
    blocks = [torch.ones(length, length, dtype=torch.bool, device=device).tril()]
    eye = torch.eye(length, dtype=torch.bool, device=device)
    blocks += [eye] * step
    return torch.cat(blocks, dim=1)
