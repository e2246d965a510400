"""The helpers of the GPU device jobs, on CPU: the budgeted job runner, the 8B-shaped target's config, the synthetic
prepared data of bench_train --online, and verify_cost's sequential sizes and weight-streaming bytes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import torch
from tiny import tiny_model

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_jobs_share_one_budget_and_record_how_each_ended(tmp_path):
    """A job past its limit is cut, one the budget no longer fits is skipped, a failing one does not stop the
    next, and jobs_status.json is valid JSON after every job; ONLY runs the jobs it names alone."""
    script = f"""
BUDGET_S=4 STAGE={tmp_path} REPO={SCRIPTS.parent}
source {SCRIPTS / 'gpu_jobs_common.sh'}
job fails 10 1 false
job cut 2 1 sleep 30
job fits 10 1 true
job skipped 10 5 true
"""
    subprocess.run(["bash", "-c", script], check=True, capture_output=True, timeout=60)
    status = json.loads((tmp_path / "out" / "jobs_status.json").read_text())
    outcomes = {j["job"]: j["outcome"] for j in status["jobs"]}
    assert outcomes["fails"].startswith("failed (exit 1)") and outcomes["cut"] == "cut at its limit of 2 s"
    assert outcomes["fits"] == "ok" and outcomes["skipped"].startswith("skipped")
    assert (tmp_path / "out" / "cut.log").exists() and not (tmp_path / "out" / "skipped.log").exists()
    subprocess.run(["bash", "-c", "ONLY=fits,other\n" + script], check=True, capture_output=True, timeout=60)
    status = json.loads((tmp_path / "out" / "jobs_status.json").read_text())
    assert [j["outcome"] for j in status["jobs"]] == ["skipped: not in ONLY", "skipped: not in ONLY", "ok",
                                                      "skipped: not in ONLY"]


def test_the_8b_shape_is_llama_3_1_8b():
    """The shape's parameter count is Llama-3.1-8B's (counted on the meta device: no memory)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, LlamaConfig

    shapes = _script("make_target").SHAPES
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shapes["llama-3.1-8b"]))
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert shapes["tiny"]["vocab_size"] == shapes["llama-3.1-8b"]["vocab_size"]


def test_synthetic_prepared_sequences_are_what_online_training_reads(tmp_path):
    from train.batches import PreparedSequences

    _script("bench_train").synthetic_prepared(tmp_path / "prepared", vocab=300, n=3, seq_len=10, loss_fraction=0.7)
    data = PreparedSequences(tmp_path / "prepared", "train")
    item = data[2]
    assert data.lengths() == [10, 10, 10] and int(item["input_ids"].max()) < 300
    assert item["loss_mask"].tolist() == [False] * 3 + [True] * 7


def test_verify_cost_sequential_sizes_and_streamed_bytes():
    """--sequential times the sizes one after the other in the given order, reporting after each; a step streams
    every weight but the (untied) input embedding."""
    from inference.runners.static import StaticRunner

    module = _script("verify_cost")
    model = tiny_model("llama")
    seen = []
    times = module.measure(StaticRunner(model, []), batch=1, context=12, queries=[1, 4, 2], rounds=2,
                           sequential=True, on_size=lambda t: seen.append(list(t)))
    assert seen == [[1], [1, 4], [1, 4, 2]] and all(len(t) == 2 for t in times.values())
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert module.streamed_bytes(model) == total - embedding.numel() * embedding.element_size()
    assert module.bandwidth_gb_s(torch.device("cpu"), gib=0.01, reps=2) > 0
