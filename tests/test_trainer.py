"""The trainer on tiny models: learning, EAGLE-1, exact resume after SIGKILL, batching, evaluation statistics."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
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
                  "mixed_precision": "fp32", "max_length": 64, "log_every": 1, **train},
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


def check_eval_tau(record: dict, ttt_steps: int) -> None:
    """tau - 1 (accepted drafts per chain) is at least acc_0 (a step-0 hit is accepted), at most the sum of the
    step accuracies, and at most ttt_steps * acc_0 (a chain goes on only from a step-0 hit)."""
    accs = [record[f"eval_acc_{i}"] for i in range(ttt_steps)]
    accepted = record["eval_tau"] - 1.0
    assert accs[0] - 1e-9 <= accepted <= min(sum(accs), ttt_steps * accs[0]) + 1e-9, (record["eval_tau"], accs)
    assert 1.0 <= record["eval_tau_decode"] <= 1.0 + ttt_steps, record["eval_tau_decode"]


def head_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_learning_eagle3(tmp_path):
    recipe = make_run(tmp_path, max_steps=40, eval_every=40, save_every=40, lr=1e-2, max_grad_norm=10.0)
    run_train(recipe)
    log = read_log(tmp_path / "out")
    assert [r["step"] for r in log] == list(range(1, 41))
    first, last = sum(r["loss"] for r in log[:3]) / 3, sum(r["loss"] for r in log[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    # validation accuracy at unroll position 0 (teacher-forced, vs the target's greedy token) rises from ~0
    assert log[0]["acc_0"] < 0.1 and log[-1]["eval_acc_0"] > 0.15, (log[0]["acc_0"], log[-1]["eval_acc_0"])
    assert {"eval_acc_0", "eval_acc_1", "eval_acc_2", "eval_tau", "eval_loss"} <= set(log[-1])
    assert log[-1]["eval_tau"] > 1.1
    check_eval_tau(log[-1], ttt_steps=3)
    from drafthead import load_head

    head = load_head(tmp_path / "out" / "final")
    assert head.config.draft_vocab_size == 256 and int(head.t2d.sum()) == 256
    assert (tmp_path / "out" / "checkpoint-40" / "training_state").is_dir()


def test_one_process_bf16_autocast_over_several_loss_chunks(tmp_path):
    """`python -m train` on one process with mixed_precision=bf16 (the default recipe's): fp32 master weights under
    autocast, micro-batches with more trained rows than one chunk of the loss (train/soft_ce.py) holds."""
    recipe = make_run(tmp_path, n_train=64, max_steps=4, eval_every=4, save_every=4, batch_size=64,
                      mixed_precision="bf16")
    output = run_train(recipe).stdout
    assert "mixed_precision=bf16" in output
    log = read_log(tmp_path / "out")
    assert [r["step"] for r in log] == [1, 2, 3, 4] and all(r["loss"] == r["loss"] for r in log)  # no NaN
    assert log[-1]["loss"] < log[0]["loss"]


def test_eagle1_trains(tmp_path):
    recipe = make_run(tmp_path, kind="eagle1", max_steps=6, eval_every=6, save_every=6, feature_noise=0.05)
    run_train(recipe)
    log = read_log(tmp_path / "out")
    assert len(log) == 6 and all(r["loss"] == r["loss"] for r in log)
    assert log[-1]["loss"] < log[0]["loss"]
    assert "eval_acc_0" in log[-1] and "eval_acc_1" not in log[-1]
    from drafthead import load_head

    assert load_head(tmp_path / "out" / "final").config.kind == "eagle1"


def test_aux_mismatch_refused(tmp_path):
    recipe = make_run(tmp_path, n_train=8, n_val=4)
    proc = subprocess.run([PY, "-m", "train", str(recipe), "head.aux_layer_ids=[1,2,3]"], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "aux layers [1, 3, 4]" in proc.stderr


def test_online_matches_offline(tmp_path):
    """online=true computes the same features in the loop: the loss curve follows the offline run's."""
    import datasets

    from train.features import FeatureDataset

    recipe_path = make_run(tmp_path, n_train=16, n_val=8, max_steps=4, save_every=100, eval_every=4)
    splits = {}
    for split, folder in (("train", tmp_path / "features"), ("validation", tmp_path / "features" / "validation")):
        ds = FeatureDataset(folder)
        items = [ds[i] for i in range(len(ds))]
        splits[split] = datasets.Dataset.from_dict({
            "input_ids": [it["input_ids"].to(torch.int32).tolist() for it in items],
            "loss_mask": [it["loss_mask"].tolist() for it in items],
            "id": [f"{split}-{i}" for i in range(len(items))],
        })
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "prepared"))
    run_train(recipe_path)
    run_train(recipe_path, "train.online=true", f"data.prepared_dir={tmp_path / 'prepared'}",
              f"train.output_dir={tmp_path / 'online'}")
    offline, online = read_log(tmp_path / "out"), read_log(tmp_path / "online")
    assert len(online) == len(offline) == 4
    for a, b in zip(offline, online):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)
        assert b["tokens"] == a["tokens"]
    assert online[-1]["eval_loss"] == pytest.approx(offline[-1]["eval_loss"], rel=1e-3)


# ------------------------------------------------------------------------------------- in-process units
def test_epoch_batches_deterministic_and_dealt_evenly():
    from train.batches import epoch_batches, rank_batches

    lengths = [int(x) for x in torch.randint(5, 200, (101,), generator=torch.Generator().manual_seed(1))]
    a = epoch_batches(lengths, seed=3, epoch=2, batch_tokens=600)
    assert a == epoch_batches(lengths, seed=3, epoch=2, batch_tokens=600)
    assert a != epoch_batches(lengths, seed=3, epoch=3, batch_tokens=600)
    assert sorted(i for b in a for i in b) == list(range(101))
    assert all(len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 600 for b in a)
    fixed = epoch_batches(lengths, seed=3, epoch=0, batch_size=8)
    assert [len(b) for b in fixed].count(8) >= len(fixed) - 2  # one short batch per length window at most
    r0, r1 = rank_batches(fixed, 0, 2), rank_batches(fixed, 1, 2)
    assert len(r0) == len(r1) == len(fixed) // 2
    assert not {i for b in r0 for i in b} & {i for b in r1 for i in b}
    with pytest.raises(ValueError, match="cannot feed"):
        rank_batches(fixed[:1], 0, 2)


def test_collate_right_pads():
    from train.batches import collate

    items = [{"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([0, 1, 1], dtype=torch.bool),
              "aux_hidden": torch.ones(3, 4, dtype=torch.bfloat16)},
             {"input_ids": torch.tensor([8]), "loss_mask": torch.tensor([1], dtype=torch.bool),
              "aux_hidden": torch.ones(1, 4, dtype=torch.bfloat16)}]
    batch = collate(items)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["loss_mask"].tolist() == [[False, True, True], [True, False, False]]
    assert batch["aux_hidden"].dtype == torch.bfloat16 and batch["aux_hidden"][1, 1:].abs().sum() == 0


def test_tau_counts_greedy_chains():
    """Hand-made unroll outputs: tau counts leading hits, stops where the fed data token is not greedy."""
    from train.evaluate import step_statistics

    # T = 6: step i has n_i = 4 - i output positions t; step i predicts x_{t+i+2} (target greedy = x here)
    x = torch.tensor([[0, 1, 2, 3, 4, 5]])
    targets = [x[:, i + 2 :] for i in range(3)]
    preds = [t.clone() for t in targets]
    preds[1][0, 0] = 99  # t=0: step 0 hits, step 1 misses -> 1 accepted
    valid = [torch.ones_like(t, dtype=torch.bool) for t in targets]
    stats = step_statistics({"preds": preds, "targets": targets, "valid": valid}, x)
    # t=0: 1; t=1: steps 0,1,2 -> 3; t=2: steps 0,1 (n_2 = 2 covers t<2 only) -> 2; t=3: step 0 -> 1
    assert stats["accepted"].item() == 1 + 3 + 2 + 1 and stats["chains"].item() == 4
    # decoding starts at t=0 (1 accepted + the target's token), then at t=2 (2 + 1): 5 tokens in 2 forwards
    assert stats["decode_tokens"].item() == 5 and stats["decode_forwards"].item() == 2
    assert stats["correct"].tolist() == [4, 2, 2] and stats["count"].tolist() == [4, 3, 2]
    # If the target's greedy token at t=1 (step 0) is 42 while the data says x_3 = 3, the unroll fed 3 to the
    # next step, which a greedy chain would not have: that chain stops after step 0 (1 instead of 3).
    targets_bad = [t.clone() for t in targets]
    targets_bad[0][0, 1] = 42
    preds_bad = [t.clone() for t in targets_bad]  # the head always agrees with the target
    stats = step_statistics({"preds": preds_bad, "targets": targets_bad, "valid": valid}, x)
    assert stats["accepted"].item() == 3 + 1 + 2 + 1
    assert stats["correct"].tolist() == [4, 3, 2]


def test_decode_walk_follows_the_forwards_decoding_would_make():
    """tau_decode's walk: each forward jumps past what it accepted; a non-start position (a user turn) is skipped;
    an unlucky start counts one token in one forward."""
    from train.evaluate import decode_walk

    accepted = torch.tensor([[0, 1, 5, 0, 2, 0, 0], [3, 3, 3, 3, 0, 0, 0]])
    starts = torch.tensor([[1, 1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    # row 0: t0 -> 1 token, t1 -> 2 tokens (skips t2), t3 not a start, t4 -> 3 tokens: 6 in 3 forwards
    # row 1: t0 -> 4 tokens, t4 -> 1, t5 -> 1, t6 not a start: 6 in 3 forwards
    assert decode_walk(accepted, starts) == (12, 6)
    # averaging every start alike (train.evaluate's tau) would say (1+2+6+3+1+1 + 4+4+4+4+1+1) / 12 = 2.67
    assert decode_walk(accepted, torch.zeros_like(starts)) == (0, 0)


def test_loader_resume_exact(tmp_path):
    """DataLoader (2 workers) + log_every: 3 steps then a resume to 8 read the batches and reach the parameters
    of one uninterrupted 8-step run; log records every 3 steps and at the last. A resume with another seed is
    refused, naming it, and leaves the run as it was."""
    common = dict(n_train=32, n_val=8, max_steps=8, save_every=100, eval_every=100, batch_size=2, grad_accum=2,
                  min_lr_ratio=1.0, num_workers=2, log_every=3, debug_report=True)  # constant lr after warmup
    recipe = make_run(tmp_path, **common)
    run_train(recipe)
    out = tmp_path / "split"
    run_train(recipe, f"train.output_dir={out}", "train.max_steps=3")
    first = json.loads((out / "ranks" / "rank-0.json").read_text())
    # a resume with another seed (another data order) is refused before it touches the run
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    refused = subprocess.run([PY, "-m", "train", str(recipe), f"train.output_dir={out}", "train.seed=1"], cwd=REPO,
                             env=env(), capture_output=True, text=True, timeout=240)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: {out}/checkpoint-3 was trained on other inputs (train.seed: was 0, now 1): restore them to resume, "
        "or train into another train.output_dir")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    proc = run_train(recipe, f"train.output_dir={out}")
    assert "resumed from" in proc.stdout + proc.stderr
    second = json.loads((out / "ranks" / "rank-0.json").read_text())
    whole = json.loads((tmp_path / "out" / "ranks" / "rank-0.json").read_text())
    assert first["seen"] + second["seen"] == whole["seen"] and len(whole["seen"]) == 16
    a, b = head_tensors(tmp_path / "out" / "final"), head_tensors(out / "final")
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)
    log_a, log_b = read_log(tmp_path / "out"), read_log(out)
    assert [r["step"] for r in log_a] == [r["step"] for r in log_b] == [3, 6, 8]
    for ra, rb in zip(log_a, log_b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6) and rb["tokens"] == ra["tokens"]
    assert all(step["forward"] > 0 and step["seconds"] >= step["forward"] + step["backward"]
               for step in whole["steps"])


def test_loader_workers_do_not_fork_the_trainer():
    """Loader workers start from a forkserver: a plain fork of the threaded trainer deadlocked a 2-rank run in
    CPython's after-fork cleanup (once in ~200 loader starts). The workers still read the same batches."""
    from train.loader import make_loader

    items = [{"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.bool)} for n in (3, 5, 4, 2)]
    order = [[0, 1], [2, 3], [1, 3]]
    with_workers = make_loader(items, order, None, online=True, num_workers=2, device=torch.device("cpu"))
    assert with_workers.multiprocessing_context.get_start_method() == "forkserver"
    in_process = make_loader(items, order, None, online=True, num_workers=0, device=torch.device("cpu"))
    read = lambda loader: [[item["input_ids"].tolist() for item in batch] for batch in loader]  # noqa: E731
    assert read(with_workers) == read(in_process) == [[list(range(3)), list(range(5))],
                                                      [list(range(4)), list(range(2))],
                                                      [list(range(5)), list(range(2))]]


def test_step_plan_redeals_across_world_sizes():
    """A position taken with W ranks, continued with W' ranks: the global micro-batch order goes on unchanged."""
    from train.loader import Position, StepPlan

    lengths = [int(x) for x in torch.randint(5, 60, (50,), generator=torch.Generator().manual_seed(2))]
    plan = lambda rank, world: StepPlan(lengths, 1, 2, None, None, 2, rank, world)  # noqa: E731
    order = plan(0, 1).epoch(0)  # 25 global micro-batches; W ranks x grad_accum 2 per step

    def global_order(world: int, start: Position, steps: int) -> tuple[list[list[int]], Position]:
        runs = [list(itertools.islice(plan(r, world).steps(start), steps)) for r in range(world)]
        seen = [b for s in range(steps) for m in range(2) for r in range(world) for b in [runs[r][s].group[m]]]
        return seen, runs[0][-1].after

    seen2, pos = global_order(2, Position(), 3)  # 12 batches
    assert pos == Position(0, 12)
    seen1, pos = global_order(1, pos, 6)  # 12 more: the epoch's 24 of 25 (one dropped) ends the epoch
    assert seen2 + seen1 == order[:24] and pos == Position(1, 0)
    seen3, pos = global_order(3, Position(0, 6), 3)  # 18 batches after the first 6
    assert seen3 == order[6:24] and pos == Position(1, 0)
    assert plan(0, 3).steps_in_epoch(0, 24) == 0


@pytest.mark.parametrize("tied", [False, True])
def test_offline_loads_only_the_borrowed_modules(tmp_path, tied):
    """load_borrowed: embedding, final norm and lm_head equal the full target's (tied or not); every decoder layer
    stays on the meta device (no memory)."""
    from train.target import load_borrowed

    target = tiny_model("llama", tie_word_embeddings=tied)
    target.save_pretrained(tmp_path / "t")
    part = load_borrowed(tmp_path / "t")
    for get in (lambda m: m.get_input_embeddings(), lambda m: m.get_decoder().norm,
                lambda m: m.get_output_embeddings()):
        assert torch.equal(get(part).weight, get(target).weight.float())
    layers = [p for n, p in part.named_parameters() if ".layers." in n]
    assert layers and all(p.is_meta for p in layers)
