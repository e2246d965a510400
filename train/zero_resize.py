"""Resume a DeepSpeed ZeRO 1/2 checkpoint with another number of processes.

DeepSpeed writes the optimizer state of ZeRO 1/2 in per-rank partitions and its loader refuses a checkpoint of
another data-parallel size. Its documented way across sizes is a universal checkpoint: `ds_to_universal` rewrites
the partitions as one fp32 tensor and Adam moments per parameter, and an engine with load_universal_checkpoint set
re-partitions them for its own ranks. Rank 0 converts once (kept beside the DeepSpeed checkpoint as
<tag>_universal), then every rank loads: weights, fp32 master weights and optimizer moments are restored.
ZeRO-0 keeps the whole optimizer in every rank's copy and loads directly. ZeRO-3 is refused.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from accelerate import Accelerator

TAG = "pytorch_model"  # accelerate's name for the DeepSpeed checkpoint of the first model


def to_universal(checkpoint: Path, out: Path) -> None:
    """Convert the DeepSpeed checkpoint folder `checkpoint` (one tag) into a universal checkpoint at `out`."""
    from deepspeed.checkpoint.ds_to_universal import main

    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    main(argparse.Namespace(input_folder=str(checkpoint), output_folder=str(tmp), num_extract_workers=1,
                            num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
    tmp.rename(out)


def load_resized(accelerator: Accelerator, engine, state_dir: Path, saved_world_size: int) -> None:
    """Load the DeepSpeed checkpoint in `state_dir` (written by `saved_world_size` ranks) into `engine`, a
    DeepSpeedEngine of another world size. Collective."""
    stage = engine.zero_optimization_stage()
    if stage == 3:
        raise RuntimeError(f"{state_dir} is a ZeRO-3 checkpoint of {saved_world_size} processes: ZeRO-3 resumes only "
                           f"with the same number of processes (this run has {accelerator.num_processes})")
    if stage == 0:
        accelerator.load_state(str(state_dir))
        return
    universal = state_dir / f"{TAG}_universal"
    if accelerator.is_main_process and not universal.is_dir():
        to_universal(state_dir / TAG, universal)
    accelerator.wait_for_everyone()
    engine._config.load_universal_checkpoint = True  # DeepSpeed reads this config flag only, at load time
    try:
        engine.load_checkpoint(str(state_dir), tag=universal.name)
    finally:
        engine._config.load_universal_checkpoint = False
