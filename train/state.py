"""Checkpoints of a training run: a loadable head folder plus the full training state, published atomically.

    output_dir/checkpoint-<step>/
        config.json, model.safetensors     the head (drafthead.load_head loads it)
        trainer_state.json                 step, epoch, micro-batch position, world size, learning rate
        training_state/                    accelerator.save_state: model + optimizer (a DeepSpeed checkpoint
                                           under DeepSpeed, every rank's ZeRO shard) and the RNG state of
                                           EVERY rank (random_states_<rank>.pkl)
    output_dir/final/                      the last head (plain head folder)

Everything is written into `.tmp-<name>` and renamed by rank 0 after all ranks finished, so a folder named
checkpoint-<step> is always complete. The learning-rate schedule is a pure function of the step, so the
step in trainer_state.json is the scheduler's whole state; the data order is a pure function of
(seed, epoch), so the step also fixes the data position.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator

from drafthead.checkpoint import save_head
from drafthead.utils import atomic_write_json

STATE_DIR = "training_state"
TRAINER_STATE = "trainer_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = []
    for path in Path(output_dir).glob("checkpoint-*"):
        match = _CHECKPOINT.match(path.name)
        if match and (path / TRAINER_STATE).exists():
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None


def gathered_params(model: torch.nn.Module):
    """Context in which every rank holds the full parameters (ZeRO-3 gathers them; otherwise a no-op)."""
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _publish(accelerator: Accelerator, tmp: Path, final: Path) -> None:
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    accelerator.wait_for_everyone()


def _fresh_tmp(accelerator: Accelerator, tmp: Path) -> None:
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()


def save_head_folder(accelerator: Accelerator, head: torch.nn.Module, path: str | Path) -> None:
    """Write `head` (the unwrapped DraftHead) as a plain head folder, atomically. Collective: call on every rank."""
    path = Path(path)
    tmp = path.parent / f".tmp-{path.name}"
    _fresh_tmp(accelerator, tmp)
    with gathered_params(head):
        if accelerator.is_main_process:
            save_head(head, tmp)
    _publish(accelerator, tmp, path)


def save_checkpoint(accelerator: Accelerator, head: torch.nn.Module, output_dir: str | Path, step: int,
                    trainer_state: dict, keep: int | None = None) -> Path:
    """Write output_dir/checkpoint-<step> (head folder + training state). Collective: call on every rank."""
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}"
    _fresh_tmp(accelerator, tmp)
    accelerator.save_state(str(tmp / STATE_DIR))
    with gathered_params(head):
        if accelerator.is_main_process:
            save_head(head, tmp)
    if accelerator.is_main_process:
        atomic_write_json(tmp / TRAINER_STATE, {**trainer_state, "step": step,
                                                "world_size": accelerator.num_processes})
    _publish(accelerator, tmp, final)
    if keep and accelerator.is_main_process:
        done = sorted((int(_CHECKPOINT.match(p.name).group(1)), p) for p in output_dir.glob("checkpoint-*")
                      if _CHECKPOINT.match(p.name))
        for _, old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Accelerator, path: str | Path) -> dict:
    """Restore model, optimizer and every rank's RNG from `path`; returns its trainer_state."""
    import json

    path = Path(path)
    state = json.loads((path / TRAINER_STATE).read_text())
    if state["world_size"] != accelerator.num_processes:
        raise RuntimeError(
            f"{path} was written by {state['world_size']} processes, this run has {accelerator.num_processes}: "
            "exact resume needs the same world size (start a new output_dir to change it)"
        )
    accelerator.load_state(str(path / STATE_DIR))
    return state


def clean_partial(accelerator: Accelerator, output_dir: str | Path) -> None:
    """Remove `.tmp-*` folders a killed run left behind (rank 0), then sync."""
    if accelerator.is_main_process:
        for tmp in Path(output_dir).glob(".tmp-*"):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
