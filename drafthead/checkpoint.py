"""Head checkpoints: save native folders, load native or exported serving folders, check the target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file

from .config import HeadConfig
from .format import CONFIG_NAME, FROZEN_PREFIXES, NATIVE_KEY, WEIGHTS_METADATA, WEIGHTS_NAME, native_tensor_names, \
    text_config
from .errors import HeadMismatchError, PathNotFound
from .model import DraftHead
from .utils import SAFETENSORS_DTYPES, atomic_save_safetensors, atomic_write_json, place_module


def check_compatible(config: HeadConfig, target_config: Any, kind: str | None = None) -> None:
    """Refuse a head trained for a different target: hidden size, vocab size, layer count, head kind."""
    cfg = text_config(target_config)
    problems = []
    if kind is not None and config.kind != kind:
        problems.append(f"head kind: checkpoint is {config.kind!r}, expected {kind!r}")
    if config.target_hidden_size != cfg.hidden_size:
        problems.append(f"hidden_size: head expects {config.target_hidden_size}, target has {cfg.hidden_size}")
    if config.vocab_size != cfg.vocab_size:
        problems.append(f"vocab_size: head expects {config.vocab_size}, target has {cfg.vocab_size}")
    if config.target_num_layers != cfg.num_hidden_layers:
        problems.append(
            f"num_hidden_layers: head was trained on a {config.target_num_layers}-layer target, "
            f"target has {cfg.num_hidden_layers}"
        )
    if max(config.aux_layer_ids) >= cfg.num_hidden_layers:
        problems.append(f"aux_layer_ids {config.aux_layer_ids} not covered by {cfg.num_hidden_layers} target layers")
    if problems:
        raise HeadMismatchError("draft head does not match the target: " + "; ".join(problems))


def write_head_folder(path: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Write a head folder: `tensors` as model.safetensors and `config` as config.json, each atomically."""
    path = Path(path)
    atomic_save_safetensors(path / WEIGHTS_NAME, tensors, metadata=WEIGHTS_METADATA)
    atomic_write_json(path / CONFIG_NAME, config)


def save_head(head: DraftHead, path: str | Path) -> None:
    """Write `head` as a native folder: config.json + model.safetensors (borrowed target weights left out)."""
    write_head_folder(path, head.saved_state_dict(), {NATIVE_KEY: head.config.to_dict()})


def stored_dtype(path: str | Path) -> torch.dtype:
    """The floating dtype a head folder's weights are stored in (e.g. to export a bf16 head as bf16)."""
    with safe_open(str(Path(path) / WEIGHTS_NAME), "pt") as f:
        for name in f.keys():
            dtype = SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
            if dtype is not None:
                return dtype
    raise ValueError(f"{Path(path) / WEIGHTS_NAME} holds no floating-point tensor")


def load_head(
    path: str | Path,
    target: nn.Module | None = None,
    kind: str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> DraftHead:
    """Load a native head folder or an exported serving folder (vLLM/SGLang layout, ours or third-party).

    The format is detected from config.json: our NATIVE_KEY, else the EAGLE serving fields
    (then `target` supplies the target's layer count). With `target`: check compatibility, then attach
    its frozen modules (token embedding; for EAGLE-1 also the final norm and lm_head).
    """
    path = Path(path)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (path / name).exists():
            raise PathNotFound(f"no {name} in {path}: not a draft-head folder")
    values = json.loads((path / CONFIG_NAME).read_text())
    config = HeadConfig.from_folder_config(values, target.config if target is not None else None)
    if target is not None:
        check_compatible(config, target.config, kind)
    elif kind is not None and config.kind != kind:
        raise HeadMismatchError(f"head kind: checkpoint is {config.kind!r}, expected {kind!r}")
    head = DraftHead(config)
    state = native_tensor_names(load_file(str(path / WEIGHTS_NAME)))
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(FROZEN_PREFIXES)]
    if missing or unexpected:
        raise ValueError(f"{path / WEIGHTS_NAME}: missing tensors {missing}, unexpected tensors {unexpected}")
    place_module(head, device, dtype)
    if target is not None:
        head.attach_target(target)
    return head
