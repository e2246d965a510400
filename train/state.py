"""Checkpoints of a training run: a loadable head folder plus the full training state, published atomically.

    output_dir/checkpoint-<step>/
        config.json, model.safetensors     the head (drafthead.load_head loads it)
        trainer_state.json                 step, data position (epoch + global micro-batches consumed), world
                                           size, engine, learning rate
        training_state/                    accelerator.save_state: model + optimizer (a DeepSpeed checkpoint
                                           under DeepSpeed, every rank's ZeRO shard) and the RNG state of
                                           EVERY rank (random_states_<rank>.pkl)
    output_dir/final/                      the last head (plain head folder)

Everything is written into `.tmp-<name>` and renamed by rank 0 after all ranks finished, so a folder named
checkpoint-<step> is always complete. The learning-rate schedule is a pure function of the step, so the
step in trainer_state.json is the scheduler's whole state; the data order is a pure function of
(seed, epoch), and the position in it is counted in global micro-batches (train.loader), so a run may resume with
another number of processes.
"""

from __future__ import annotations

import contextlib
import json
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


def load_checkpoint(accelerator: Accelerator, path: str | Path, model: torch.nn.Module) -> dict:
    """Restore model, optimizer and RNG from `path` (written by this or another number of processes); returns its
    trainer_state. `model` is the prepared (engine-wrapped) model: DeepSpeed and non-DeepSpeed states do not mix.

    Same world size: everything, every rank's RNG included. Another world size: DDP / one process restore the model
    and the optimizer (both whole in every rank's copy; ranks beyond the saved ones keep their seeded RNG);
    DeepSpeed ZeRO 0-2 goes through a universal checkpoint (train.zero_resize); ZeRO-3 is refused.
    """
    path = Path(path)
    state = json.loads((path / TRAINER_STATE).read_text())
    engine = type(model).__name__
    saved_engine = state.get("engine", engine)
    if (saved_engine == "DeepSpeedEngine") != (engine == "DeepSpeedEngine"):
        raise RuntimeError(f"{path} was written by engine {saved_engine}, this run uses {engine}: resume with the "
                           "same kind of engine (DeepSpeed, or DDP / one process without DeepSpeed)")
    if state["world_size"] == accelerator.num_processes or engine != "DeepSpeedEngine":
        accelerator.load_state(str(path / STATE_DIR))
    else:
        from train.zero_resize import load_resized

        load_resized(accelerator, model, path / STATE_DIR, state["world_size"])
    if state["world_size"] != accelerator.num_processes:
        accelerator.print(f"[train] {path} was written by {state['world_size']} processes, this run has "
                          f"{accelerator.num_processes}: the rest of the epoch is re-dealt to this run's ranks")
    return state


def clean_partial(accelerator: Accelerator, output_dir: str | Path) -> None:
    """Remove `.tmp-*` folders a killed run left behind (rank 0), then sync."""
    if accelerator.is_main_process:
        for tmp in Path(output_dir).glob(".tmp-*"):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
