"""Hardware-aware tree budget (`--tree auto`): pick depth / top_k / total_tokens for this device and dtype (a GPU's
60-token tree is wrong on a CPU, where verifying 16 tokens already costs ~1.7x a single step).

1. Cost: time the target verifying n tree tokens and the head drafting each (depth, top_k) after a real prefix.
2. Acceptance: decode calibration prompts with a large tree, recording each drafted node's ranks and acceptance.
3. Replay: the recorded trees cut to each candidate (depth, top_k, total_tokens) give its tokens per step tau;
   predicted tokens/s = tau / (draft + verify + overhead ms).
4. Trial: the best predicted tree of each of the few best verify sizes, and plain decoding, decode the calibration
   prompts for real, taking turns (a verification costs more inside decoding than timed alone: docs/results/HISTORY.md);
   measured ms per step times replayed tau decides, and plain decoding wins unless a tree is faster.
5. Optional: the chosen tree decodes with the head pruned to a few draft vocabularies (`--draft-vocab auto`; the
   fastest stays), then alone and with the prompt-lookup branch (drafters/lookup.py; LOOKUP_BRANCH_MARGIN).
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import astuple, dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from drafthead import DraftHead
from drafthead.hardware import synchronizer

from ..drafter import Accepted
from ..drafters.eagle import HeadDrafter
from ..runners import StaticRunner
from ..runners.kv import static_cache_supported
from ..tree import TREE_PRESETS, DraftTree, TreeOptions

TOTALS = tuple(range(1, 17)) + (20, 24, 28, 32, 40, 48, 56, 60, 64, 80)
TRIAL_TREES = 4  # the best predicted tree of this many verify sizes decodes for real before the choice
ROW = ("tokens_per_s", "tau", "step_ms", "depth", "top_k", "total_tokens")  # as ranked; the last 3: TreeOptions's


@dataclass(frozen=True)
class TuningBudget:
    """How much the tuner measures (its repr is part of the tuning cache's key). FULL is the benchmark's; QUICK
    bounds a first call of the library."""

    calibration: TreeOptions = TreeOptions(depth=8, top_k=10, total_tokens=80)  # candidates are the trees inside
    depths: tuple[int, ...] = tuple(range(1, 9))  # the drafting shapes timed
    top_ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 10)
    max_verify: int = max(TOTALS)  # drafted tokens (root excluded)
    verify_reps: int = 15
    draft_reps: int = 5
    trial_trees: int = TRIAL_TREES
    rounds: int = 2  # each trial generator decodes every calibration prompt this many times (taking turns)


FULL = TuningBudget()
# every CPU tuning chose a tree a 16-token bucket holds (docs/results/cpu_tuned_tree_sizes.json): none larger is timed
QUICK = TuningBudget(calibration=TreeOptions(depth=6, top_k=8, total_tokens=32), depths=(2, 3, 4, 5, 6),
                     top_ks=(1, 2, 4, 8), max_verify=16, verify_reps=5, draft_reps=3, trial_trees=2, rounds=1)
# a tree with a larger verify bucket must beat the best smaller one by this factor in the trial: short calibration
# prompts rated larger trees a few per cent ahead that then decoded slower (docs/results/HISTORY.md)
LARGER_TREE_MARGIN = 1.10
# the prompt-lookup branch stays unless it measured slower than the tree alone by more than this factor: it costs
# little where calibration prompts give it nothing to copy and gains much where requests copy from their context
# (docs/results/api_defaults_vs_bench_auto_mtbench80_spr_amx.json)
LOOKUP_BRANCH_MARGIN = 0.97


@dataclass
class NodeRecord:
    """One drafted node of a calibration tree, as the budget replay needs it."""

    parent: int  # index into the step's records, -1 for depth-1 nodes
    depth: int
    sibling_rank: int  # 0 = its parent's best child
    depth_rank: int  # rank by score among the nodes of its depth
    score_rank: int  # rank by score among all nodes of the tree
    accepted: bool


def _ranks(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Rank of each entry by descending value (0 = best) among the entries of its group; ties broken by index."""
    ranks = torch.empty(len(values), dtype=torch.long)
    for g in groups.unique():
        idx = (groups == g).nonzero().flatten()
        ranks[idx[torch.sort(values[idx], descending=True, stable=True).indices]] = torch.arange(len(idx))
    return ranks


class RecordingDrafter(HeadDrafter):
    """A HeadDrafter that also records its one row's verified trees and accepted paths (NodeRecords per step)."""

    def __init__(self, head: DraftHead, options: TreeOptions, weights: str = "auto"):
        super().__init__(head, options, weights=weights)
        self.records: list[list[NodeRecord]] = []
        self.tree: DraftTree | None = None

    def propose(self, roots, params=None, generator=None) -> DraftTree:
        self.tree = super().propose(roots, params, generator)
        return self.tree

    def accept(self, accepted: Accepted, features) -> None:
        """Records row 0's drafted nodes (root excluded), then feeds the head as HeadDrafter does."""
        scores = self.tree.scores[0, 1:].float().cpu()
        parents = self.tree.parents[0, 1:].cpu() - 1  # index among drafted nodes; -1 = child of the root
        depths = self.tree.depths[0, 1:].cpu()
        taken = {i - 1 for i in accepted.host_paths[0][1:]}  # host_paths: tree indices, root first
        sibling, depth_rank, score_rank = (_ranks(scores, g) for g in (parents, depths, torch.zeros_like(depths)))
        self.records.append([NodeRecord(int(parents[i]), int(depths[i]), int(sibling[i]), int(depth_rank[i]),
                                        int(score_rank[i]), i in taken) for i in range(len(scores))])
        super().accept(accepted, features)


def _target_step(runner, tree: DraftTree) -> Callable[[], None]:
    """A target step verifying `tree` that keeps nothing (the runner's sequence stays as it was)."""
    nothing = Accepted.from_host([[]], [[]], 1, tree.tokens.device)

    def step():
        runner.verify(tree.tokens, tree.depths, tree.ancestors)
        runner.commit(nothing)
    return step


def median_ms(fn: Callable[[], object], reps: int, device: torch.device,
               between: Callable[[], object] | None = None) -> float:
    """Median wall ms of `reps` device-synchronised calls of fn(), each after an untimed `between()`."""
    sync = synchronizer(device)
    times = []
    for _ in range(reps):
        if between is not None:
            between()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


@torch.inference_mode()
def measure_verify_ms(runner, prefix: torch.Tensor, sizes, reps: int = 15) -> dict[int, float]:
    """{n: median ms of one target forward over a chain of n drafted tokens + the root after `prefix` (1, T)}
    (n = 0: a plain step); the sizes take turns, one timed forward each per round, so drift hits them alike."""
    steps = {}
    for n in (0, *sizes):
        tokens = prefix[:, -(n + 1):] if prefix.shape[1] > n else prefix[:, :1].repeat(1, n + 1)
        steps[n] = _target_step(runner, DraftTree.chain(tokens[:, 0], tokens[:, 1:]))
    runner.reset(1, prefix.shape[1] + max(steps) + 1)
    with runner.session():
        runner.prefill(prefix)
        for step in reversed(steps.values()):  # the largest first: one shared graph serves the smaller (static.py)
            step()  # warm-up (and the one-time compile of this shape)
        rounds = [[median_ms(step, 1, prefix.device) for step in steps.values()] for _ in range(reps)]
    return {n: statistics.median(t) for n, t in zip(steps, zip(*rounds))}


@torch.inference_mode()
def measure_draft_ms(runner, head: DraftHead, prefix: torch.Tensor, trees: list[TreeOptions],
                     reps: int = 5, weights: str = "auto") -> dict[TreeOptions, float]:
    """Median ms of one drafting step for each tree shape: feeding the last verification's two true pairs and
    drafting the next tree. Each timed draft follows a target step, as in decoding, whose weights stream through
    the CPU caches between two drafts (timed back to back, a draft measured half its cost inside decoding)."""
    device, t = prefix.device, prefix.shape[1]
    runner.reset(1, t + 2)
    with runner.session():  # the target's attention kernel, also for the target steps between the drafts
        _, features = runner.prefill(prefix)
        target_step = _target_step(runner, DraftTree.chain(prefix[:, -1]))
        roots = prefix[:, -1]
        pairs = dict(features=features[:, t - 2:], tokens=prefix[:, t - 2:],
                     valid=torch.ones(1, 2, dtype=torch.bool, device=device),
                     positions=torch.arange(t - 2, t, device=device)[None],
                     is_root=torch.tensor([[False, True]], device=device))
        out = {}
        for options in trees:
            drafter = HeadDrafter(head, options, weights=weights)
            drafter.begin(runner, prefix, torch.ones_like(prefix), features)
            drafter.propose(roots)  # the prompt's pairs

            def step():  # the last two pairs again, then the tree
                drafter.next_pos.fill_(t - 2)
                drafter.pending = dict(pairs)
                drafter.propose(roots)

            step()  # warm-up
            out[options] = median_ms(step, reps, device, between=target_step)
        return out


def decode_trial(generator: Callable[..., Any], model: nn.Module, runner, variants: dict,
                 inputs: list[torch.Tensor], max_new_tokens: int, rounds: int) -> dict:
    """{key: {"tokens_per_s", "tau", "step_ms"}} of real greedy generations of `inputs` on `runner` by one generator
    per variant ({key: (draft, generator keywords)}), taking turns prompt by prompt for `rounds` rounds after an
    untimed warm-up (every verify bucket its drafter may fill, lest one only some prompt reaches compile while timed;
    a short generation). tokens_per_s and tau: all generations together, prefill excluded; step_ms: the median
    generation's ms per step."""
    gens = {key: generator(model, draft, runner=runner, compile=getattr(runner, "compiled", False), **kw)
            for key, (draft, kw) in variants.items()}
    for gen in gens.values():
        gen.warmup(max(ids.shape[1] for ids in inputs) + max_new_tokens)
        gen.generate(inputs[0], max_new_tokens=min(max_new_tokens, 16))  # its drafting step compiles in a few
    stats = {key: [] for key in gens}
    for _ in range(rounds):
        for ids in inputs:
            for key, gen in gens.items():
                stats[key].append(gen.generate(ids, max_new_tokens=max_new_tokens).stats)
    decode_s = lambda s: s.total_time_s - s.prefill_time_s  # noqa: E731
    return {key: {"tokens_per_s": sum(s.new_tokens for s in runs) / sum(map(decode_s, runs)),
                  "tau": sum(s.new_tokens for s in runs) / max(sum(len(s.accept_lengths) for s in runs), 1),
                  "step_ms": statistics.median(1000 * decode_s(s) / max(len(s.accept_lengths), 1) for s in runs)}
            for key, runs in stats.items()}


def choose_draft_vocab(model: nn.Module, heads: dict[int, DraftHead], runner, tree: TreeOptions,
                       inputs: list[torch.Tensor], max_new_tokens: int, rounds: int = FULL.rounds,
                       verbose: bool = True, *, generator: Callable[..., Any]) -> tuple[DraftHead, dict]:
    """The fastest draft vocabulary: `heads` maps a size to the head pruned to it (DraftHead.pruned; the unpruned
    head under its own size), and each decodes `inputs` with `tree` on `runner`, taking turns; a smaller one
    drafts faster but never drafts the tokens left out. Returns (the fastest, {"chosen": its size, "trial":
    {str(size): decode_trial's rates}})."""
    variants = {size: (head, {"tree": tree}) for size, head in sorted(heads.items())}
    rates = decode_trial(generator, model, runner, variants, inputs, max_new_tokens, rounds)
    chosen = max(rates, key=lambda size: rates[size]["tokens_per_s"])
    if verbose:
        trial = ", ".join(f"{size}: {r['tokens_per_s']:.1f} tok/s tau {r['tau']:.2f}" for size, r in rates.items())
        print(f"draft vocabulary auto: {chosen} ({trial})", flush=True)
    return heads[chosen], {"chosen": chosen, "trial": {str(k): v for k, v in rates.items()}}


def expected_tau(records_by_step: list[list[NodeRecord]], depth: int, top_k: int, total: int) -> float:
    """Mean tokens per step (bonus included) had the recorded trees been drafted under this budget."""
    taus = []
    for nodes in records_by_step:
        allowed = []
        for node in nodes:  # parents come before children; a node's parent must have been on the frontier
            allowed.append(node.depth <= depth and node.sibling_rank < top_k and
                           (node.parent < 0 or allowed[node.parent] and nodes[node.parent].depth_rank < top_k))
        kept_ranks = sorted(node.score_rank for i, node in enumerate(nodes) if allowed[i])
        cutoff = kept_ranks[total - 1] if len(kept_ranks) >= total else float("inf")
        # the accepted nodes form a chain from the root; a budget that drops one drops all below it
        chain = [i for _, i in sorted((node.depth, i) for i, node in enumerate(nodes) if node.accepted)]
        kept = 0
        while kept < len(chain) and allowed[chain[kept]] and nodes[chain[kept]].score_rank <= cutoff:
            kept += 1
        taus.append(1 + kept)
    return statistics.fmean(taus) if taus else 1.0


def prefer_smaller(measured: list[tuple], verify_size: Callable[[int], int]) -> tuple | None:
    """The trial's choice among ROWs (None if none): by verify size from small to large, a larger tree replaces the
    current choice only if it measured LARGER_TREE_MARGIN times its tokens/s."""
    best = None
    for row in sorted(measured, key=lambda r: (verify_size(r[5]), -r[0])):
        if best is None or row[0] > LARGER_TREE_MARGIN * best[0]:
            best = row
    return best


def auto_tree(model: nn.Module, head: DraftHead, calibration_inputs: list[torch.Tensor], max_new_tokens: int = 96,
              verbose: bool = True, lookup_tokens: int = 0, vocab_heads: dict[int, DraftHead] | None = None,
              budget: TuningBudget = FULL, *, runner: Any, generator: Callable[..., Any],
              draft_weights: str = "auto") -> tuple[TreeOptions | None, dict]:
    """Choose the tree budget that maximises tokens/s on this device, dtype and `runner` (the one the generator will
    use). Returns (options, report); options is None when plain decoding on the same runner measured at least as
    fast as every tree in the trial.
    vocab_heads ({draft vocabulary size: head pruned to it}): the chosen tree then decodes with each
    (choose_draft_vocab); report["draft_vocab"]["chosen"] is the fastest, which the lookup trial then uses (the tree
    itself is tuned with `head`).
    lookup_tokens > 0: the chosen tree (or plain decoding) then decodes alone and with the prompt-lookup branch of
    at most that many tokens (on a static runner, the faster of what the tree's next and largest buckets leave);
    report["lookup_branch"] holds those "tokens" and whether the branch stays ("chosen": at least
    LOOKUP_BRANCH_MARGIN as fast beside a tree, faster alone; then generate with hybrid=True).
    `budget`: FULL, or QUICK for a bounded first call. `generator`: SpeculativeGenerator (passed in: the engine
    imports this module for tree="auto"). `draft_weights`: the head's drafting weights (HeadDrafter's `weights`)."""
    # acceptance does not depend on the runner: record it on an uncompiled one of its own
    recorder = RecordingDrafter(head, budget.calibration, draft_weights)
    calibration_runner = "auto" if static_cache_supported(model) else \
        StaticRunner(model, head.config.aux_layer_ids, buckets=(1, budget.calibration.tree_size))
    with generator(model, recorder, compile=False, runner=calibration_runner) as gen:
        outs = [gen.generate(ids, max_new_tokens=max_new_tokens) for ids in calibration_inputs]
    getattr(calibration_runner, "close", lambda: None)()
    overhead = statistics.median(1000 * (out.stats.total_time_s - out.stats.draft_time_s - out.stats.verify_time_s)
                                 / max(len(out.stats.accept_lengths), 1) for out in outs)
    # the generators below: the head's draft with these weights (plain decoding's, draft None, takes no draft weights)
    generator = functools.partial(generator, draft_weights=draft_weights)
    prefix = outs[-1].sequences[:, -256:]
    # the tree sizes (root excluded) worth timing: every size on the eager runner; on the static runner only full
    # buckets, since a tree is padded to its bucket (a smaller tree costs the same)
    buckets = getattr(runner, "buckets", None)
    sizes = TOTALS if buckets is None else tuple(b - 1 for b in buckets if b > 1) or (0,)
    sizes = tuple(n for n in sizes if n <= budget.max_verify) or sizes[:1]
    verify_ms = measure_verify_ms(runner, prefix, sizes, reps=budget.verify_reps)
    shapes = [TreeOptions(depth=d, top_k=k, total_tokens=max(TOTALS)) for k in budget.top_ks for d in budget.depths]
    draft_ms = {(o.depth, o.top_k): ms
                for o, ms in measure_draft_ms(runner, head, prefix, shapes, budget.draft_reps, draft_weights).items()}

    def verify_size(total: int) -> int:  # a tree is padded to the next measured size
        return min(n for n in verify_ms if n >= total)

    def predict(depth: int, top_k: int, total: int) -> tuple:  # a ROW: replayed tau over the timed step
        tau = expected_tau(recorder.records, depth, top_k, total)
        step_ms = draft_ms[(depth, top_k)] + verify_ms[verify_size(total)] + overhead
        return 1000 * tau / step_ms, tau, step_ms, depth, top_k, total

    largest = min(max(verify_ms), budget.calibration.total_tokens)
    table = sorted((predict(depth, top_k, total) for depth in budget.depths for top_k in budget.top_ks
                    for total in TOTALS if depth <= total <= largest and (top_k != 1 or total == depth)), reverse=True)
    best_by_size: dict[int, tuple] = {}
    for row in table:
        best_by_size.setdefault(verify_size(row[5]), row)
    taus = {TreeOptions(*row[3:]): row[1] for row in list(best_by_size.values())[:budget.trial_trees]}
    variants = {tree: (head if tree else None, {"tree": tree or "none"}) for tree in [None, *taus]}
    trial_ms = {tree: rate["step_ms"] for tree, rate in decode_trial(
        generator, model, runner, variants, calibration_inputs, max_new_tokens, budget.rounds).items()}
    plain_ms = trial_ms.pop(None)
    measured = [(1000 * tau / trial_ms[o], tau, trial_ms[o], *astuple(o)) for o, tau in taus.items()]
    # no tree at all when the runner verifies none (a single one-token bucket)
    tps, tau, step_ms, depth, top_k, total = prefer_smaller(measured, verify_size) or (0.0, 1.0, plain_ms, 0, 0, 0)
    options = TreeOptions(depth=depth, top_k=top_k, total_tokens=total) if tps > 1000 / plain_ms else None
    choice = f"depth={depth} top_k={top_k} total_tokens={total}" if options else "none (plain decoding)"  # verbose line
    draft_vocab = None
    if options is not None and vocab_heads and len(vocab_heads) > 1:
        head, draft_vocab = choose_draft_vocab(model, vocab_heads, runner, options, calibration_inputs, max_new_tokens,
                                               rounds=budget.rounds, verbose=verbose, generator=generator)
    lookup_branch = None
    if lookup_tokens > 0:
        # the branch's nodes come on top of the tree's: the largest bucket timed bounds the two together, and a
        # branch that fits the tree's next bucket may beat a longer one verified in a costlier bucket
        tree_size = options.tree_size if options is not None else 1
        timed = max(verify_ms) + 1  # the largest bucket timed, root included
        above = [b - tree_size for b in buckets or () if tree_size < b <= timed]
        counts = tuple(sorted({min(lookup_tokens, n) for n in above[:1] + above[-1:]})) if buckets else (lookup_tokens,)
        if not counts:
            lookup_branch = {"tokens": 0, "chosen": False, "tokens_per_s": None,
                             "skipped": f"the tree fills the largest verify bucket timed ({timed})" if options
                             else "the runner verifies one token a step"}
            choice += f", without the prompt-lookup branch ({lookup_branch['skipped']})"
        else:
            # measured, not replayed: the branch's copies of the context are unknown to the recorded trees
            variants = {n: (head, {"tree": options or "none", "hybrid": n > 0, "lookup_tokens": max(n, 1)})
                        for n in (0, *counts)}  # 0: the tree (or plain decoding) alone
            rates = {n: rate["tokens_per_s"] for n, rate in decode_trial(
                generator, model, runner, variants, calibration_inputs, max_new_tokens, budget.rounds).items()}
            best = max(counts, key=rates.__getitem__)
            chosen = rates[best] >= LOOKUP_BRANCH_MARGIN * rates[0] if options is not None else rates[best] > rates[0]
            lookup_branch = {"tokens": best, "chosen": chosen,
                             "tokens_per_s": {"tree_alone": rates[0], "with_lookup": rates[best]},
                             "trial": {str(n): rates[n] for n in counts}}
            choice += (f", {'with' if chosen else 'without'} the prompt-lookup branch ({rates[best]:.1f} vs "
                       f"{rates[0]:.1f} tok/s {'alone' if options else 'plain'})")
    gpu = TREE_PRESETS["gpu"]  # its prediction is reported where the runner verifies a tree that large
    gpu_fits = gpu.total_tokens <= max(verify_ms) and (gpu.depth, gpu.top_k) in draft_ms
    report = {"runner": type(runner).__name__,
              "chosen": {"depth": depth, "top_k": top_k, "total_tokens": total} if options else "none",
              "predicted": {"tau": tau, "step_ms": step_ms, "tokens_per_s": tps},  # step_ms measured in the trial
              "predicted_plain": {"step_ms": plain_ms, "tokens_per_s": 1000 / plain_ms},
              "trial": [dict(zip(ROW, row)) for row in sorted(measured, reverse=True)],
              "predicted_gpu_tree": dict(zip(ROW[:3], predict(*astuple(gpu)))) if gpu_fits else None,
              "draft_vocab": draft_vocab,  # None: not tried (no tree chosen, or no vocab_heads)
              "lookup_branch": lookup_branch,  # None: not tried (lookup_tokens 0)
              "verify_ms": {str(k): v for k, v in verify_ms.items()},
              "draft_ms": {f"{d},{k}": v for (d, k), v in draft_ms.items()}, "overhead_ms": overhead,
              "calibration_steps": len(recorder.records), "top_candidates": [dict(zip(ROW, row)) for row in table[:5]]}
    if verbose:
        print(f"tree auto: {choice} (best tree: replayed tau {tau:.2f}, measured {step_ms:.1f} ms/step, "
              f"{tps:.1f} tok/s; plain step {plain_ms:.1f} ms = {1000 / plain_ms:.1f} tok/s)", flush=True)
    return options, report
