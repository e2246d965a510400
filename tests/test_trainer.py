"""The trainer on tiny models: learning, EAGLE-1, exact resume after SIGKILL, batching, evaluation statistics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tiny import tiny_model

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def make_features(target, folder: Path, sequences: list[torch.Tensor], aux: list[int], config_hash: str) -> None:
    """A feature folder written exactly as train.collect writes it (one shard)."""
    from train.collect import forward_features
    from train.features import FeatureWriter, Sequence

    n = len(sequences)
    writer = FeatureWriter(folder, {"target": "tiny", "target_config_hash": config_hash, "aux_layer_ids": aux,
                                    "shard_sequences": n, "num_sequences_planned": n})
    last = target.config.num_hidden_layers - 1
    out = []
    for ids in sequences:
        (aux_h, last_h), = forward_features(target, [ids.tolist()], aux, last, torch.device("cpu"))
        mask = torch.ones(len(ids), dtype=torch.bool)
        mask[:4] = False  # a "prompt" the loss ignores
        out.append(Sequence(ids, mask, aux_h, last_h))
    writer.write_shard(0, out)


def make_run(tmp: Path, kind: str = "eagle3", n_train: int = 32, n_val: int = 8, **train) -> Path:
    """Tiny target folder + train/validation features + recipe; returns the recipe path."""
    from train.target import target_config_hash

    target = tiny_model("llama")
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # a confident target: a soft-CE floor (its entropy) well below the start
    target.save_pretrained(tmp / "target")
    gen = torch.Generator().manual_seed(0)
    # Structured data (a few repeated motifs) so a tiny head can learn something in a few dozen steps.
    motifs = torch.randint(3, 320, (6, 12), generator=gen)
    seqs = []
    for j in range(n_train + n_val):
        length = int(torch.randint(20, 40, (1,), generator=gen))
        order = torch.randint(0, 6, (length // 12 + 1,), generator=gen)
        seqs.append(torch.cat([motifs[o] for o in order])[:length])
    aux = [1, 3, 4]
    chash = target_config_hash(tmp / "target")
    make_features(target, tmp / "features", seqs[:n_train], aux, chash)
    make_features(target, tmp / "features" / "validation", seqs[n_train:], aux, chash)
    recipe = {
        "target": str(tmp / "target"),
        "dtype": "float32",
        "features": {"dir": str(tmp / "features")},
        "head": {"kind": kind, "draft_vocab_size": 256, "aux_layer_ids": aux},
        "train": {"output_dir": str(tmp / "out"), "max_steps": 20, "save_every": 10, "eval_every": 10,
                  "batch_size": 4, "grad_accum": 1, "lr": 3e-3, "warmup_steps": 2, "weight_decay": 0.0,
                  "max_grad_norm": 1.0, "ttt_steps": 3, "ttt_decay": 0.8, "online": False, "seed": 0,
                  "mixed_precision": "fp32", "max_length": 64, **train},
    }
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def env() -> dict:
    e = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
             PYTHONPATH=str(REPO))
    for key in ("ACCELERATE_USE_CPU", "ACCELERATE_USE_DEEPSPEED", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        e.pop(key, None)
    return e


def run_train(recipe: Path, *overrides: str, timeout: int = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([PY, "-m", "train", str(recipe), *overrides], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]


def head_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_learning_eagle3(tmp_path):
    recipe = make_run(tmp_path, max_steps=30, eval_every=30, save_every=30)
    run_train(recipe)
    log = read_log(tmp_path / "out")
    assert [r["step"] for r in log] == list(range(1, 31))
    first, last = sum(r["loss"] for r in log[:3]) / 3, sum(r["loss"] for r in log[-3:]) / 3
    assert last < 0.6 * first, (first, last)
    assert log[-1]["acc_0"] > log[0]["acc_0"] + 0.2, (log[0]["acc_0"], log[-1]["acc_0"])
    assert {"acc_0", "acc_1", "acc_2", "tau", "eval_loss"} <= set(log[-1])
    assert log[-1]["tau"] > 1.2
    from drafthead import DraftHead

    head = DraftHead.from_pretrained(tmp_path / "out" / "final")
    assert head.config.draft_vocab_size == 256 and int(head.t2d.sum()) == 256
    assert (tmp_path / "out" / "checkpoint-30" / "training_state").is_dir()


def test_eagle1_trains(tmp_path):
    recipe = make_run(tmp_path, kind="eagle1", max_steps=6, eval_every=6, save_every=6, feature_noise=0.05)
    run_train(recipe)
    log = read_log(tmp_path / "out")
    assert len(log) == 6 and all(r["loss"] == r["loss"] for r in log)
    assert log[-1]["loss"] < log[0]["loss"]
    assert "acc_0" in log[-1] and "acc_1" not in log[-1]
    from drafthead import DraftHead

    assert DraftHead.from_pretrained(tmp_path / "out" / "final").config.kind == "eagle1"


def test_aux_mismatch_refused(tmp_path):
    recipe = make_run(tmp_path, n_train=8, n_val=4)
    proc = subprocess.run([PY, "-m", "train", str(recipe), "head.aux_layer_ids=[1,2,3]"], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "aux layers [1, 3, 4]" in proc.stderr
