"""A generator leaves no trace on what it was handed: the user's target model is the same model again once the
generator is closed or dropped (classes, buffers, hooks, attention implementation, config), and torch's compiler
settings are never changed outside our own compiled steps (test_static_runner.py checks them around a compiled
decode)."""

from __future__ import annotations

import gc

import torch
from test_batch import left_padded, row_prompts
from test_inference_greedy import TREES, random_head
from tiny import tiny_model

from inference import SpeculativeGenerator
from inference.cpu.kernels import avx2_kernels_available
from inference.drafters.self_draft import StreamingSelfDrafter

torch.set_num_threads(1)


def fingerprint(model: torch.nn.Module) -> dict:
    """What a user could see of a model: each module's class, buffers and hooks, the config, the state dict."""
    return {
        "classes": [(name, type(m)) for name, m in model.named_modules()],
        "buffers": sorted(name for name, _ in model.named_buffers()),
        "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
        "config": model.config.to_dict(),
        "attention": model.config._attn_implementation,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def assert_same(before: dict, after: dict) -> None:
    state = before.pop("state"), after.pop("state")
    assert before == after
    assert state[0].keys() == state[1].keys() and all(torch.equal(state[0][k], state[1][k]) for k in state[0])


def use_every_part(target, head) -> list[SpeculativeGenerator]:
    """Generators that convert the target's linears (the static runner's small-row kernel where the CPU has one),
    hook its layers (a head's features), add int8 copies (the self-draft) and prefill a queue (generate_many)."""
    rows = row_prompts(target.config.vocab_size)
    ids, mask = left_padded(rows)
    gens = [SpeculativeGenerator(target, head, tree=TREES["wide"]),
            SpeculativeGenerator(target, StreamingSelfDrafter(target, sink=2, window=4, gamma=2, weights="int8"))]
    for gen in gens:
        gen.generate(ids, attention_mask=mask, max_new_tokens=6)
        gen.generate_many([r[0] for r in rows], max_new_tokens=4, batch_size=2)
    return gens


def test_the_target_is_unchanged_once_the_generators_are_closed():
    target = tiny_model("llama")
    head = random_head(target).attach_target(target)
    before = fingerprint(target)
    gens = use_every_part(target, head)
    during = fingerprint(target)
    assert during["hooks"] > 0  # while the generators live the target carries our hooks, int8 copies and, where
    assert during["buffers"] != before["buffers"]  # the CPU has a kernel for its dtype, converted linears
    assert during["classes"] != before["classes"] or not avx2_kernels_available()
    for gen in gens:
        gen.close()
    assert_same(before, fingerprint(target))


def test_the_target_is_unchanged_once_the_generators_are_dropped():
    target = tiny_model("qwen2")
    head = random_head(target).attach_target(target)
    before = fingerprint(target)
    gens = use_every_part(target, head)
    del gens
    gc.collect()
    assert_same(before, fingerprint(target))
