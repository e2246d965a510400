"""Models and heads keep the rotary frequencies transformers gives them when the project casts them to a dtype.

transformers computes RoPE's `inv_freq` in float32 whatever dtype it loads a model in. `Module.to(bf16)` would
round it, and the rotary angles drift (by whole turns at 8k positions): the engine's target would no longer be
the model `from_pretrained(..., dtype=bf16)` returns, and a head would not be the one its training computed.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from drafthead import load_head, save_head
from drafthead.utils import place_module, rotary_frequencies
from inference.engine import SpeculativeGenerator
from tiny import tiny_head, tiny_model


def test_place_module_keeps_rotary_frequencies(arch):
    model = tiny_model(arch)
    before = {n: b.clone() for n, b in rotary_frequencies(model).items()}
    assert before, "the tiny models have rotary embeddings"
    place_module(model, "cpu", torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    after = rotary_frequencies(model)
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert after[name].dtype == torch.float32 and torch.equal(after[name], value), name


def test_engine_target_is_the_model_transformers_loads(tiny_target_dir):
    """from_pretrained(..., dtype=bf16) computes what transformers' own bf16 model computes, also far into the
    positions (where rounded frequencies would turn the rotary angles around)."""
    reference = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.bfloat16).eval()
    gen = SpeculativeGenerator.from_pretrained(tiny_target_dir, None, tree="none", device="cpu", dtype="bfloat16")
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(6000, 6012)[None]
    with torch.no_grad():
        expected = reference(input_ids=ids, position_ids=positions).logits
        got = gen.target(input_ids=ids, position_ids=positions).logits
    assert torch.equal(got, expected)
    for name, value in rotary_frequencies(reference).items():
        assert torch.equal(rotary_frequencies(gen.target)[name], value), name


def test_load_head_keeps_rotary_frequencies(tmp_path):
    target = tiny_model("llama")
    head = tiny_head(target)
    expected = {n: b.clone() for n, b in rotary_frequencies(head).items()}
    assert expected, "the head has a rotary embedding"
    save_head(head, tmp_path / "h")
    loaded = load_head(tmp_path / "h", target=place_module(target, "cpu", torch.bfloat16), dtype=torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16
    for name, value in expected.items():
        got = rotary_frequencies(loaded)[name]
        assert got.dtype == torch.float32 and torch.equal(got, value), name


def test_engine_dtype_fast_and_checkpoint(tiny_target_dir):
    """dtype="fast" is the hardware's choice (drafthead.hardware.auto_dtype), "auto" keeps the checkpoint's (as in
    transformers)."""
    from drafthead.hardware import auto_dtype

    saved = AutoModelForCausalLM.from_pretrained(tiny_target_dir).dtype
    fast = SpeculativeGenerator.from_pretrained(tiny_target_dir, None, tree="none", device="cpu", dtype="fast")
    kept = SpeculativeGenerator.from_pretrained(tiny_target_dir, None, tree="none", device="cpu", dtype="auto")
    assert next(fast.target.parameters()).dtype == auto_dtype("cpu")
    assert next(kept.target.parameters()).dtype == saved
