"""The tree tuner (`--tree auto`): its choice follows its own predictions, and drafts are timed as decoding runs
them (after a target step)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_inference_greedy import near_bigram_target, oracle_head, prompts
from tiny import tiny_model

from inference import SpeculativeGenerator, TreeOptions
from inference.tuning import budget
from inference.runners.static import StaticRunner, bucket_for

torch.set_num_threads(1)


def test_median_ms_runs_between_before_every_timed_call():
    calls = []
    budget.median_ms(lambda: calls.append("timed"), 3, torch.device("cpu"), between=lambda: calls.append("between"))
    assert calls == ["between", "timed"] * 3


def test_draft_timings_follow_a_target_step(monkeypatch):
    """Every timed draft comes after a one-token target step on the runner, which keeps its committed length."""
    target = tiny_model("llama")
    head = oracle_head(target).attach_target(target)
    runner = StaticRunner(target, head.config.aux_layer_ids, buckets=(1, 4))
    seen = []
    verify = runner.verify
    monkeypatch.setattr(runner, "verify", lambda *a, **k: seen.append(a[0].shape[1]) or verify(*a, **k))
    prefix = prompts(1, 320, seed=3)[0].repeat(1, 4)[:, :24]
    trees = [TreeOptions(depth=1, top_k=2, total_tokens=2), TreeOptions(depth=2, top_k=2, total_tokens=3)]
    times = budget.measure_draft_ms(runner, head, prefix, trees, reps=3)
    assert set(times) == set(trees) and all(t > 0 for t in times.values())
    assert seen.count(1) >= 2 * 3  # three timed drafts per (depth, top_k), each after a one-token target step
    assert runner.lengths == [prefix.shape[1]]


def test_verify_sizes_take_turns(monkeypatch):
    """The verify timings interleave the sizes round by round (drift hits them alike); the runner keeps its
    committed length."""
    target = tiny_model("llama")
    runner = StaticRunner(target, [], buckets=(1, 4))
    seen = []
    verify = runner.verify
    monkeypatch.setattr(runner, "verify", lambda *a, **k: seen.append(a[0].shape[1]) or verify(*a, **k))
    prefix = prompts(1, 320, seed=3)[0][:, :12]
    times = budget.measure_verify_ms(runner, prefix, (3,), reps=4)
    assert set(times) == {0, 3} and all(t > 0 for t in times.values())
    assert seen == [4, 1] + [1, 4] * 4  # a warm-up round, the largest first (a shared graph), then four timed
    assert runner.lengths == [prefix.shape[1]]


def test_decoding_trial_measures_real_steps():
    """The trial decodes for real on the runner, the variants taking turns: plain decoding, trees and a tree with the
    prompt-lookup branch each get positive tokens/s and ms per step and tau >= 1 (plain: about 1), and the
    runner's buffers are left as they were sized."""
    target = tiny_model("llama")
    head = oracle_head(target).attach_target(target)
    runner = StaticRunner(target, head.config.aux_layer_ids, buckets=(1, 4, 8))
    runner.reset(1, 200)  # sized for longer sequences than the trial's: it reuses these buffers
    capacity = runner.capacity
    small, large = TreeOptions(depth=2, top_k=2, total_tokens=3), TreeOptions(depth=3, top_k=2, total_tokens=7)
    variants = {"plain": (None, {"tree": "none"}), "small": (head, {"tree": small}), "large": (head, {"tree": large}),
                "lookup": (head, {"tree": small, "hybrid": True, "lookup_tokens": 4})}
    rates = budget.decode_trial(SpeculativeGenerator, target, runner, variants, prompts(2, 320, seed=5),
                                max_new_tokens=12, rounds=1)
    assert set(rates) == set(variants) and rates["plain"]["tau"] == pytest.approx(1, abs=0.1)  # (prefill: +1 token)
    assert all(r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["tau"] >= 1 for r in rates.values())
    assert runner.capacity == capacity


@pytest.mark.parametrize("draft_weights", ["same", "int8"])
def test_auto_tree_picks_a_tree_only_when_it_measures_more_than_plain(draft_weights):
    """Also with the head drafting from int8 copies of its weights (every drafting generator of the tuning)."""
    target = tiny_model("llama")
    head = oracle_head(target).attach_target(target)
    runner = StaticRunner(target, head.config.aux_layer_ids, buckets=(1, 4, 8, 16))
    options, report = budget.auto_tree(target, head, prompts(2, 320, seed=4), max_new_tokens=24, verbose=False,
                                       runner=runner, generator=SpeculativeGenerator, draft_weights=draft_weights)
    plain = report["predicted_plain"]["tokens_per_s"]
    trial = report["trial"]  # measured by decoding: one tree per verify bucket, best first
    assert 1 <= len(trial) <= budget.TRIAL_TREES
    assert len({bucket_for(t["total_tokens"] + 1, runner.buckets) for t in trial}) == len(trial)
    assert trial == sorted(trial, key=lambda t: -t["tokens_per_s"])
    # the trial's choice: its best row, or a smaller tree within the margin (prefer_smaller)
    rows = [tuple(t[k] for k in ("tokens_per_s", "tau", "step_ms", "depth", "top_k", "total_tokens")) for t in trial]
    choice = budget.prefer_smaller(rows, lambda total: bucket_for(total + 1, runner.buckets))
    assert report["predicted"]["tokens_per_s"] == choice[0] >= trial[0]["tokens_per_s"] / budget.LARGER_TREE_MARGIN
    if options is None:
        assert report["chosen"] == "none" and report["predicted"]["tokens_per_s"] <= plain
    else:
        assert report["predicted"]["tokens_per_s"] > plain
        assert report["chosen"] == {"depth": options.depth, "top_k": options.top_k,
                                    "total_tokens": options.total_tokens}


def test_auto_tree_without_tree_buckets_chooses_plain_decoding():
    """A runner that verifies only one token at a time leaves the trial nothing but plain decoding."""
    target = tiny_model("llama")
    head = oracle_head(target).attach_target(target)
    runner = StaticRunner(target, head.config.aux_layer_ids, buckets=(1,))
    options, report = budget.auto_tree(target, head, prompts(1, 320, seed=6), max_new_tokens=8, verbose=False,
                                       runner=runner, generator=SpeculativeGenerator)
    assert options is None and report["chosen"] == "none" and report["trial"] == []


def test_a_larger_tree_must_win_the_trial_by_a_margin():
    """Trial rows (tokens/s, tau, step ms, depth, top_k, total): a 7-token tree 3 % or 6 % ahead of a 3-token one
    loses to it; 12 % ahead, it wins; the smallest bucket's best row is the starting choice."""
    size = lambda total: 4 if total <= 3 else 8  # noqa: E731
    small, small_worse = (132.0, 1.7, 12.8, 2, 2, 3), (120.0, 1.6, 13.0, 1, 6, 3)
    assert budget.prefer_smaller([(136.0, 1.9, 13.9, 2, 4, 7), small_worse, small], size) == small
    assert budget.prefer_smaller([(140.0, 1.9, 13.6, 3, 3, 7), small_worse, small], size) == small
    assert budget.prefer_smaller([(148.0, 1.9, 13.0, 2, 4, 7), small, small_worse], size)[5] == 7


def test_lookup_branch_is_kept_only_when_measured_at_least_as_fast():
    """lookup_tokens > 0: the chosen tree decodes alone and with the prompt-lookup branch of what tokens the
    tree's next bucket and the runner's largest bucket leave beside it (none: not tried), the faster of the two
    kept; the report keeps the measured rates and the branch only where it was not slower (but for a margin).
    Without lookup_tokens nothing is tried."""
    target = near_bigram_target()  # the oracle head drafts it exactly: a tree beats plain decoding by far
    head = oracle_head(target).attach_target(target)
    runner = StaticRunner(target, head.config.aux_layer_ids, buckets=(1, 4, 8, 16))
    calib = [torch.cat([p, p, p], dim=1) for p in prompts(2, 320, seed=4)]  # repeats: the lookup finds matches
    # lookup_tokens: more than the largest bucket (16) can hold
    options, report = budget.auto_tree(target, head, calib, max_new_tokens=24, verbose=False, runner=runner,
                                       lookup_tokens=20, generator=SpeculativeGenerator)
    assert options is not None
    branch = report["lookup_branch"]
    rates = branch["tokens_per_s"]
    # the branch gets what the next bucket or the largest (16) leaves beside the chosen tree, the faster of the two
    above = [b - options.tree_size for b in (4, 8, 16) if b > options.tree_size]
    assert branch["tokens"] == (max(above[:1] + above[-1:], key=lambda n: branch["trial"][str(n)]) if above else 0)
    if branch["tokens"] == 0:
        assert rates is None and not branch["chosen"] and "largest verify bucket timed (16)" in branch["skipped"]
    else:
        assert rates["tree_alone"] > 0 and rates["with_lookup"] > 0
        assert branch["chosen"] == (rates["with_lookup"] >= budget.LOOKUP_BRANCH_MARGIN * rates["tree_alone"])
    _, without = budget.auto_tree(target, head, calib, max_new_tokens=8, verbose=False, runner=runner,
                                  generator=SpeculativeGenerator)
    assert without["lookup_branch"] is None


def test_the_budget_bounds_the_buckets_timed_and_the_lookup_branch():
    """A budget verifying at most 7 drafted tokens times the buckets up to 8 only, and the tree plus its lookup
    branch stay within them: no larger bucket is compiled for the tuning."""
    target = near_bigram_target()
    head = oracle_head(target).attach_target(target)
    runner = StaticRunner(target, head.config.aux_layer_ids, buckets=(1, 4, 8, 16))
    calib = [torch.cat([p, p, p], dim=1) for p in prompts(2, 320, seed=4)]
    small = dataclasses.replace(budget.FULL, max_verify=7, trial_trees=1)
    options, report = budget.auto_tree(target, head, calib, max_new_tokens=16, verbose=False, runner=runner,
                                       lookup_tokens=20, budget=small, generator=SpeculativeGenerator)
    assert sorted(map(int, report["verify_ms"])) == [0, 3, 7]
    assert options is not None and options.tree_size + report["lookup_branch"]["tokens"] <= 8
    assert {size for _, _, size in runner.shapes} <= {1, 4, 8}


def test_prompt_lookup_alone_is_tried_where_no_tree_won():
    """With no tree chosen (here: a trial of no trees), plain decoding and prompt lookup alone take turns, and
    lookup is kept only where it measured faster than plain decoding."""
    target = near_bigram_target()
    head = oracle_head(target).attach_target(target)
    runner = StaticRunner(target, head.config.aux_layer_ids, buckets=(1, 4, 8))
    calib = [torch.cat([p, p, p], dim=1) for p in prompts(2, 320, seed=4)]
    no_trial = dataclasses.replace(budget.FULL, trial_trees=0)
    options, report = budget.auto_tree(target, head, calib, max_new_tokens=24, verbose=False, runner=runner,
                                       lookup_tokens=3, budget=no_trial, generator=SpeculativeGenerator)
    branch = report["lookup_branch"]
    assert options is None and report["chosen"] == "none" and branch["tokens"] == 3
    rates = branch["tokens_per_s"]
    assert rates["tree_alone"] > 0 and branch["chosen"] == (rates["with_lookup"] > rates["tree_alone"])
