"""A queue of prompts decoded with continuous batching (offline batch inference: data regeneration, evaluation).

Each time a row of the batch finishes, the next prompt takes its place (runner.admit), so the batch stays full
until the queue runs dry. Waiting prompts are prefilled on demand, `group` at a time, by a second runner whose
buffers hold only that group, so the queue's KV is never in memory at once. Outputs come back in the queue's order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from .decode import Request
from .runners.static import StaticRunner


def left_pad(prompts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D prompts -> left-padded input_ids (B, T) and attention_mask (B, T), on the prompts' device."""
    ids = pad_sequence([p.long() for p in prompts], batch_first=True, padding_side="left")
    mask = pad_sequence([torch.ones_like(p, dtype=torch.long) for p in prompts], batch_first=True, padding_side="left")
    return ids, mask


def prefilled_requests(runner: StaticRunner, prompts: Sequence[torch.Tensor], group: int,
                       stopper: Callable[[], Any], stats: Any = None) -> Iterator[Request]:
    """Each prompt as a waiting Request, prefilled `group` prompts at a time on `runner` (its buffers reset for each
    group) when the decoder asks for the next one; counted in `stats` if given (prefill_time_s, target_forwards)."""
    for g in range(0, len(prompts), group):
        part = prompts[g: g + group]
        t0 = time.perf_counter()
        ids, mask = left_pad(part)
        runner.reset(len(part), ids.shape[1])
        with runner.session():
            logits, features = runner.prefill(ids, mask)
        rows = runner.export_rows()
        if stats is not None:
            stats.prefill_time_s += time.perf_counter() - t0
            stats.target_forwards += 1
        for i, (prompt, row) in enumerate(zip(part, rows)):
            feats = None if features is None else features[i, ids.shape[1] - len(prompt):]
            yield Request(prompt, row["kv"], logits[i], feats, stopper())
