"""Bad input gets a clear error and leaves nothing half-written, and nothing stale is reused: typed recipes, one-line
command-line errors, local paths taken as paths, generate's arguments checked, a tiny validation split, features
and checkpoints that record what they were made from, and a kernel build that a killed process cannot block."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from conftest import REPO, save_tiny_target
from drafthead import save_head
from drafthead.errors import DataError, PathNotFound, UserError, run_main
from inference.loading import load_causal_lm, resolve_source
from test_prepare import recipe as prepare_recipe
from test_prepare import sharegpt, write_jsonl
from test_trainer import env, make_run, read_log, run_train
from tiny import tiny_head, tiny_model
from train.recipe_help import recipe_main

PY = sys.executable

# one wrong value in each section of a recipe, and what the message must say about it
WRONG = {
    "device=gpu": "recipe key device = 'gpu': expected auto or a device: cpu, cuda, cuda:1, ...",
    "dtype=fp8": "recipe key dtype = 'fp8': expected one of 'auto'",
    "data.max_length=long": "recipe key data.max_length = 'long': expected an integer (>= 2)",
    "data.regenerate.top_p=2": "recipe key data.regenerate.top_p = 2: expected a number (> 0 and <= 1)",
    "features.batch_tokens=-1": "recipe key features.batch_tokens = -1: expected an integer (>= 1)",
    "head.kind=eagle4": "recipe key head.kind = 'eagle4': expected one of 'eagle3', 'eagle1'",
    "head.aux_layer_ids=[1,-2]": "recipe key head.aux_layer_ids = [1, -2]: expected a list of integers or null "
                                 "(each >= 0)",
    "train.lr=abc": "recipe key train.lr = 'abc': expected a number (> 0)",
    "train.max_steps=ten": "recipe key train.max_steps = 'ten': expected an integer or null (>= 0)",
    "train.compile_loss=maybe": "recipe key train.compile_loss = 'maybe': expected true or false",
}


@pytest.fixture
def bare_recipe(tmp_path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "target": str(tmp_path / "target")}))
    return path


@pytest.mark.parametrize("override", WRONG)
def test_a_wrong_value_in_any_section_is_refused_before_any_folder_exists(bare_recipe, capsys, override):
    from train.collect import collect
    from train.prepare import prepare
    from train.trainer import train

    for job in (prepare, collect, train):
        with pytest.raises(SystemExit) as exit:
            recipe_main(job, "doc", [str(bare_recipe), override])
        assert exit.value.code == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {WRONG[override]}"), lines
    assert [p.name for p in bare_recipe.parent.iterdir()] == ["recipe.yaml"]


def test_recipe_errors_are_one_line_and_debug_shows_the_traceback(bare_recipe, capsys):
    def main(argv):
        from train.recipe import load_recipe

        load_recipe(bare_recipe, argv)

    assert run_main(main, ["train.lr=abc"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: {WRONG['train.lr=abc']}"]
    assert run_main(main, ["train.lr=abc", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1] == f"error: {WRONG['train.lr=abc']}"
    assert run_main(main, ["train.lr=1e-4"]) == 0  # YAML 1.1 reads 1e-4 as a string: still a number here


def test_the_training_command_prints_one_line_and_writes_nothing(bare_recipe):
    proc = subprocess.run([PY, "-m", "train", str(bare_recipe), "train.lr=abc"], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: {WRONG['train.lr=abc']}"
    assert "Traceback" not in proc.stderr
    assert [p.name for p in bare_recipe.parent.iterdir()] == ["recipe.yaml"]


def test_generate_names_a_draft_folder_that_does_not_exist(tiny_target_dir):
    proc = subprocess.run([PY, "-m", "inference.generate", "--target", str(tiny_target_dir), "--draft",
                           "/no/such/dir", "--prompt", "hello"], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: draft /no/such/dir: no such folder"
    assert "Traceback" not in proc.stderr


def test_a_local_path_is_a_path_and_a_hub_id_only_where_the_hub_is_allowed(tmp_path, monkeypatch):
    from inference import SpeculativeGenerator

    target = tiny_model("llama")
    for missing in ("/no/such/head", "nosuchhead", "./runs/head", "~/no-such-head"):
        with pytest.raises(PathNotFound, match="no such folder"):
            SpeculativeGenerator.from_pretrained(target, missing)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PathNotFound, match="someone/head: no such folder .*HF_HUB_OFFLINE"):
        SpeculativeGenerator.from_pretrained(target, "someone/head")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PathNotFound, match="not a model folder"):
        SpeculativeGenerator.from_pretrained(target, tmp_path / "empty")
    # `~` is the user's home, for the head and for the target
    save_head(tiny_head(target), tmp_path / "head")
    save_tiny_target(tmp_path / "target")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_source("~/head", "draft") == str(tmp_path / "head")
    model, tokenizer = load_causal_lm("~/target")
    assert model.config.num_hidden_layers == target.config.num_hidden_layers and tokenizer is not None
    monkeypatch.undo()  # (torch's extension folder lies under HOME too: the kernels stay where they were built)
    gen = SpeculativeGenerator.from_pretrained(target, str(tmp_path / "head"), tree="cpu")
    assert gen.head is not None


@pytest.mark.parametrize("arguments, named", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(temperature=math.nan), "temperature"), (dict(temperature=math.inf), "temperature"),
    (dict(temperature=0.7, top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "input_ids"),
    (dict(input_ids=torch.zeros(0, 4, dtype=torch.long)), "input_ids"),
    (dict(input_ids=torch.ones(1, 4)), "input_ids"),
])
def test_generate_refuses_bad_arguments_naming_them(arguments, named):
    from inference import SpeculativeGenerator

    gen = SpeculativeGenerator(tiny_model("llama"), None, tree="none")
    arguments = {"input_ids": torch.tensor([[5, 6, 7]]), **arguments}
    with pytest.raises(ValueError, match=named):
        gen.generate(**arguments)


def test_a_tiny_validation_split_is_announced_and_training_runs_without_it(tmp_path, tiny_target_dir, capsys):
    from train.prepare import is_validation, prepare

    conversations = tmp_path / "five.jsonl"
    write_jsonl(conversations, [sharegpt(f"c{i}_0") for i in range(5)])
    stats = prepare(prepare_recipe(tiny_target_dir, conversations, tmp_path / "prepared", validation_fraction=0.02))
    assert stats["validation_conversations"] == 0
    assert "warning: 0 validation conversations (data.validation_fraction=0.02 of 5): training will run without " \
           "evaluation" in capsys.readouterr().err
    seed = next(s for s in range(100) if is_validation("c0_0", 0.5, s))  # one conversation, drawn for validation
    with pytest.raises(DataError, match="all 1 conversations fell into the validation split: lower "
                                        "data.validation_fraction"):
        prepare(prepare_recipe(tiny_target_dir, conversations, tmp_path / "all-validation", validation_fraction=0.5,
                               seed=seed, max_conversations=1))
    assert not (tmp_path / "all-validation").exists()

    # features with an empty validation split, as train.collect writes them: training goes on without evaluation
    from drafthead.utils import atomic_write_json
    from train.features import FeatureWriter

    recipe = make_run(tmp_path / "run", n_train=8, n_val=2, max_steps=2, eval_every=1, batch_size=2)
    validation = tmp_path / "run" / "features" / "validation"
    header = json.loads((validation / "manifest.json").read_text())
    for shard in validation.glob("shard-*"):
        shard.unlink()
    atomic_write_json(validation / "manifest.json", FeatureWriter(tmp_path / "empty", {
        k: header[k] for k in ("target", "target_config_hash", "aux_layer_ids")}).manifest)
    output = run_train(recipe).stdout
    assert "training without evaluation (raise data.validation_fraction" in output
    assert [r["step"] for r in read_log(tmp_path / "run" / "out")] == [1, 2]
    assert not any("eval_loss" in r for r in read_log(tmp_path / "run" / "out"))


def test_collect_never_keeps_the_features_of_other_data(tmp_path, tiny_target_dir):
    """Re-preparing other conversations into the same run folder, then collecting again: refused, naming what
    changed; the features already there are left as they were."""
    from train.collect import collect
    from train.prepare import prepare

    conversations = tmp_path / "a.jsonl"
    run = {"target": str(tiny_target_dir), "run_dir": str(tmp_path / "run"), "dtype": "float32",
           "data": {"conversations": str(conversations), "max_length": 64, "validation_fraction": 0.25,
                    "num_proc": 1}, "features": {"shard_sequences": 4}}
    write_jsonl(conversations, [sharegpt(f"c{i}_0", reply="the lazy dog " * (i % 3 + 1)) for i in range(12)])
    prepare(run)
    collect(run)
    features = tmp_path / "run" / "features"
    before = {p: p.read_bytes() for p in sorted(features.rglob("*")) if p.is_file()}
    write_jsonl(conversations, [sharegpt(f"c{i}_0", reply="a quick brown fox " * (i % 4 + 1)) for i in range(12)])
    prepare(run)
    with pytest.raises(DataError, match=r"features holds features of other inputs \(data_fingerprint: was '[0-9a-f]+', "
                                        r"now '[0-9a-f]+'\)"):
        collect(run)
    assert {p: p.read_bytes() for p in sorted(features.rglob("*")) if p.is_file()} == before


def test_weights_fingerprint_tells_two_targets_of_one_config_apart(tmp_path):
    from train.fingerprint import weights_fingerprint
    from train.target import target_config_hash

    a, b = save_tiny_target(tmp_path / "a", seed=0), save_tiny_target(tmp_path / "b", seed=1)
    assert target_config_hash(a) == target_config_hash(b)
    assert weights_fingerprint(a) != weights_fingerprint(b)
    assert weights_fingerprint(a) == weights_fingerprint(save_tiny_target(tmp_path / "c", seed=0))


# ----------------------------------------------------------------------------------------------- kernel build
PROBE = """
#include <torch/library.h>
TORCH_LIBRARY(drafthead_probe, m) { m.def("probe(Tensor x) -> Tensor"); }
"""
BUILD = """
import sys
from pathlib import Path
from inference.cpu.kernels import _build
print("built" if _build("drafthead_probe", [Path(sys.argv[1])], [], "probe", timeout=float(sys.argv[2]))
      else "fallback", flush=True)
"""


def build_cmd(source: Path, timeout: float) -> list[str]:
    return [PY, "-c", BUILD, str(source), str(timeout)]


def test_a_kernel_build_killed_half_way_does_not_block_the_next(tmp_path):
    """SIGKILL a process (and its compiler) while it builds; a new process then builds within its time limit; a
    finished build then loads as it is, and is built again if its library went missing.
    (torch's own lock file survives the kill: without our OS lock the next build would wait on it forever.)"""
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE)
    environ = {**env(), "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "MAX_JOBS": "1"}
    proc = subprocess.Popen(build_cmd(source, 60), cwd=REPO, env=environ, stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list((tmp_path / "extensions").glob("drafthead_probe-*/lock")):
        assert proc.poll() is None and time.time() < deadline, "the build never started"
        time.sleep(0.05)
    # the builder first: killed after its compiler, it would see the build fail and clean up, as no kill lets it
    victims = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    for victim in victims:
        try:
            victim.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:  # a compiler step that ended by itself in the meantime
            pass
    psutil.wait_procs(victims, timeout=30)
    proc.wait()
    assert list((tmp_path / "extensions").glob("drafthead_probe-*/lock")), "the killed build left its lock file"
    start = time.time()
    again = subprocess.run(build_cmd(source, 60), cwd=REPO, env=environ, capture_output=True, text=True,
                           timeout=180)
    assert again.stdout.strip() == "built", again.stderr[-2000:]
    assert time.time() - start < 180
    # a finished build is loaded as it is, without torch's ninja (which rebuilds when another ninja binary ran last)
    folder, = (tmp_path / "extensions").glob("drafthead_probe-*")
    (folder / "build.ninja").unlink()
    third = subprocess.run(build_cmd(source, 60), cwd=REPO, env=environ, capture_output=True, text=True, timeout=180)
    assert third.stdout.strip() == "built" and not (folder / "build.ninja").exists(), third.stderr[-2000:]
    (folder / "drafthead_probe.so").unlink()  # a library gone since: built again
    fourth = subprocess.run(build_cmd(source, 60), cwd=REPO, env=environ, capture_output=True, text=True,
                            timeout=180)
    assert fourth.stdout.strip() == "built" and (folder / "drafthead_probe.so").exists(), fourth.stderr[-2000:]


def test_a_build_held_by_another_process_falls_back_after_the_time_limit(tmp_path, capsys, monkeypatch):
    from inference.cpu.kernels import _build, build_folder, build_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE)
    with build_lock(build_folder("drafthead_probe", [source], []), timeout=0):  # another build under way
        start = time.monotonic()
        assert _build("drafthead_probe", [source], [], "probe", timeout=1.0) is False
        assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert err.splitlines() == [f"[drafthead] probe kernels not used (building probe.cpp failed: another process "
                                f"has been building in {build_folder('drafthead_probe', [source], [])} for over 1 s)"]


def test_run_main_leaves_internal_errors_alone():
    def main(argv):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        run_main(main, [])
    assert issubclass(PathNotFound, FileNotFoundError) and issubclass(DataError, ValueError)
    assert issubclass(PathNotFound, UserError)
