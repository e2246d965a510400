"""Real 2-process DeepSpeed training on CPU (accelerate launch, gloo): ranks synchronise, and resume is exact."""

from __future__ import annotations

import contextlib
import json
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


def launch_cmd(recipe: Path, stage: int, *overrides: str) -> list[str]:
    return [ACCELERATE, "launch", "--config_file", f"configs/accelerate/cpu_zero{stage}.yaml", "-m", "train",
            str(recipe), *overrides]


def launch(recipe: Path, stage: int, *overrides: str, timeout: int = 300) -> str:
    proc = subprocess.run(launch_cmd(recipe, stage, *overrides), cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("stage,precision", [(2, "fp32"), (3, "bf16")])
def test_ranks_synchronise(tmp_path, stage, precision):
    recipe = make_run(tmp_path, n_train=16, n_val=8, max_steps=3, save_every=100, eval_every=3,
                      mixed_precision=precision, debug_report=True)
    output = launch(recipe, stage)
    assert f"engine=DeepSpeedEngine zero_stage={stage} world_size=2" in output
    out = tmp_path / "out"
    ranks = [json.loads((out / "ranks" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["engine"] for r in ranks] == ["DeepSpeedEngine"] * 2
    assert [r["world_size"] for r in ranks] == [2, 2]
    seen = [{i for batch in r["seen"] for i in batch} for r in ranks]
    assert seen[0] and seen[1] and not seen[0] & seen[1], "ranks must train on different sequences"
    # Different data, yet identical parameters after the steps: the gradients were averaged.
    assert ranks[0]["param_sums"] == ranks[1]["param_sums"]
    assert ranks[0]["initial_param_sums"] == ranks[1]["initial_param_sums"]
    moved = [n for n, v in ranks[0]["param_sums"].items() if v != ranks[0]["initial_param_sums"][n]]
    assert len(moved) == len(ranks[0]["param_sums"]), "every trainable tensor must have been updated"
    # The head rank 0 saved is those parameters.
    final = head_tensors(out / "final")
    for name, value in ranks[0]["param_sums"].items():
        assert abs(float(final[name].double().sum()) - value) <= 1e-3 * max(1.0, abs(value)), name
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2, 3]
    check_eval_tau(log[-1], ttt_steps=3)


def _wait_then_kill(proc: subprocess.Popen, log: Path, step: int, timeout: float = 240) -> int:
    """SIGKILL the whole launch (launcher, agent and every rank) once log.jsonl reports `step`; returns the last logged step."""
    deadline = time.time() + timeout
    last = 0
    while time.time() < deadline and proc.poll() is None:
        if log.exists():
            lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
            last = json.loads(lines[-1])["step"] if lines else 0
            if last >= step:
                break
        time.sleep(0.01)
    tree = psutil.Process(proc.pid)
    victims = tree.children(recursive=True) + [tree]  # torchrun's workers are not in the launcher's group
    for victim in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.send_signal(signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(victims, timeout=30)
    return last


@pytest.mark.slow
def test_exact_resume_after_sigkill(tmp_path):
    common = dict(n_train=16, n_val=8, max_steps=20, save_every=10, eval_every=2, batch_size=2)
    straight = make_run(tmp_path / "a", **common)
    launch(straight, 2)
    killed = make_run(tmp_path / "b", **common)
    proc = subprocess.Popen(launch_cmd(killed, 2), cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    last = _wait_then_kill(proc, tmp_path / "b" / "out" / "log.jsonl", 12)
    out_b = tmp_path / "b" / "out"
    assert 12 <= last < 20, f"the kill must land in steps 11-20, log reached {last}"
    assert (out_b / "checkpoint-10" / "trainer_state.json").exists()
    assert not (out_b / "final").exists()

    output = launch(killed, 2)  # the same command again: resumes from checkpoint-10
    assert "resumed from" in output and "checkpoint-10 at step 10" in output

    a, b = head_tensors(tmp_path / "a" / "out" / "final"), head_tensors(out_b / "final")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)
    log_a, log_b = read_log(tmp_path / "a" / "out"), read_log(out_b)
    assert [r["step"] for r in log_b] == list(range(1, 21))
    for ra, rb in zip(log_a, log_b):
        for key in ("loss", "acc_0", "lr") + (("eval_loss", "eval_tau", "eval_acc_1") if "eval_tau" in ra else ()):
            assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-7), (ra["step"], key)
