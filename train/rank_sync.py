"""Values every rank must hold alike: rank 0's copy broadcast to all, and a checksum comparison that names the
ranks holding something else (the draft vocabulary: a rank with another d2t would train a different head)."""

from __future__ import annotations

import hashlib

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast


def checksum(tensor: torch.Tensor) -> int:
    """A 63-bit digest of a tensor's dtype, shape and bytes (equal tensors, equal digests, on any device)."""
    t = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + t.view(torch.uint8).numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def check_same_on_ranks(accelerator: Accelerator, tensors: dict[str, torch.Tensor], what: str) -> None:
    """Raise on every rank unless every rank holds the same `tensors` (gathers one checksum per tensor; collective)."""
    if accelerator.num_processes == 1:
        return
    sums = torch.tensor([[checksum(tensors[name]) for name in sorted(tensors)]], device=accelerator.device)
    gathered = accelerator.gather(sums).cpu()  # (world_size, len(tensors))
    differ = [rank for rank in range(len(gathered)) if not torch.equal(gathered[rank], gathered[0])]
    if differ:
        raise RuntimeError(f"{what} ({', '.join(sorted(tensors))}) differs between ranks: rank(s) {differ} hold "
                           f"another value than rank 0; every rank must train the same head")


def share_draft_vocab(accelerator: Accelerator, head: torch.nn.Module) -> None:
    """Give every rank rank 0's draft vocabulary (d2t, t2d of an EAGLE-3 head), then check that they agree."""
    if accelerator.num_processes == 1 or not getattr(head, "eagle3", False):
        return
    with torch.no_grad():
        for buffer in (head.d2t, head.t2d):
            buffer.copy_(broadcast(buffer.long(), from_process=0))  # as int64: gloo has no bool
    check_same_on_ranks(accelerator, {"d2t": head.d2t, "t2d": head.t2d}, "the draft vocabulary")
