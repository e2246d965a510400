"""Deterministic, length-bucketed batches for every rank, and collation of feature sequences.

The order of one epoch is a pure function of (seed, epoch, lengths, world size): sequences are shuffled,
sorted by length inside windows of a few hundred batches (little padding), cut into batches, the batches
shuffled again, and dealt round-robin to the ranks. Every rank gets the same number of micro-batches (the
remainder is dropped), so ZeRO/DDP collectives always pair up. A run resumed at micro-batch m of epoch e
therefore sees exactly the batches an uninterrupted run would have seen.

Online training reads prepared data (input_ids + loss_mask) instead of features and computes the features
with the target inside the loop (`with_online_features`); everything after the features is the same code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

WINDOW_BATCHES = 64  # length-sort window, in batches


def epoch_batches(
    lengths: list[int],
    seed: int,
    epoch: int,
    batch_size: int | None = None,
    batch_tokens: int | None = None,
    max_length: int | None = None,
) -> list[list[int]]:
    """All batches (lists of sequence indices) of one epoch, before splitting across ranks.

    batch_size: fixed number of sequences per batch; batch_tokens: padded-token budget per batch
    (max length in batch x sequences <= batch_tokens, at least one sequence). Exactly one must be set.
    """
    if (batch_size is None) == (batch_tokens is None):
        raise ValueError("set exactly one of train.batch_size and train.batch_tokens")
    gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=gen).tolist()
    clip = (lambda n: min(n, max_length)) if max_length else (lambda n: n)
    window = WINDOW_BATCHES * (batch_size or max(1, batch_tokens // max(1, max(lengths, default=1))))
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: (clip(lengths[i]), i))
        current: list[int] = []
        for i in chunk:
            longest = max([clip(lengths[j]) for j in current] + [clip(lengths[i])])
            full = len(current) == batch_size if batch_size else longest * (len(current) + 1) > batch_tokens
            if current and full:
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[p] for p in perm]


def rank_batches(batches: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """Deal batches round-robin; every rank gets len(batches) // world_size of them."""
    per_rank = len(batches) // world_size
    if per_rank == 0:
        raise ValueError(f"{len(batches)} batches cannot feed {world_size} processes: add data or shrink batches")
    return batches[rank : per_rank * world_size : world_size]


def clip_items(items: list[dict[str, torch.Tensor]], max_length: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Cut every sequence of `items` (all its tensors) to max_length tokens (None: unchanged)."""
    return [{k: v[:max_length] for k, v in item.items()} for item in items] if max_length else items


def collate(items: list[dict[str, torch.Tensor]], max_length: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad a list of sequences into a batch. Padding has loss_mask False, token 0 and zero features.

    Returns input_ids (B, T) int64, loss_mask (B, T) bool and, when present, aux_hidden (B, T, k·H) and
    last_hidden (B, T, H) in their stored dtype. Right padding is invisible to causal attention.
    """
    items = clip_items(items, max_length)
    seq_len = max(len(item["input_ids"]) for item in items)
    out: dict[str, torch.Tensor] = {}
    for key in items[0]:
        first = items[0][key]
        shape = (len(items), seq_len, *first.shape[1:])
        batch = torch.zeros(shape, dtype=first.dtype)
        for row, item in enumerate(items):
            batch[row, : len(item[key])] = item[key]
        out[key] = batch
    out["input_ids"] = out["input_ids"].long()
    out["loss_mask"] = out["loss_mask"].bool()
    return out


class PreparedSequences(torch.utils.data.Dataset):
    """Prepared data (datasets folder, one split) as items of input_ids (T,) int64 and loss_mask (T,) bool."""

    def __init__(self, folder: str | Path, split: str):
        import datasets

        data = datasets.load_from_disk(str(folder))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise KeyError(f"{folder} has splits {list(data)}, no {split!r}")
            data = data[split]
        self.data = data.with_format("torch", columns=["input_ids", "loss_mask"])

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.data[i]
        return {"input_ids": row["input_ids"].long(), "loss_mask": row["loss_mask"].bool()}

    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.data.with_format(None)["input_ids"]]

    def token_arrays(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, loss_mask) of every sequence (as FeatureDataset.token_arrays, one sequence at a time)."""
        for i in range(len(self)):
            item = self[i]
            yield item["input_ids"], item["loss_mask"]


def with_online_features(items: list[dict[str, torch.Tensor]], target: torch.nn.Module, aux_layer_ids: list[int],
                         device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Add aux_hidden / last_hidden to prepared items with one target forward: the collector's own code
    (train.collect.forward_features), so online features are the bf16 numbers the feature store would hold."""
    from train.collect import forward_features

    last_layer = target.config.get_text_config().num_hidden_layers - 1
    ids = [item["input_ids"].tolist() for item in items]
    feats = forward_features(target, ids, list(aux_layer_ids), last_layer, device)
    return [{**item, "aux_hidden": aux, "last_hidden": last} for item, (aux, last) in zip(items, feats)]
