"""scripts/step_phases.py: per-phase timing of the decoding loop, which must not change what is generated."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from tiny import tiny_head, tiny_model

from conftest import save_tiny_target
from drafthead import save_head
from inference.engine import SpeculativeGenerator
from inference.tree import TreeOptions


def load_script():
    path = Path(__file__).resolve().parent.parent / "scripts" / "step_phases.py"
    spec = importlib.util.spec_from_file_location("step_phases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_phases_add_up_and_a_repeated_drafting_step_changes_nothing():
    module = load_script()
    target = tiny_model("llama")
    head = tiny_head(target)
    tree = TreeOptions(depth=2, top_k=2, total_tokens=3)
    generators = {"engine_plain": SpeculativeGenerator(target, None, tree="none", runner="static"),
                  "speculative": SpeculativeGenerator(target, head, tree=tree, runner="static")}
    prompts = [torch.randint(0, 200, (1, n), generator=torch.Generator().manual_seed(n)) for n in (12, 20)]
    reference = [target.generate(p, do_sample=False, max_new_tokens=16)[0, p.shape[1]:].tolist() for p in prompts]
    result = module.measure(generators, prompts, max_new_tokens=16, rounds=2, repeat_draft=True)
    assert len(result["rounds"]) == 2
    for summary in result["rounds"]:
        plain, spec = summary["engine_plain"], summary["speculative"]
        assert plain["tau"] == 1 and spec["steps"] <= plain["steps"] and spec["tau"] >= 1
        ms = spec["ms_per_step"]
        assert {"draft", "draft_step", "draft_step_again", "verify", "commit", "prefill", "host"} <= set(ms)
        # the drafting step (both calls) is part of the drafter's propose
        assert 0 < ms["draft_step"] < ms["draft"] and ms["draft_step_again"] < ms["draft"]
        assert abs(sum(ms[p] for p in ("draft", "verify", "commit", "host")) - spec["loop_ms_per_step"]) < 1e-2
        assert "draft_step" not in plain["ms_per_step"]
    assert result["sequences"]["speculative"] == result["sequences"]["engine_plain"] == reference


def test_the_command_line_writes_the_rounds_as_json(tmp_path):
    from transformers import AutoModelForCausalLM

    target_dir = save_tiny_target(tmp_path / "target")
    save_head(tiny_head(AutoModelForCausalLM.from_pretrained(target_dir)), tmp_path / "head")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": w}) + "\n" for w in ["one two", "red"]))
    out = tmp_path / "phases.json"
    load_script().main(["--target", str(target_dir), "--draft", str(tmp_path / "head"), "--prompts",
                        str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "8", "--rounds", "1",
                        "--compile", "off", "--dtype", "float32", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["prompts"] == 2 and len(result["rounds"]) == 1 and "sequences" not in result
    assert set(result["rounds"][0]) == {"engine_plain", "speculative"}
