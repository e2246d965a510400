"""The batched decoding loop: every row drafts its tree, the target verifies all rows' trees in ONE forward, each
row keeps its own accepted path, and rows that stop leave the batch.

Host syncs per step, each needed: each row's accepted tokens (`.tolist()`: stop checks), each row's accepted path
(`nonzero` in verify_greedy; sampling walks the tree on the host), the longest row (the runner's write slot), and
on CUDA the timers. Per-row work on the host is a loop over at most B rows of a few small ops.

A row that stops stays in the batch, verified but never committed, until the finished rows are half the batch;
then they all leave every buffer at once (one copy of the KV buffers pays for itself when it halves every later
step, while dropping each row as it ends could copy the buffers once per row).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from .batch_runner import BatchRunner
from .batch_tree import BatchDrafter
from .sampling import SamplingParams, pick_next, target_probs
from .verify import verify_greedy, verify_sampling


def decode_batch(runner: BatchRunner, drafter: BatchDrafter, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 params: SamplingParams, stoppers: list[Any], generator: torch.Generator | None,
                 stats: Any, sync: Callable[[], None], prefilled: tuple | None = None) -> list[list[int]]:
    """Decode every row of left-padded `input_ids` (B, T) until its stopper says so. Returns each row's new
    tokens; fills `stats` (per-row accepted lengths, draft and verify time, prefill_time_s). `prefilled`: the
    (logits, features) of runner.prefill() already run on these rows (a benchmark reusing one prefill)."""
    t0 = time.perf_counter()
    logits, features = prefilled if prefilled is not None else runner.prefill(input_ids, attention_mask)
    roots = pick_next(logits, params, generator)  # (B,)
    drafter.begin(runner, input_ids, attention_mask, features)
    sync()
    stats.target_forwards += 1
    stats.prefill_time_s = time.perf_counter() - t0
    rows = list(range(input_ids.shape[0]))  # original row of each row in the batch
    done = [False] * len(rows)  # finished rows still in the batch (verified, never committed)
    new: list[list[int]] = [[] for _ in rows]
    stats.rows_steps = [0] * len(rows)
    batches = [[t] for t in roots.tolist()]
    empty = torch.zeros(0, dtype=torch.long, device=roots.device)
    while True:
        for k, row in enumerate(rows):
            if not done[k]:
                keep = stoppers[row].cut(new[row], batches[k])
                new[row] += batches[k] if keep is None else batches[k][:keep]
                done[k] = keep is not None
        if all(done):
            break
        if 2 * sum(done) >= len(rows):  # finished rows leave every buffer once they are half the batch
            alive = [k for k in range(len(rows)) if not done[k]]
            index = torch.tensor(alive, device=roots.device)
            runner.keep_rows(index)
            drafter.keep_rows(index)
            rows, roots, done = [rows[k] for k in alive], roots[index], [False] * len(alive)
        t0 = time.perf_counter()
        tree = drafter.propose(roots, params, generator)
        sync()
        t1 = time.perf_counter()
        logits, features, greedy = runner.verify(tree.tokens, tree.depths, tree.ancestors)
        paths, accepted = [], []
        for k in range(len(rows)):
            if done[k]:
                path, tokens = empty, empty
            elif params.do_sample:
                path, tokens = verify_sampling(target_probs(logits[k], params), tree.row(k), generator)
            else:
                path, tokens = verify_greedy(None, tree.row(k), greedy[k])
            paths.append(path)
            accepted.append(tokens)
        runner.commit(paths)
        drafter.accept(paths, accepted, features)
        batches = [tokens.tolist() for tokens in accepted]
        roots = torch.stack([tokens[-1] if tokens.numel() else root for tokens, root in zip(accepted, roots)])
        sync()
        stats.target_forwards += 1
        stats.accept_lengths += [len(b) for b, d in zip(batches, done) if not d]
        for row, d in zip(rows, done):
            stats.rows_steps[row] += not d
        stats.draft_time_s += t1 - t0
        stats.verify_time_s += time.perf_counter() - t1
    return new

