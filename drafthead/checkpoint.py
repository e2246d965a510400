"""Head checkpoints: save native folders, load native or exported serving folders, check the target."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from .config import HeadConfig, _text_config

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class HeadMismatchError(ValueError):
    """A head and a target (or an expected head kind) disagree; the message names the differing field."""


def atomic_write_bytes(path: Path, write) -> None:
    """Call write(tmp_path) then rename tmp -> path, so readers never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; checkpoints are meant to be read by others (servers)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(Path(path), lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2) + "\n"))


def check_compatible(config: HeadConfig, target_config: Any, kind: str | None = None) -> None:
    """Refuse a head trained for a different target: hidden size, vocab size, layer count, head kind."""
    cfg = _text_config(target_config)
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


def save_head(head: nn.Module, path: str | Path) -> None:
    """Write `head` as config.json + model.safetensors (borrowed target weights left out)."""
    path = Path(path)
    state = {k: v.detach().contiguous().cpu() for k, v in head.saved_state_dict().items()}
    atomic_write_bytes(path / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    atomic_write_json(path / CONFIG_NAME, {"drafthead_config": head.config.to_dict()})


def stored_dtype(path: str | Path) -> torch.dtype:
    """The floating dtype a head folder's weights are stored in (e.g. to export a bf16 head as bf16)."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / WEIGHTS_NAME), "pt") as f:
        for name in f.keys():
            tensor = f.get_slice(name)
            dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}.get(
                tensor.get_dtype()
            )
            if dtype is not None:
                return dtype
    raise ValueError(f"{Path(path) / WEIGHTS_NAME} holds no floating-point tensor")


def load_head(
    path: str | Path,
    target: nn.Module | None = None,
    kind: str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
):
    """Load a native head folder or an exported serving folder (vLLM/SGLang layout, ours or third-party).

    The format is detected from config.json: our "drafthead_config" key, else the EAGLE serving fields
    (then `target` supplies the target's layer count). With `target`: check compatibility, then attach
    its frozen modules (token embedding; for EAGLE-1 also the final norm and lm_head).
    """
    from .export import native_tensor_names, read_head_config
    from .model import DraftHead

    path = Path(path)
    if not (path / CONFIG_NAME).exists():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {path}: not a draft-head folder")
    if not (path / WEIGHTS_NAME).exists():
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {path}: not a draft-head folder")
    values = json.loads((path / CONFIG_NAME).read_text())
    config = read_head_config(values, target.config if target is not None else None)
    if target is not None:
        check_compatible(config, target.config, kind)
    elif kind is not None and config.kind != kind:
        raise HeadMismatchError(f"head kind: checkpoint is {config.kind!r}, expected {kind!r}")
    head = DraftHead(config)
    state = native_tensor_names(load_file(str(path / WEIGHTS_NAME)))
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens.", "target_norm.", "target_lm_head."))]
    if missing or unexpected:
        raise ValueError(f"{path / WEIGHTS_NAME}: missing tensors {missing}, unexpected tensors {unexpected}")
    head.to(device=device, dtype=dtype)
    if target is not None:
        head.attach_target(target)
    return head
