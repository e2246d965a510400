"""scripts/draft_kv_policies.py: the positions a SnapKV-style policy keeps, and the simulated self-speculation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from tiny import tiny_model
from transformers import DynamicCache

path = Path(__file__).resolve().parent.parent / "scripts" / "draft_kv_policies.py"
spec = importlib.util.spec_from_file_location("draft_kv_policies", path)
policies = importlib.util.module_from_spec(spec)
spec.loader.exec_module(policies)


def test_kept_positions_are_the_sinks_and_the_most_attended_before_the_window():
    mass = torch.zeros(2, 40)
    mass[0, 10], mass[1, 20], mass[0, 38] = 5.0, 7.0, 9.0  # 38 lies inside the last window of 8
    keep = policies.kept_positions({0: mass}, prompt=40, sink=2, budget=1, window=8, pool=1)[0]
    assert keep[0].nonzero().flatten().tolist() == [0, 1, 10]
    assert keep[1].nonzero().flatten().tolist() == [0, 1, 20]
    assert not policies.kept_positions({0: mass}, 40, 2, 0, 8)[0][:, 2:].any()  # StreamingLLM: sinks only


def test_a_draft_that_keeps_everything_accepts_every_token():
    """With every prompt position kept (and a window covering the new tokens) the draft is the target itself: each
    verification accepts all gamma drafted tokens and the bonus, and the tokens are the target's greedy ones; with
    a 1-position window and no sinks it accepts less."""
    target = tiny_model("llama")
    target.set_attn_implementation(policies.NAME)
    ids = torch.randint(3, target.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = DynamicCache(config=target.config)
    first = int(policies.forward(target, ids, 0, cache)[-1].argmax())
    everything = {i: torch.ones(target.config.num_key_value_heads, 24, dtype=torch.bool)
                  for i in range(target.config.num_hidden_layers)}
    tau, tokens = policies.speculate(target, cache, 24, first, everything, window=64, gamma=3, new_tokens=13)
    assert tau == 4.0
    target.set_attn_implementation("eager")  # the reference: transformers' own attention
    ref = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=13)[0, 24:].tolist()
    target.set_attn_implementation(policies.NAME)
    assert tokens == ref
    nothing = {i: torch.zeros_like(k) for i, k in everything.items()}
    tau_blind, tokens = policies.speculate(target, cache, 24, first, nothing, window=1, gamma=3, new_tokens=13)
    assert tau_blind < 4.0 and tokens == ref
