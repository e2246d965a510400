"""The decoding loop, for every batch size (batch 1 is B = 1): prefill, then {propose, verify, accept, commit, stop}.

Every row drafts its tree and the target verifies all rows' trees in ONE forward; each row keeps its own accepted
path. Host syncs per step: the accepted paths and tokens of every row, in one transfer (verify.py; sampling walks
each row's tree on the host instead). A row that stops takes the next waiting request, if any (continuous batching:
runner.admit and drafter.admit); without waiting requests it leaves at once, a row from the back taking its place,
so the rows still decoding stay the leading rows of the runner's buffers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from .drafter import Drafter
from .sampling import SamplingParams, pick_next, target_probs
from .stats import GenerationStats
from .switch import SpeculationSwitch
from .tree import DraftTree
from .verify import verify_greedy, verify_sampling_rows


@dataclass
class Request:
    """A prefilled request waiting for a row (its KV as StaticRunner.export_rows gives it)."""

    ids: torch.Tensor  # (T,) its prompt
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # the prompt's KV per layer, each (1, kv_heads, T, head_dim)
    logits: torch.Tensor  # (V,) the prompt's last logits
    features: torch.Tensor | None  # (T, F) the head's features, or None
    stopper: Any  # the stop conditions of its row


def left_pad(prompts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D prompts -> left-padded input_ids (B, T) and attention_mask (B, T), on the prompts' device."""
    return (pad_sequence([p.long() for p in prompts], batch_first=True, padding_side="left"),
            pad_sequence([torch.ones_like(p.long()) for p in prompts], batch_first=True, padding_side="left"))


def prefilled_requests(runner, prompts: Sequence[torch.Tensor], group: int, stopper: Callable[[], Any],
                       stats: Any = None) -> Iterator[Request]:
    """A queue of prompts for continuous batching: each prompt as a waiting Request, prefilled `group` at a time
    when the decoder asks for the next one, on a second `runner` (a StaticRunner reset for each group), so the
    queue's KV is never in memory at once; counted in `stats` if given (prefill_time_s, target_forwards)."""
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


def decode(runner, drafter: Drafter, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
           stoppers: list[Any], generator: torch.Generator | None, stats: GenerationStats,
           sync: Callable[[], None] = lambda: None, prefilled: tuple | None = None,
           waiting: Iterator[Request] | None = None, switch: SpeculationSwitch | None = None,
           streamer: Any = None) -> list[list[int]]:
    """Decode every row of left-padded `input_ids` (B, T) until its stopper says so, then each `waiting` request in
    the first row that frees up. Returns the new tokens of each row, then of each admitted request in admission
    order; fills `stats`. `prefilled`: the (logits, features) of runner.prefill() already run on these rows (a
    benchmark reusing one prefill). `switch`: speculate only on the steps where it pays (switch.py). `streamer`
    (one row): receives the prompt, then each step's emitted tokens. `sync`: waits for the device (profiling)."""
    if switch is not None:
        switch.reset()
    if streamer is not None:
        streamer.put(input_ids.cpu())
    t0 = time.perf_counter()
    logits, features = prefilled if prefilled is not None else runner.prefill(input_ids, attention_mask)
    roots = pick_next(logits, params, generator)  # (B,)
    drafter.begin(runner, input_ids, attention_mask, features)
    batches = [[t] for t in roots.tolist()]
    stats.target_forwards += 1
    start = time.perf_counter()  # decoding starts: the busy steps are timed from here
    stats.prefill_time_s = start - t0
    busy = False  # whether the last step had every row of the batch decoding
    stoppers = list(stoppers)
    rows = list(range(input_ids.shape[0]))  # the request each row of the batch decodes
    done = [False] * len(rows)  # rows whose request has stopped: they leave (or take a request) before the next step
    new: list[list[int]] = [[] for _ in rows]
    stats.rows_steps = [0] * len(rows)

    def settle(k: int) -> None:  # row k's new tokens, up to where its request stops
        keep = stoppers[rows[k]].cut(new[rows[k]], batches[k])
        emitted = batches[k][:keep]
        new[rows[k]] += emitted
        done[k] = keep is not None
        if streamer is not None and emitted:
            streamer.put(torch.tensor(emitted))

    while True:
        for k in range(len(rows)):
            if not done[k]:
                settle(k)
        if busy:  # the rate with every row busy (a server's steady state), apart from a queue's tail
            stats.busy_steps += 1
            stats.busy_tokens = sum(len(tokens) for tokens in new)
            stats.busy_time_s = time.perf_counter() - start
        while waiting is not None and any(done):  # continuous batching: a finished row takes the next request
            request = next(waiting, None)
            if request is None:
                waiting = None
                break
            a0 = time.perf_counter()
            k = done.index(True)
            runner.admit(k, request.kv)
            drafter.admit(k, runner, request.ids, request.features)
            roots = roots.clone()
            roots[k] = pick_next(request.logits[None], params, generator)[0]
            rows[k], batches[k] = len(new), [int(roots[k])]
            new.append([])
            stoppers.append(request.stopper)
            stats.rows_steps.append(0)
            settle(k)
            stats.admit_time_s += time.perf_counter() - a0
        if all(done):
            break
        if waiting is None and any(done):  # finished rows leave: rows from the back fill their places
            alive = [k for k in range(len(rows)) if not done[k]]
            back = [k for k in alive if k >= len(alive)]
            alive = [back.pop() if done[k] else k for k in range(len(alive))]
            index = torch.tensor(alive, device=roots.device)
            runner.keep_rows(index)
            drafter.keep_rows(index)
            rows, roots, done = [rows[k] for k in alive], roots[index], [False] * len(alive)
        busy = len(rows) == input_ids.shape[0]  # (no finished row is left in the batch by now)
        t0 = time.perf_counter()
        speculate = switch is None or switch.speculate(rows)
        if speculate:
            tree = drafter.propose(roots, params, generator)
        else:
            drafter.skip(roots)
            tree = DraftTree.chain(roots)
        sync()
        t1 = time.perf_counter()
        logits, features, greedy = runner.verify(tree.tokens, tree.depths, tree.ancestors, drafter.tree_size)
        accepted = (verify_sampling_rows(target_probs(logits, params), tree, generator) if params.do_sample
                    else verify_greedy(tree, greedy))
        runner.commit(accepted)
        drafter.accept(accepted, features)
        batches = accepted.host_tokens
        roots = accepted.tokens.gather(1, accepted.counts[:, None] - 1)[:, 0]  # each row's bonus token
        stats.count(tree, accepted, drafter.origin_names)
        for row in rows:
            stats.rows_steps[row] += 1
        stats.draft_time_s += t1 - t0
        stats.verify_time_s += time.perf_counter() - t1
        if switch is not None:
            switch.record(speculate, rows, time.perf_counter() - t0, [len(b) for b in batches])
            stats.plain_steps += not speculate
    if streamer is not None:
        streamer.end()
    return new
