"""Load a frozen target causal LM and its tokenizer from a local folder, on a given device and dtype."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from drafthead.errors import PathNotFound
from drafthead.hardware import resolve_device, resolve_dtype


def _check_folder(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not (path / "config.json").exists():
        raise PathNotFound(
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
    """A frozen causal LM in eval mode on `device` in `dtype` (no gradients). device 'auto': CUDA when present,
    else the CPU; dtype 'auto' (or None): bf16 where the device computes it natively (CUDA, CPUs with
    AVX512-BF16/AMX), else float32."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
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


def load_borrowed(path: str | Path, dtype: str | torch.dtype = "float32") -> Any:
    """The target with ONLY the modules a head borrows loaded (token embedding, final norm, output layer), on the
    CPU; every decoder layer stays on the meta device and costs no memory. What offline training needs: a rank
    no longer holds the whole target to train a head on stored features. Falls back to load_target (with a line
    saying so) where the checkpoint's tensor names do not match the model's own."""
    import json

    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = _check_folder(path)
    dtype = resolve_dtype(dtype, "cpu")
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)), dtype=dtype)
    borrowed = [model.get_input_embeddings(), model.get_decoder().norm, model.get_output_embeddings()]
    names = {id(module): name for name, module in model.named_modules()}
    wanted = {f"{names[id(m)]}.{p}" for m in borrowed for p, _ in m.named_parameters()}
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
        ["model.safetensors"]
    state = {}
    for file in files:
        with safe_open(str(folder / file), "pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys() if k in wanted})
    head_weight = f"{names[id(borrowed[2])]}.weight"
    tied = head_weight not in state and bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    missing = wanted - set(state) - ({head_weight} if tied else set())
    if missing:
        print(f"[train] {folder}: tensors {sorted(missing)} not found by name; loading the whole target")
        return load_target(folder, "cpu", dtype)
    for module in borrowed:
        module.to_empty(device="cpu")
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    model.eval().requires_grad_(False)
    return model
