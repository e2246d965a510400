"""The training data path: which micro-batches each optimizer step of a rank reads (from any data position, for
any world size), and the DataLoader that reads and collates them, optionally in worker processes.

A data position is (epoch, consumed): `consumed` counts the epoch's GLOBAL micro-batches (train.batches.epoch_batches,
before they are dealt to ranks) that finished optimizer steps used. Batches are dealt round-robin, so one step of W
ranks with grad_accum G consumes the next G·W global batches, whatever W and G are: a run resumed with another world
size deals the rest of the epoch to its own ranks and neither repeats nor skips a sequence. A position at the end of
an epoch is written as (epoch + 1, 0), so the batches an epoch drops (fewer than G·W left) are never trained on.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from train.batches import clip_items, collate, epoch_batches


@dataclass(frozen=True)
class Position:
    """Where the data stands: `consumed` global micro-batches of `epoch` are trained on."""

    epoch: int = 0
    consumed: int = 0


@dataclass(frozen=True)
class Step:
    """One optimizer step of this rank: its micro-batches (lists of sequence indices) and the position after it."""

    epoch: int
    group: list[list[int]]
    after: Position


class StepPlan:
    """The deterministic schedule of a rank: global epoch order (seed, epoch, lengths) dealt round-robin over
    `world_size` ranks, grad_accum micro-batches per step, from any Position."""

    def __init__(self, lengths: list[int], seed: int, batch_size: int | None, batch_tokens: int | None,
                 max_length: int | None, grad_accum: int, rank: int, world_size: int):
        self.lengths, self.seed, self.grad_accum = lengths, seed, grad_accum
        self.batch_size, self.batch_tokens, self.max_length = batch_size, batch_tokens, max_length
        self.rank, self.world_size = rank, world_size

    @functools.lru_cache(maxsize=2)
    def epoch(self, epoch: int) -> list[list[int]]:
        """All global micro-batches of an epoch (cached: the sampler and the trainer walk the same epochs)."""
        return epoch_batches(self.lengths, self.seed, epoch, self.batch_size,
                             None if self.batch_size else self.batch_tokens, self.max_length)

    def steps_in_epoch(self, epoch: int, consumed: int = 0) -> int:
        """Optimizer steps left in `epoch` after `consumed` global micro-batches (an epoch with none is refused)."""
        steps = (len(self.epoch(epoch)) - consumed) // (self.world_size * self.grad_accum)
        if steps <= 0 and consumed == 0:
            raise ValueError(f"an epoch has {len(self.epoch(epoch))} micro-batches, fewer than "
                             f"{self.world_size} processes x train.grad_accum={self.grad_accum}: "
                             "add data or shrink batches")
        return max(steps, 0)

    def steps(self, start: Position) -> Iterator[Step]:
        """This rank's optimizer steps from `start` on, epoch after epoch (endless)."""
        epoch, consumed = start.epoch, start.consumed
        per_step = self.world_size * self.grad_accum
        while True:
            batches = self.epoch(epoch)
            n = self.steps_in_epoch(epoch, consumed)
            for s in range(n):
                first = consumed + s * per_step  # this step reads global batches [first, first + per_step)
                group = [batches[first + m * self.world_size + self.rank] for m in range(self.grad_accum)]
                after = Position(epoch + 1, 0) if s == n - 1 else Position(epoch, first + per_step)
                yield Step(epoch, group, after)
            epoch, consumed = epoch + 1, 0


class PlanSampler(Sampler[list[int]]):
    """Batch sampler of a DataLoader: the micro-batches of `num_steps` steps of `plan` from `start`, in order."""

    def __init__(self, plan: StepPlan, start: Position, num_steps: int):
        self.plan, self.start, self.num_steps = plan, start, num_steps

    def __iter__(self) -> Iterator[list[int]]:
        for step in itertools.islice(self.plan.steps(self.start), self.num_steps):
            yield from step.group

    def __len__(self) -> int:
        return self.num_steps * self.plan.grad_accum


def make_loader(dataset: Dataset, batch_sampler, max_length: int | None, online: bool, num_workers: int,
                device: torch.device) -> DataLoader:
    """A DataLoader over `dataset` in the order of `batch_sampler`: offline it yields collated (padded) batches;
    online, lists of clipped token items (the target computes their features in the main process)."""
    collate_fn: Callable = functools.partial(clip_items if online else collate, max_length=max_length)
    # Workers come from a forkserver, never a plain fork of this process: by the time a loader starts, the trainer
    # runs other threads (gloo, TensorBoard's writer, tqdm's monitor, the feeder threads of an earlier loader), and
    # CPython 3.11 can deadlock in the forked child's thread-state cleanup when one of them is starting or ending at
    # the instant of the fork (seen here: a 2-rank run hung for good about once in 200 loader starts).
    context = "forkserver" if num_workers > 0 else None
    return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate_fn, num_workers=num_workers,
                      pin_memory=device.type == "cuda", prefetch_factor=4 if num_workers > 0 else None,
                      multiprocessing_context=context)
