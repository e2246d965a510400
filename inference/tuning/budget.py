"""Hardware-aware tree budget (`--tree auto`): pick depth / top_k / total_tokens for this device and dtype.

1. Cost: time the target verifying n tree tokens after a realistic prefix (n = 1..64) and the head drafting a tree
   of each (depth, top_k), on the current device and dtype; per-step overhead comes from a calibration run.
2. Acceptance: generate a few calibration prompts with a large tree, recording for every drafted node its depth,
   its rank among its siblings, its rank within its depth and its score rank, and whether it was accepted.
3. For each candidate (depth, top_k, total_tokens), replay the recorded trees under that budget (the nodes a smaller
   tree would have kept; a path is accepted up to its first node the budget drops), giving the expected tokens per
   step tau, and predict tokens/s as tau / (draft + verify + overhead).
4. Trial: the best predicted tree of each of the few best verify sizes, and plain decoding, decode the calibration
   prompts on the runner itself, taking turns; the measured ms per step (prefill excluded) times the replayed tau
   decides, and plain decoding wins unless a tree is measured faster. Predictions alone were not enough: a
   verification costs more inside decoding than timed alone (docs/results/HISTORY.md).
5. Draft vocabulary (optional, `--draft-vocab auto`): the chosen tree decodes the calibration prompts with the
   head pruned to a few vocabulary sizes (and unpruned), taking turns; the fastest measured keeps its place.
6. Lookup branch (optional): the chosen tree decodes the calibration prompts again, alone and with the
   prompt-lookup branch merged in (drafters/lookup.py), taking turns; the branch stays if it measured at least as
   fast: it costs nothing where nothing in the context matches, and the target copies a lot. Where no tree won,
   plain decoding and prompt lookup alone take turns the same way, and lookup stays only if measured faster.
GPU-tuned trees (60 tokens) are wrong on a CPU, where verifying 16 tokens already costs ~1.7x a single step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from drafthead import DraftHead
from drafthead.hardware import synchronizer

from ..drafter import Accepted
from ..drafters.eagle import HeadDrafter
from ..runners import StaticRunner, make_runner
from ..runners.kv import static_cache_supported
from ..tree import TREE_PRESETS, DraftTree, TreeOptions

CALIBRATION_TREE = TreeOptions(depth=8, top_k=10, total_tokens=80)
DEPTHS = range(1, 9)
TOP_KS = (1, 2, 3, 4, 6, 8, 10)
TOTALS = tuple(range(1, 17)) + (20, 24, 28, 32, 40, 48, 56, 60, 64, 80)
TRIAL_TREES = 4  # the best predicted tree of this many verify sizes decodes for real before the choice
TRIAL_ROUNDS = 2  # each trial generator decodes every calibration prompt this many times (taking turns)


@dataclass(frozen=True)
class TuningBudget:
    """How much the tuner measures: the calibration tree (candidates are the trees inside it), the drafting shapes
    timed, the repetitions of each timing, and the trial's size. FULL is the benchmark's; QUICK bounds a first
    call of the library (fewer shapes and repetitions, verify sizes up to `max_verify`, a shorter trial)."""

    calibration: TreeOptions = CALIBRATION_TREE
    depths: tuple[int, ...] = tuple(DEPTHS)
    top_ks: tuple[int, ...] = TOP_KS
    max_verify: int = max(TOTALS)  # drafted tokens (root excluded)
    verify_reps: int = 15
    draft_reps: int = 5
    trial_trees: int = TRIAL_TREES
    rounds: int = TRIAL_ROUNDS


FULL = TuningBudget()
# on a CPU a tree past 32 tokens never won (verifying 33 tokens costs several plain steps there), so the quick
# budget's calibration tree stops at 32
QUICK = TuningBudget(calibration=TreeOptions(depth=6, top_k=8, total_tokens=32), depths=(2, 3, 4, 5, 6),
                     top_ks=(1, 2, 4, 8), max_verify=32, verify_reps=5, draft_reps=3, trial_trees=2, rounds=1)
# a tree with a larger verify bucket must beat the best smaller one by this factor in the trial: three short
# calibration prompts rated larger trees a few per cent ahead that then decoded slower (docs/results/HISTORY.md)
LARGER_TREE_MARGIN = 1.10
# the prompt-lookup branch is kept unless it measured slower than the tree alone by more than this factor: it adds
# nodes only where the context holds a match, so it costs little where calibration prompts give it nothing to
# copy and gains much where requests copy from their context
# (docs/results/api_defaults_vs_bench_auto_mtbench80_spr_amx.json)
LOOKUP_BRANCH_MARGIN = 0.97


@dataclass
class NodeRecord:
    """One drafted node of a calibration tree, as the budget replay needs it."""

    step: int
    parent: int  # index into the step's records, -1 for depth-1 nodes
    depth: int
    sibling_rank: int  # 0 = its parent's best child
    depth_rank: int  # rank by score among the nodes of its depth
    score_rank: int  # rank by score among all nodes of the tree
    accepted: bool


class RecordingDrafter(HeadDrafter):
    """A HeadDrafter that also records every verified tree of its one row and its accepted path (NodeRecords per
    step)."""

    def __init__(self, head: DraftHead, options: TreeOptions):
        super().__init__(head, options)
        self.records: list[list[NodeRecord]] = []
        self.tree: DraftTree | None = None

    def propose(self, roots, params=None, generator=None) -> DraftTree:
        self.tree = super().propose(roots, params, generator)
        return self.tree

    def accept(self, accepted: Accepted, features) -> None:
        self.records.append(record_tree(len(self.records), self.tree, accepted.host_paths[0]))
        super().accept(accepted, features)


def nothing_accepted(device: torch.device) -> Accepted:
    """A verification that keeps nothing (a timed step that leaves the runner's sequence as it was)."""
    return Accepted.from_host([[]], [[]], 1, device)


def _median_ms(fn: Callable[[], object], reps: int, device: torch.device,
               between: Callable[[], object] | None = None) -> float:
    """Median wall ms of fn(), waiting for the device's queued work before each reading; `between()` runs untimed
    before each one."""
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


def verify_sizes(runner) -> tuple[int, ...]:
    """Tree sizes (drafted tokens, root excluded) worth measuring: every size on the eager runner; on the static
    runner only full buckets, since a tree is padded to its bucket (a smaller tree costs the same)."""
    buckets = getattr(runner, "buckets", None)
    if buckets is None:
        return TOTALS
    return tuple(b - 1 for b in buckets if b > 1) or (0,)


@torch.inference_mode()
def measure_verify_ms(runner, prefix: torch.Tensor, sizes, reps: int = 15) -> dict[int, float]:
    """{n: median ms of one target forward over a chain-shaped tree of n drafted tokens + the root after `prefix`
    (1, T)}; n = 0 is a plain decoding step. The sizes take turns, one timed forward each per round, so the
    machine's drift hits them alike (timed size by size, the order of two close sizes flipped between runs)."""
    device = prefix.device
    nothing = nothing_accepted(device)
    steps = {}
    for n in (0,) + tuple(sizes):
        tokens = prefix[:, -(n + 1):] if prefix.shape[1] > n else prefix[:, :1].repeat(1, n + 1)
        chain = DraftTree.chain(tokens[:, 0], tokens[:, 1:])

        def step(chain=chain):
            runner.verify(chain.tokens, chain.depths, chain.ancestors)
            runner.commit(nothing)

        steps[n] = step
    times = {n: [] for n in steps}
    runner.reset(1, prefix.shape[1] + max((0,) + tuple(sizes)) + 1)
    with runner.session():
        runner.prefill(prefix)
        for step in steps.values():
            step()  # warm-up (and the one-time compile of this shape)
        for _ in range(reps):
            for n, step in steps.items():
                times[n].append(_median_ms(step, 1, device))
    return {n: statistics.median(t) for n, t in times.items()}


@torch.inference_mode()
def measure_draft_ms(runner, head: DraftHead, prefix: torch.Tensor, trees: list[TreeOptions],
                     reps: int = 5) -> dict[TreeOptions, float]:
    """Median ms of one drafting step for each tree shape: feeding the true pairs of the last verification (two of
    them) and drafting the next tree, as decoding runs it. Each timed draft follows a target step, as in decoding,
    where the target's forward streams its weights through the CPU caches between two drafts (timed back to back a
    draft measured half its cost inside decoding)."""
    device = prefix.device
    t = prefix.shape[1]
    nothing = nothing_accepted(device)
    runner.reset(1, t + 2)
    with runner.session():  # the target's attention kernel, also for the target steps between the drafts
        _, features = runner.prefill(prefix)
        one_token = DraftTree.chain(prefix[:, -1])

        def target_step():
            runner.verify(one_token.tokens, one_token.depths, one_token.ancestors)
            runner.commit(nothing)

        roots = prefix[:, -1]
        pairs = dict(features=features[:, t - 2:], tokens=prefix[:, t - 2:], valid=torch.ones(1, 2, dtype=torch.bool,
                                                                                                device=device),
                     positions=torch.arange(t - 2, t, device=device)[None],
                     is_root=torch.tensor([[False, True]], device=device))
        out = {}
        for options in trees:
            drafter = HeadDrafter(head, options)
            drafter.begin(runner, prefix, torch.ones_like(prefix), features)
            drafter.propose(roots)  # the prompt's pairs

            def step():  # the last two pairs again, then the tree
                drafter.next_pos.fill_(t - 2)
                drafter.pending = dict(pairs)
                drafter.propose(roots)

            step()  # warm-up
            out[options] = _median_ms(step, reps, device, between=target_step)
        return out


def _decode_in_turns(gens: dict, inputs: list[torch.Tensor], max_new_tokens: int, rounds: int) -> dict:
    """{key: [GenerationStats]} of real greedy generations of `inputs` by each generator: each first warms up
    untimed (every verify bucket its drafter may fill compiled, then one generation), then the generators take turns
    prompt by prompt for `rounds` rounds. A bucket that only some prompt reaches (a lookup branch that finds a long
    match) would otherwise compile inside the timed decoding."""
    longest = max(ids.shape[1] for ids in inputs) + max_new_tokens
    for gen in gens.values():
        gen.warmup(longest)
        gen.generate(inputs[0], max_new_tokens=max_new_tokens)
    stats = {key: [] for key in gens}
    for _ in range(rounds):
        for ids in inputs:
            for key, gen in gens.items():
                stats[key].append(gen.generate(ids, max_new_tokens=max_new_tokens).stats)
    return stats


def measure_decoding_ms(model: nn.Module, head: DraftHead, runner, trees: list[TreeOptions | None],
                        inputs: list[torch.Tensor], max_new_tokens: int, rounds: int = TRIAL_ROUNDS, *,
                        generator: Callable[..., Any]) -> dict:
    """{tree: median ms per decoding step (prefill excluded)} of real greedy generations of `inputs` on `runner`
    (None: plain decoding): drafting, verification, compaction and bookkeeping, all as decoding runs them, the generators taking turns (_decode_in_turns)."""
    compiled = getattr(runner, "compiled", False)
    gens = {tree: generator(model, head if tree else None, tree=tree or "none", runner=runner, compile=compiled)
            for tree in trees}
    stats = _decode_in_turns(gens, inputs, max_new_tokens, rounds)
    return {tree: statistics.median(1000 * (s.total_time_s - s.prefill_time_s) / max(len(s.accept_lengths), 1)
                                    for s in runs) for tree, runs in stats.items()}


def _rates(gens: dict, inputs: list[torch.Tensor], max_new_tokens: int, rounds: int) -> dict:
    """{key: {"tokens_per_s", "tau"}} of real greedy generations by each generator, taking turns
    (_decode_in_turns): new tokens over decode time (prefill excluded) and tokens per step, all prompts and rounds
    together."""
    stats = _decode_in_turns(gens, inputs, max_new_tokens, rounds)
    return {key: {"tokens_per_s": sum(s.new_tokens for s in runs) /
                  sum(s.total_time_s - s.prefill_time_s for s in runs),
                  "tau": sum(s.new_tokens for s in runs) / max(sum(len(s.accept_lengths) for s in runs), 1)}
            for key, runs in stats.items()}


def measure_lookup_branch(model: nn.Module, head: DraftHead, runner, tree: TreeOptions | None,
                          lookup_tokens: tuple[int, ...], inputs: list[torch.Tensor], max_new_tokens: int,
                          rounds: int = TRIAL_ROUNDS, *, generator: Callable[..., Any]) -> dict[int, float]:
    """Decoding tokens/s (new tokens over decode time, prefill excluded, all prompts and rounds together) of the
    head's `tree` alone (key 0) and with the prompt-lookup branch of up to n tokens (key n, for each n of
    `lookup_tokens`), all taking turns on `runner`; tree None: plain decoding and prompt lookup alone. The
    branch's gain is real tokens, not a replay: it accepts copies of the context, which the head's recorded trees
    know nothing of."""
    compiled = getattr(runner, "compiled", False)
    gens = {n: generator(model, head, tree=tree or "none", runner=runner, compile=compiled, hybrid=n > 0,
                         lookup_tokens=max(n, 1)) for n in (0, *lookup_tokens)}
    return {n: rate["tokens_per_s"] for n, rate in _rates(gens, inputs, max_new_tokens, rounds).items()}


def choose_draft_vocab(model: nn.Module, heads: dict[int, DraftHead], runner, tree: TreeOptions,
                       inputs: list[torch.Tensor], max_new_tokens: int, rounds: int = TRIAL_ROUNDS,
                       verbose: bool = True, *, generator: Callable[..., Any]) -> tuple[int, dict]:
    """Weigh a head's draft-vocabulary coverage against its drafting cost: `heads` maps a draft vocabulary size to
    the head pruned to it (DraftHead.pruned; the unpruned head under its own size), and each decodes the
    calibration prompts with `tree` on `runner`, taking turns. A smaller vocabulary drafts faster (the lm_head over
    the draft vocabulary is a large share of a CPU drafting step) and accepts less (the tokens left out are never
    drafted); the measured tokens/s decides. Returns (chosen size, {size: {"tokens_per_s", "tau"}})."""
    compiled = getattr(runner, "compiled", False)
    gens = {size: generator(model, head, tree=tree, runner=runner, compile=compiled)
            for size, head in sorted(heads.items())}
    rates = _rates(gens, inputs, max_new_tokens, rounds)
    chosen = max(rates, key=lambda size: rates[size]["tokens_per_s"])
    if verbose:
        trial = ", ".join(f"{size}: {r['tokens_per_s']:.1f} tok/s tau {r['tau']:.2f}" for size, r in rates.items())
        print(f"draft vocabulary auto: {chosen} ({trial})", flush=True)
    return chosen, rates


def _ranks(values: torch.Tensor) -> torch.Tensor:
    """Rank of each entry by descending value (0 = best); ties broken by index."""
    order = torch.sort(values, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(len(order), device=order.device)
    return ranks


def record_tree(step: int, tree: DraftTree, path: list[int]) -> list[NodeRecord]:
    """Records of row 0's verified tree's drafted nodes (root excluded). path: accepted tree indices, root
    first."""
    scores = tree.scores[0, 1:].float().cpu()
    parents = tree.parents[0, 1:].cpu() - 1  # index among drafted nodes; -1 = child of the root
    depths = tree.depths[0, 1:].cpu()
    accepted = torch.zeros(len(scores), dtype=torch.bool)
    accepted[torch.tensor(path[1:], dtype=torch.long) - 1] = True
    score_rank = _ranks(scores)
    depth_rank = torch.empty_like(score_rank)
    sibling_rank = torch.empty_like(score_rank)
    for d in depths.unique():
        idx = (depths == d).nonzero().flatten()
        depth_rank[idx] = _ranks(scores[idx])
    for p in parents.unique():
        idx = (parents == p).nonzero().flatten()
        sibling_rank[idx] = _ranks(scores[idx])
    return [NodeRecord(step, int(parents[i]), int(depths[i]), int(sibling_rank[i]), int(depth_rank[i]),
                       int(score_rank[i]), bool(accepted[i])) for i in range(len(scores))]


def expected_tau(records_by_step: list[list[NodeRecord]], depth: int, top_k: int, total: int) -> float:
    """Mean tokens per step (bonus included) had the recorded trees been drafted under this budget."""
    taus = []
    for nodes in records_by_step:
        allowed = [False] * len(nodes)
        for i, node in enumerate(nodes):  # parents come before children
            ok = node.depth <= depth and node.sibling_rank < top_k
            if node.parent >= 0:
                parent = nodes[node.parent]
                ok = ok and allowed[node.parent] and parent.depth_rank < top_k  # parent was on the frontier
            allowed[i] = ok
        kept_ranks = sorted(node.score_rank for i, node in enumerate(nodes) if allowed[i])
        cutoff = kept_ranks[total - 1] if len(kept_ranks) >= total else float("inf")
        # the accepted nodes form a chain from the root; a budget that drops one drops all below it
        chain = sorted((node.depth, i) for i, node in enumerate(nodes) if node.accepted)
        kept = 0
        for _, i in chain:
            if allowed[i] and nodes[i].score_rank <= cutoff:
                kept += 1
            else:
                break
        taus.append(1 + kept)
    return statistics.fmean(taus) if taus else 1.0


def prefer_smaller(measured: list[tuple], verify_size: Callable[[int], int],
                   margin: float = LARGER_TREE_MARGIN) -> tuple:
    """The trial's choice among rows (tokens/s, tau, step ms, depth, top_k, total): by verify size from small to
    large, a larger tree replaces the current choice only if it measured `margin` times its tokens/s."""
    best = None
    for row in sorted(measured, key=lambda r: (verify_size(r[5]), -r[0])):
        if best is None or row[0] > margin * best[0]:
            best = row
    return best


def auto_tree(
    model: nn.Module,
    head: DraftHead,
    calibration_inputs: list[torch.Tensor],
    max_new_tokens: int = 96,
    verbose: bool = True,
    runner=None,
    lookup_tokens: int = 0,
    vocab_heads: dict[int, DraftHead] | None = None,
    budget: TuningBudget = FULL,
    *,
    generator: Callable[..., Any],
) -> tuple[TreeOptions | None, dict]:
    """Choose the tree budget that maximises expected tokens/s on this device, dtype and runner (the one the
    generator will use: pass it; default a new static-or-eager runner). Returns (options, report); options is None
    when plain decoding on the same runner was measured at least as fast as every tree in the trial.
    lookup_tokens > 0: the chosen tree (or, where none won, plain decoding) then decodes once more with the
    prompt-lookup branch of up to that many tokens (drafters/lookup.py) against itself alone, and
    report["lookup_branch"]["chosen"] says whether the branch was measured at least LOOKUP_BRANCH_MARGIN as fast
    beside a tree, faster beside plain decoding (then generate with hybrid=True and
    report["lookup_branch"]["tokens"]: on a static runner the faster of the branch that fills the tree's next
    bucket and the one of what the largest bucket leaves beside the tree, each at most lookup_tokens).
    vocab_heads ({draft vocabulary size: head pruned to it}): the chosen tree then decodes with each
    (choose_draft_vocab), before the lookup branch is tried with the fastest; report["draft_vocab"]["chosen"] names
    it. The tree itself is tuned with `head`. `budget`: how much to measure (FULL, or QUICK for a bounded first
    call). `generator`: SpeculativeGenerator (passed in: the engine imports this module for tree="auto")."""
    if runner is None:
        runner = make_runner(model, head.config.aux_layer_ids)
    # acceptance does not depend on the runner: record it on an uncompiled one of its own (a bucket for the
    # calibration tree)
    recorder = RecordingDrafter(head, budget.calibration)
    calibration_runner = "auto" if static_cache_supported(model) else \
        StaticRunner(model, head.config.aux_layer_ids, buckets=(1, budget.calibration.tree_size))
    gen = generator(model, recorder, compile=False, runner=calibration_runner)
    records = recorder.records
    overhead_ms = []
    last = None
    for ids in calibration_inputs:
        out = gen.generate(ids, max_new_tokens=max_new_tokens)
        s = out.stats
        steps = max(len(s.accept_lengths), 1)
        overhead_ms.append(1000 * (s.total_time_s - s.draft_time_s - s.verify_time_s) / steps)
        last = out.sequences
    gen.close()
    getattr(calibration_runner, "close", lambda: None)()
    prefix = last[:, -256:] if last.shape[1] > 256 else last
    sizes = tuple(n for n in verify_sizes(runner) if n <= budget.max_verify) or verify_sizes(runner)[:1]
    verify_ms = measure_verify_ms(runner, prefix, sizes, reps=budget.verify_reps)
    shapes = [TreeOptions(depth=d, top_k=k, total_tokens=max(TOTALS)) for k in budget.top_ks for d in budget.depths]
    draft_ms = {(o.depth, o.top_k): ms
                for o, ms in measure_draft_ms(runner, head, prefix, shapes, reps=budget.draft_reps).items()}
    overhead = statistics.median(overhead_ms)

    def verify_size(total: int) -> int:  # a tree is padded to the next measured size
        return min(n for n in verify_ms if n >= total)

    def verify_cost(total: int) -> float:
        return verify_ms[verify_size(total)]

    table = []
    for depth in budget.depths:
        for top_k in budget.top_ks:
            for total in TOTALS:
                if total < depth or total > min(max(verify_ms), budget.calibration.total_tokens) or \
                        (top_k == 1 and total != depth):
                    continue
                tau = expected_tau(records, depth, top_k, total)
                step_ms = draft_ms[(depth, top_k)] + verify_cost(total) + overhead
                tps = 1000 * tau / step_ms
                table.append((tps, tau, step_ms, depth, top_k, total))
    # 4. the trial: the best predicted tree of each of the budget's trial_trees best verify sizes, and plain decoding
    finalists: dict[int, tuple] = {}
    for row in sorted(table, reverse=True):
        finalists.setdefault(verify_size(row[5]), row)
    finalists = dict(list(finalists.items())[:budget.trial_trees])
    trees = [TreeOptions(depth=d, top_k=k, total_tokens=n) for *_, d, k, n in finalists.values()]
    trial_ms = measure_decoding_ms(model, head, runner, [None, *trees], calibration_inputs, max_new_tokens,
                                   rounds=budget.rounds, generator=generator)
    plain_ms = trial_ms.pop(None)
    measured = [(1000 * tau / trial_ms[o], tau, trial_ms[o], o.depth, o.top_k, o.total_tokens)
                for (_, tau, *_), o in zip(finalists.values(), trees)]
    # no tree at all when the runner verifies none (a single one-token bucket)
    tps, tau, step_ms, depth, top_k, total = prefer_smaller(measured, verify_size) if measured else \
        (0.0, 1.0, plain_ms, 0, 0, 0)
    options = TreeOptions(depth=depth, top_k=top_k, total_tokens=total) if tps > 1000 / plain_ms else None
    draft_vocab = None
    if options is not None and vocab_heads and len(vocab_heads) > 1:
        size, rates = choose_draft_vocab(model, vocab_heads, runner, options, calibration_inputs, max_new_tokens,
                                         rounds=budget.rounds, verbose=verbose, generator=generator)
        head = vocab_heads[size]
        draft_vocab = {"chosen": size, "trial": {str(k): v for k, v in rates.items()}}
    lookup_branch = None
    if lookup_tokens > 0:
        # the branch's nodes come on top of the tree's: a static runner's largest bucket bounds the two together,
        # and a branch that fits the tree's next bucket may beat a longer one verified in a costlier bucket
        buckets = getattr(runner, "buckets", None)
        counts = (lookup_tokens,)
        tree_size = options.tree_size if options is not None else 1
        if buckets:
            above = [b - tree_size for b in buckets if b > tree_size]
            counts = tuple(sorted({min(lookup_tokens, n) for n in above[:1] + above[-1:]}))
        if not counts:
            lookup_branch = {"tokens": 0, "chosen": False, "tokens_per_s": None,
                             "skipped": f"the tree fills the runner's largest verify bucket ({buckets[-1]})" if options
                             else "the runner verifies one token a step"}
        else:
            rates = measure_lookup_branch(model, head, runner, options, counts, calibration_inputs, max_new_tokens,
                                          rounds=budget.rounds, generator=generator)
            best = max(counts, key=rates.__getitem__)
            # beside a tree it stays unless measurably slower; alone, it must beat plain decoding
            chosen = rates[best] >= LOOKUP_BRANCH_MARGIN * rates[0] if options is not None else rates[best] > rates[0]
            lookup_branch = {"tokens": best, "chosen": chosen,
                             "tokens_per_s": {"tree_alone": rates[0], "with_lookup": rates[best]},
                             "trial": {str(n): rates[n] for n in counts}}
    gpu = TREE_PRESETS["gpu"]
    gpu_tree = None  # the GPU preset's prediction, where the runner verifies a tree that large
    if gpu.total_tokens <= max(verify_ms) and (gpu.depth, gpu.top_k) in draft_ms:
        gpu_tau = expected_tau(records, gpu.depth, gpu.top_k, gpu.total_tokens)
        gpu_ms = draft_ms[(gpu.depth, gpu.top_k)] + verify_cost(gpu.total_tokens) + overhead
        gpu_tree = {"tau": gpu_tau, "step_ms": gpu_ms, "tokens_per_s": 1000 * gpu_tau / gpu_ms}
    report = {
        "runner": type(runner).__name__,
        "chosen": {"depth": depth, "top_k": top_k, "total_tokens": total} if options else "none",
        "predicted": {"tau": tau, "step_ms": step_ms, "tokens_per_s": tps},  # step_ms measured in the trial
        "predicted_plain": {"step_ms": plain_ms, "tokens_per_s": 1000 / plain_ms},
        "trial": [dict(zip(("tokens_per_s", "tau", "step_ms", "depth", "top_k", "total_tokens"), row))
                  for row in sorted(measured, reverse=True)],
        "predicted_gpu_tree": gpu_tree,
        "draft_vocab": draft_vocab,  # None: not tried (no tree chosen, or no vocab_heads)
        "lookup_branch": lookup_branch,  # None: not tried (no tree chosen, or lookup_tokens 0)
        "verify_ms": {str(k): v for k, v in verify_ms.items()},
        "draft_ms": {f"{d},{k}": v for (d, k), v in draft_ms.items()},
        "overhead_ms": overhead,
        "calibration_steps": len(records),
        "top_candidates": [dict(zip(("tokens_per_s", "tau", "step_ms", "depth", "top_k", "total_tokens"), row))
                           for row in sorted(table, reverse=True)[:5]],
    }
    if verbose:
        choice = f"depth={depth} top_k={top_k} total_tokens={total}" if options else "none (plain decoding)"
        if lookup_branch is not None and lookup_branch["tokens_per_s"] is None:
            choice += f", without the prompt-lookup branch ({lookup_branch['skipped']})"
        elif lookup_branch is not None:
            rates = lookup_branch["tokens_per_s"]
            choice += (f", {'with' if lookup_branch['chosen'] else 'without'} the prompt-lookup branch "
                       f"({rates['with_lookup']:.1f} vs {rates['tree_alone']:.1f} tok/s "
                       f"{'alone' if options else 'plain'})")
        print(f"tree auto: {choice} (best tree: replayed tau {tau:.2f}, measured {step_ms:.1f} ms/step, "
              f"{tps:.1f} tok/s; plain step {plain_ms:.1f} ms = {1000 / plain_ms:.1f} tok/s)", flush=True)
    return options, report
