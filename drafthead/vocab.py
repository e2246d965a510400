"""Draft vocabulary: the N most frequent target tokens among the tokens the assistant wrote.

d2t: int64 (draft_vocab,)  target_id = draft_id + d2t[draft_id]   (the serving engines' convention)
t2d: bool  (vocab,)        True where a target token has a draft id
Draft ids are assigned in increasing target-id order, so the mapping is deterministic for given counts.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def token_frequencies(sequences: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Count target tokens where loss_mask is set. sequences: (input_ids (T,), loss_mask (T,)) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for input_ids, loss_mask in sequences:
        ids = torch.as_tensor(input_ids).long()[torch.as_tensor(loss_mask).bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`draft_vocab_size` tokens by count (ties -> lower id) -> (d2t, t2d)."""
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab_size}, got {draft_vocab_size}")
    # stable descending sort by count, so ties keep the lower target id
    order = torch.sort(-counts.long(), stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values  # target ids, increasing
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def full_vocab(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The identity mapping (draft vocabulary = target vocabulary)."""
    return torch.zeros(vocab_size, dtype=torch.int64), torch.ones(vocab_size, dtype=torch.bool)
