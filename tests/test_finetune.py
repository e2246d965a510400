"""Fine-tuning an existing head (head.init_from) and first-turn data (data.max_assistant_turns)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from test_trainer import PY, REPO, env, head_tensors, make_run, read_log, run_train


@pytest.fixture(scope="module")
def start_head(tmp_path_factory):
    """A head trained 12 steps on a tiny run (the recipe, its folder): the start of every fine-tune here."""
    tmp_path = tmp_path_factory.mktemp("start")
    recipe = make_run(tmp_path, max_steps=12, eval_every=12, save_every=12)
    run_train(recipe)
    return recipe, tmp_path


def test_init_from_continues_a_trained_head(start_head):
    from drafthead.export import export_head

    recipe, tmp_path = start_head
    start = tmp_path / "out" / "final"
    trained_eval = read_log(tmp_path / "out")[-1]
    exported = export_head(start, tmp_path / "exported")

    for name, source in (("native", start), ("exported", exported)):
        out = tmp_path / f"ft-{name}"
        # draft_vocab_size differs from the start head's: the start head's vocabulary must win
        run_train(recipe, f"head.init_from={source}", f"train.output_dir={out}", "train.max_steps=2",
                  "train.eval_every=2", "head.draft_vocab_size=128")
        # before its first step the fine-tune IS the start head: same validation numbers
        untrained = json.loads((out / "eval_untrained.json").read_text())
        assert untrained["eval_loss"] == pytest.approx(trained_eval["eval_loss"], rel=1e-3)
        assert untrained["eval_acc_0"] == pytest.approx(trained_eval["eval_acc_0"], abs=1e-6)
        before, after = head_tensors(start), head_tensors(out / "final")
        assert torch.equal(before["d2t"], after["d2t"]) and torch.equal(before["t2d"], after["t2d"])
        assert not torch.equal(before["fc.weight"], after["fc.weight"])  # and it trained

    # max_steps=0 evaluates a head without training it: the trained head's own last validation
    out = tmp_path / "eval-only"
    run_train(recipe, f"head.init_from={start}", f"train.output_dir={out}", "train.max_steps=0")
    only = json.loads((out / "eval_untrained.json").read_text())
    assert only["eval_tau_decode"] == pytest.approx(trained_eval["eval_tau_decode"], abs=1e-6)
    assert only["eval_tau"] == pytest.approx(trained_eval["eval_tau"], abs=1e-6)
    assert torch.equal(head_tensors(out / "final")["fc.weight"], head_tensors(start)["fc.weight"])


def test_init_from_refuses_other_aux_layers_and_kind(start_head, tmp_path):
    recipe, start = start_head[0], start_head[1] / "out" / "final"
    for override, message in (("head.aux_layer_ids=[0,1,2]", "drop head.aux_layer_ids"),
                              ("head.kind=eagle1", "head kind")):
        proc = subprocess.run([PY, "-m", "train", str(recipe), f"head.init_from={start}", override,
                               f"train.output_dir={tmp_path / 'refused'}"], cwd=REPO, env=env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_max_assistant_turns_cuts_after_the_nth_reply(tmp_path):
    from train.conversations import read_conversations

    path = tmp_path / "c.jsonl"
    turns = [{"from": f, "value": f"{f}{i}"} for i, f in enumerate(["system", "human", "gpt", "human", "gpt"])]
    path.write_text(json.dumps({"id": "a", "conversations": turns}) + "\n"
                    + json.dumps({"id": "b", "conversations": turns[:2]}) + "\n")
    first, untouched = read_conversations(path, max_assistant_turns=1)
    assert [m["content"] for m in first["messages"]] == ["system0", "human1", "gpt2"]
    assert [m["content"] for m in untouched["messages"]] == ["system0", "human1"]  # no reply: kept as it is
    assert len(read_conversations(path, max_assistant_turns=2)[0]["messages"]) == 5
    assert len(read_conversations(path)[0]["messages"]) == 5


def test_every_shipped_recipe_loads():
    """configs/*.yaml (the default, the GPU recipe, the CPU self-distillation recipe) parse with every key known."""
    from train.recipe import load_recipe

    recipes = sorted((REPO / "configs").glob("*.yaml"))
    assert len(recipes) >= 3
    for path in recipes:
        recipe = load_recipe(path)
        assert recipe.train.max_steps or recipe.train.epochs, path
    gpu = load_recipe(REPO / "configs" / "smollm2-135m-eagle3-gpu.yaml")
    assert gpu.device == "auto" and gpu.train.online and gpu.train.batch_tokens == 16384
