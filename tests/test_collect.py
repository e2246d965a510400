"""train.collect: features equal the target's own hidden states; a SIGKILLed run resumes to identical shards."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import REPO, save_tiny_target
from tiny import tiny_model
from train.collect import collect_split, length_batches, shard_tokens
from train.features import MANIFEST, FeatureDataset, shard_name


def token_dataset(lengths, seed=0, vocab=320):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    masks = [[j % 3 != 0 for j in range(n)] for n in lengths]
    return Dataset.from_dict({"id": [f"s{i}_0" for i in range(len(lengths))], "input_ids": ids, "loss_mask": masks})


def test_length_batches():
    batches = length_batches([5, 3, 9, 2, 7], batch_tokens=16)
    assert sorted(j for b in batches for j in b) == [0, 1, 2, 3, 4]
    lengths = [5, 3, 9, 2, 7]
    assert all(len(b) * max(lengths[j] for j in b) <= 16 or len(b) == 1 for b in batches)
    assert batches[0] == [3, 1, 0]  # shortest first


def test_shard_tokens_follow_the_selected_rows():
    split = token_dataset(list(range(1, 11))).select([9, 8, 0, 1, 2])  # an indices mapping, as after a filter
    assert [shard_tokens(split, i, 2) for i in range(4)] == [19, 3, 3, 0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_features_equal_direct_hidden_states(tmp_path, arch):
    model = tiny_model(arch)
    lengths = [17, 5, 11, 30, 2]
    split = token_dataset(lengths)
    aux = [1, 3, 4]
    assert len(length_batches(lengths, 200)) == 1  # one padded batch of different lengths
    stats = collect_split(model, split, tmp_path, {"target": arch, "target_config_hash": "x", "hidden_size": 64},
                          aux, shard_sequences=3, batch_tokens=200, device=torch.device("cpu"))
    assert stats == {"shards_written": 2, "shards_skipped": 0, "tokens": sum(lengths)}
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["aux_layer_ids"] == aux and manifest["last_layer_id"] == 7 and manifest["dtype"] == "bfloat16"
    assert manifest["num_sequences_planned"] == 5 and manifest["num_tokens"] == sum(lengths)

    data = FeatureDataset(tmp_path)
    assert len(data) == 5
    for j, n in enumerate(lengths):
        item = data[j]
        assert item["input_ids"].tolist() == split[j]["input_ids"]
        assert item["loss_mask"].tolist() == split[j]["loss_mask"]
        assert item["aux_hidden"].dtype == torch.bfloat16 and item["aux_hidden"].shape == (n, 3 * 64)
        with torch.no_grad():  # unpadded, alone: hidden_states[k + 1] is the output of layer k
            hs = model(torch.tensor([split[j]["input_ids"]]), output_hidden_states=True).hidden_states
            ref_aux = torch.cat([hs[k + 1][0] for k in aux], dim=-1)
            got_final = model.model.norm(item["last_hidden"].float())  # hidden_states[-1] is after the final norm
        torch.testing.assert_close(item["aux_hidden"].float(), ref_aux, rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(got_final, hs[-1][0], rtol=3e-2, atol=3e-2)
        assert not torch.equal(item["last_hidden"].float(), hs[-1][0])  # really the pre-norm output

    # a second run finds both shards done and writes nothing
    again = collect_split(model, split, tmp_path, {"target": arch, "target_config_hash": "x", "hidden_size": 64},
                          aux, shard_sequences=3, batch_tokens=200, device=torch.device("cpu"))
    assert again["shards_written"] == 0 and again["shards_skipped"] == 2
    with pytest.raises(ValueError, match="target_config_hash"):  # never mixes features of another target
        collect_split(model, split, tmp_path, {"target_config_hash": "y"}, aux, 3, 200, torch.device("cpu"))


def _write_setup(tmp_path):
    from datasets import DatasetDict

    target = save_tiny_target(tmp_path / "target")
    data = DatasetDict(train=token_dataset([160 + 7 * (i % 5) for i in range(32)]), validation=token_dataset([9, 4], 1))
    data.save_to_disk(str(tmp_path / "prepared"))
    recipe = {"target": str(target), "device": "cpu", "dtype": "float32",
              "data": {"prepared_dir": str(tmp_path / "prepared")},
              "features": {"dir": str(tmp_path / "features"), "shard_sequences": 2, "batch_tokens": 170},
              "head": {"aux_layer_ids": [1, 3, 4]}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return tmp_path / "recipe.yaml"


def _run(recipe, *overrides, kill_after_first_shard=False):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "train.collect", str(recipe), *overrides], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if kill_after_first_shard:
        folder = recipe.parent / "features"
        deadline = time.time() + 120
        while not (folder / shard_name(0)).exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=180)
    return proc.returncode, out.decode()


def _listed_shards_are_whole(folder):
    manifest = json.loads((folder / MANIFEST).read_text())
    for shard in manifest["shards"]:
        tensors = load_file(str(folder / shard["file"]))  # raises on a partial file
        assert len(tensors["offsets"]) == shard["num_sequences"] + 1
        assert int(tensors["offsets"][-1]) == shard["num_tokens"] == len(tensors["input_ids"])
    return manifest


def test_killed_run_resumes_to_identical_shards(tmp_path):
    recipe = _write_setup(tmp_path)
    code, out = _run(recipe, kill_after_first_shard=True)
    assert code == -signal.SIGKILL, out
    folder = tmp_path / "features"
    partial = _listed_shards_are_whole(folder) if (folder / MANIFEST).exists() else {"shards": []}
    assert len(partial["shards"]) < 16  # killed mid-way
    # A kill can land inside either atomic write; plant both kinds of leftover so the cleanup is always exercised.
    (folder / f".{MANIFEST}.killed.tmp").write_text("{")
    (folder / f".{shard_name(15)}.killed.tmp").write_bytes(b"partial")

    code, out = _run(recipe)
    assert code == 0, out
    assert not list(folder.glob(".*.tmp"))
    counts = ast.literal_eval(next(line for line in out.splitlines() if line.startswith("train: "))[len("train: "):])
    done_before = len(partial["shards"])  # the killed run's finished shards are skipped, the others written
    assert (counts["shards_skipped"], counts["shards_written"]) == (done_before, 16 - done_before), (out, partial)
    resumed = _listed_shards_are_whole(folder)

    reference = tmp_path / "reference"
    code, out = _run(recipe, f"features.dir={reference}")
    assert code == 0, out
    uninterrupted = _listed_shards_are_whole(reference)
    assert resumed["shards"] == uninterrupted["shards"] and len(resumed["shards"]) == 16
    for shard in resumed["shards"]:
        a, b = load_file(str(folder / shard["file"])), load_file(str(reference / shard["file"]))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(FeatureDataset(folder / "validation")) == 2  # the validation split is collected too
    assert resumed["target"] == "target" and resumed["target_dtype"] == "float32" and resumed["hidden_size"] == 64
