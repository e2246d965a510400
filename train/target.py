"""Load a frozen target causal LM and its tokenizer from a local folder, on a given device and dtype."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from drafthead.hardware import resolve_dtype


def _check_folder(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"target {path} has no config.json: give a local Hugging Face model folder "
            "(`python scripts/fetch_assets.py` fetches the default one)"
        )
    return path


def load_tokenizer(path: str | Path) -> Any:
    """The target's tokenizer (with its own chat template); pad token set to eos when it has none."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(_check_folder(path)))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_target(path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = "auto") -> Any:
    """A frozen causal LM in eval mode on `device` in `dtype` (no gradients). dtype 'auto' (or None): bf16 where
    the device computes it natively (CUDA, CPUs with AVX512-BF16/AMX), else float32."""
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(dtype, device)
    model = AutoModelForCausalLM.from_pretrained(str(_check_folder(path)), dtype=dtype)
    model.to(torch.device(device)).eval()
    model.requires_grad_(False)
    return model


def target_name(path: str | Path) -> str:
    """A human-readable target name: the folder name."""
    return Path(path).expanduser().resolve().name


def target_config_hash(path: str | Path) -> str:
    """train.features.config_hash of the target's config AS SAVED (independent of the dtype it is loaded in)."""
    from transformers import AutoConfig

    from train.features import config_hash

    return config_hash(AutoConfig.from_pretrained(str(_check_folder(path))))
