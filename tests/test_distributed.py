"""Real 2-process DeepSpeed / DDP training on CPU (accelerate launch, gloo): ranks synchronise and agree on the draft
vocabulary, resume is exact, and a run resumes with another number of processes without repeating or skipping data."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from test_trainer import REPO, check_eval_tau, env, head_tensors, make_run, read_log

ACCELERATE = str(Path(sys.executable).parent / "accelerate")


def launch_cmd(recipe: Path, stage: int, *overrides: str, processes: int = 2) -> list[str]:
    return [ACCELERATE, "launch", "--config_file", f"configs/accelerate/cpu_zero{stage}.yaml", "--num_processes",
            str(processes), "-m", "train", str(recipe), *overrides]


def ddp_cmd(recipe: Path, *overrides: str, processes: int = 2) -> list[str]:
    """DDP on CPU (gloo); one process is a plain run."""
    if processes == 1:
        return [sys.executable, "-m", "train", str(recipe), *overrides]
    return ["env", "ACCELERATE_USE_CPU=true", ACCELERATE, "launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "train", str(recipe),
            *overrides]


def run_cmd(cmd: list[str], timeout: int = 300) -> str:
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def launch(recipe: Path, stage: int, *overrides: str, timeout: int = 300, processes: int = 2) -> str:
    return run_cmd(launch_cmd(recipe, stage, *overrides, processes=processes), timeout)


# One 2-process ZeRO-2 run serves two tests: the synchronisation checks and the uninterrupted reference of the
# SIGKILL resume (which launches the same recipe in another folder).
ZERO2_RUN = dict(n_train=16, n_val=8, max_steps=12, save_every=6, eval_every=2, batch_size=2, debug_report=True)


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory) -> tuple[Path, str]:
    """(run folder, launcher output) of the uninterrupted 12-step fp32 ZeRO-2 run."""
    folder = tmp_path_factory.mktemp("zero2")
    return folder, launch(make_run(folder, **ZERO2_RUN), 2)


def check_synchronised(output: str, out: Path, stage: int, steps: int) -> None:
    """The ranks of a finished run trained on different sequences, yet hold the same parameters (every one
    updated), the same draft vocabulary and float32 RoPE; rank 0 saved those parameters."""
    assert f"engine=DeepSpeedEngine zero_stage={stage} world_size=2" in output
    ranks = [json.loads((out / "ranks" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["engine"] for r in ranks] == ["DeepSpeedEngine"] * 2
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"]) == steps
    for a, b in zip(ranks[0]["seen"], ranks[1]["seen"]):  # (a run of several epochs sees a sequence again later)
        assert a and b and not set(a) & set(b), "at each step the ranks must train on different sequences"
    # Different data, yet identical parameters after the steps: the gradients were averaged.
    assert ranks[0]["param_sums"] == ranks[1]["param_sums"]
    assert ranks[0]["initial_param_sums"] == ranks[1]["initial_param_sums"]
    assert ranks[0]["d2t_checksum"] is not None and ranks[0]["d2t_checksum"] == ranks[1]["d2t_checksum"]
    # the head trains with float32 RoPE frequencies, as the engine runs it (DeepSpeed's bf16 mode casts parameters only)
    assert ranks[0]["rotary_dtypes"] and set(ranks[0]["rotary_dtypes"].values()) == {"torch.float32"}
    moved = [n for n, v in ranks[0]["param_sums"].items() if v != ranks[0]["initial_param_sums"][n]]
    assert len(moved) == len(ranks[0]["param_sums"]), "every trainable tensor must have been updated"
    # The head rank 0 saved is those parameters.
    final = head_tensors(out / "final")
    for name, value in ranks[0]["param_sums"].items():
        assert abs(float(final[name].double().sum()) - value) <= 1e-3 * max(1.0, abs(value)), name
    log = read_log(out)
    assert [r["step"] for r in log] == list(range(1, steps + 1))
    check_eval_tau(log[-1], ttt_steps=3)


@pytest.mark.slow
def test_ranks_synchronise_zero2_fp32(zero2_run):
    folder, output = zero2_run
    check_synchronised(output, folder / "out", stage=2, steps=ZERO2_RUN["max_steps"])


@pytest.mark.slow
def test_ranks_synchronise_zero3_bf16(tmp_path):
    recipe = make_run(tmp_path, n_train=16, n_val=8, max_steps=3, save_every=100, eval_every=3,
                      mixed_precision="bf16", debug_report=True)
    check_synchronised(launch(recipe, 3), tmp_path / "out", stage=3, steps=3)


def _wait_then_kill(proc: subprocess.Popen, log: Path, step: int, timeout: float = 240) -> int:
    """SIGKILL the whole launch (launcher, agent and every rank) once log.jsonl reports `step`; returns the last logged step."""
    deadline = time.time() + timeout
    last = 0
    try:
        while last < step:
            assert proc.poll() is None, f"the run ended (exit {proc.returncode}) at step {last}, before step {step}"
            assert time.time() < deadline, f"the run stalled: no step {step} after {timeout:.0f} s (log at {last})"
            if log.exists():
                lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
                last = json.loads(lines[-1])["step"] if lines else 0
            time.sleep(0.01)
    finally:
        tree = psutil.Process(proc.pid)
        victims = tree.children(recursive=True) + [tree]  # torchrun's workers are not in the launcher's group
        for victim in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.send_signal(signal.SIGKILL)
        proc.wait()
        psutil.wait_procs(victims, timeout=30)
    return last


@pytest.mark.slow
def test_exact_resume_after_sigkill(tmp_path, zero2_run):
    """The ZeRO-2 run SIGKILLed (launcher, agent and ranks) after step 8, then launched again: it resumes from
    checkpoint-6 and ends with the uninterrupted run's weights and the same loss, accuracy, lr and eval per step."""
    straight, _ = zero2_run
    killed = make_run(tmp_path / "b", **ZERO2_RUN)
    proc = subprocess.Popen(launch_cmd(killed, 2), cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    last = _wait_then_kill(proc, tmp_path / "b" / "out" / "log.jsonl", 8)
    out_b = tmp_path / "b" / "out"
    assert 8 <= last < 12, f"the kill must land in steps 7-12, log reached {last}"
    assert (out_b / "checkpoint-6" / "trainer_state.json").exists()
    assert not (out_b / "final").exists()

    output = launch(killed, 2)  # the same command again: resumes from checkpoint-6
    assert "resumed from" in output and "checkpoint-6 at step 6" in output

    a, b = head_tensors(straight / "out" / "final"), head_tensors(out_b / "final")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)
    log_a, log_b = read_log(straight / "out"), read_log(out_b)
    assert [r["step"] for r in log_b] == list(range(1, 13))
    for ra, rb in zip(log_a, log_b):
        for key in ("loss", "acc_0", "lr") + (("eval_loss", "eval_tau", "eval_acc_1") if "eval_tau" in ra else ()):
            assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-7), (ra["step"], key)


VOCAB_SCRIPT = """
import json, sys
sys.path.insert(0, "tests")
from tiny import tiny_head, tiny_model
from train.rank_sync import check_same_on_ranks, checksum, share_draft_vocab
from train.recipe import TrainSection
from train.trainer import make_accelerator

acc = make_accelerator(TrainSection(mixed_precision="fp32"))
rank = acc.process_index
head = tiny_head(tiny_model("llama"), seed=rank)  # each rank builds ANOTHER random draft vocabulary
before = checksum(head.d2t)
share_draft_vocab(acc, head)  # rank 0's, then checked
result = {"before": before, "after": checksum(head.d2t), "t2d": checksum(head.t2d)}
try:
    check_same_on_ranks(acc, {"d2t": head.d2t + rank}, "the draft vocabulary")  # made to disagree on rank 1
    result["refused"] = None
except RuntimeError as err:
    result["refused"] = str(err)
with open(f"{sys.argv[1]}/rank-{rank}.json", "w") as f:
    f.write(json.dumps(result))
acc.wait_for_everyone()
acc.end_training()
"""


@pytest.mark.slow
def test_draft_vocab_shared_and_checked(tmp_path):
    """2 ranks with different draft vocabularies end with rank 0's; a d2t that differs on rank 1 is refused, naming it."""
    script = tmp_path / "vocab.py"
    script.write_text(VOCAB_SCRIPT)
    run_cmd([ACCELERATE, "launch", "--config_file", "configs/accelerate/cpu_zero0.yaml", str(script), str(tmp_path)],
            timeout=180)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["before"] != ranks[1]["before"], "the ranks must start from different vocabularies"
    assert ranks[1]["after"] == ranks[0]["after"] == ranks[0]["before"] and ranks[0]["t2d"] == ranks[1]["t2d"]
    for r in ranks:
        assert r["refused"] and "rank(s) [1]" in r["refused"] and "draft vocabulary" in r["refused"]


def _global_order(output_dir: Path, world: int) -> list[list[int]]:
    """The micro-batches the ranks of one run read, in global order (dealt round-robin: step-major, then rank)."""
    seen = [json.loads((output_dir / "ranks" / f"rank-{r}.json").read_text())["seen"] for r in range(world)]
    assert len({len(s) for s in seen}) == 1
    return [seen[r][m] for m in range(len(seen[0])) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("engine,first,second", [("zero2", 2, 1), ("zero2", 1, 2), ("ddp", 2, 1)])
def test_resume_with_another_world_size(tmp_path, engine, first, second):
    """k steps with `first` processes, the rest with `second`: together the runs read the first 12 global
    micro-batches of the epoch in the uninterrupted order, none twice or left out; the weights (and under
    DeepSpeed, via a universal checkpoint, the optimizer moments) carry over."""
    from train.batches import epoch_batches
    from train.features import FeatureDataset

    steps1 = {2: 3, 1: 4}[first]  # global micro-batches after run 1: 6 or 4; run 2 reads the rest of the 12
    total = steps1 + (12 - steps1 * first) // second
    recipe = make_run(tmp_path, n_train=32, n_val=8, max_steps=steps1, save_every=100, eval_every=100, batch_size=2,
                      debug_report=True, log_every=2)
    cmd = (lambda *o, processes: launch_cmd(recipe, 2, *o, processes=processes)) if engine == "zero2" else \
        (lambda *o, processes: ddp_cmd(recipe, *o, processes=processes))
    out = tmp_path / "out"
    run_cmd(cmd(processes=first))
    order = _global_order(out, first)
    checkpoint = head_tensors(out / f"checkpoint-{steps1}")
    shutil.rmtree(out / "ranks")
    output = run_cmd(cmd(f"train.max_steps={total}", processes=second))
    assert f"written by {first} processes, this run has {second}" in output
    order += _global_order(out, second)
    expected = epoch_batches(FeatureDataset(tmp_path / "features").lengths(), 0, 0, batch_size=2, max_length=64)
    assert order == expected[:12]
    resumed = json.loads((out / "ranks" / "rank-0.json").read_text())["initial_param_sums"]
    for name, value in resumed.items():  # the run started from the checkpoint's weights
        assert abs(float(checkpoint[name].double().sum()) - value) <= 1e-4 * max(1.0, abs(value)), name
    if engine == "zero2":
        moments = list((out / f"checkpoint-{steps1}" / "training_state").glob("*_universal/zero/*/exp_avg.pt"))
        assert moments and any(torch.load(m, weights_only=False)["param"].abs().sum() > 0 for m in moments)
