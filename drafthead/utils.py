"""Generic helpers shared by every package: atomic file writes, the asset cache folder, dtype names.

A leaf module but for drafthead.paths (cache_dir lives there, free of torch, for bootstrap scripts).
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from .paths import cache_dir

__all__ = ["DTYPES", "MIXED_PRECISION", "SAFETENSORS_DTYPES", "atomic_save_safetensors", "atomic_write_bytes",
           "atomic_write_json", "atomic_write_text", "cache_argument", "cache_dir", "dtype_name", "mixed_precision",
           "parse_dtype"]

# ------------------------------------------------------------------------------------------------ files


def atomic_write_bytes(path: str | Path, write: Callable[[str], Any]) -> None:
    """Call write(tmp_path) then rename tmp -> path, so readers never see a half-written file."""
    path = Path(path)
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


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` (UTF-8) atomically."""
    atomic_write_bytes(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """Write `obj` as indented JSON atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def atomic_save_safetensors(path: str | Path, tensors: dict[str, torch.Tensor],
                            metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (detached, contiguous, moved to CPU here) as a safetensors file, atomically."""
    state = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    atomic_write_bytes(path, lambda tmp: save_file(state, tmp, metadata=metadata))


# ------------------------------------------------------------------------------------------------ dtypes

DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
MIXED_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "no"}  # dtype name -> accelerate's name


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype name ('bfloat16', 'bf16', 'fp32', ...), a torch dtype, or None (kept) -> torch dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    return DTYPES[name]


def rotary_frequencies(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's rotary-embedding frequency buffers (names ending in `inv_freq`), by name. transformers builds
    them in float32 whatever dtype it loads a model in, and its rotary embedding computes the angles in float32."""
    return {name: buffer for name, buffer in module.named_buffers() if name.endswith("inv_freq")}


def place_module(module: torch.nn.Module, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> torch.nn.Module:
    """module.to(device, dtype), except that rotary-embedding frequency buffers keep their own dtype. `Module.to(bf16)`
    would round them, shifting every rotary angle by up to ~0.4 % (whole turns at 8k positions): the model would no
    longer be the one `from_pretrained(..., dtype=bf16)` returns, nor a head the one its training computed (the
    trainer's DeepSpeed bf16 mode casts parameters only). Returns the module."""
    frequencies = rotary_frequencies(module)
    module.to(device=device, dtype=dtype)
    for name, buffer in frequencies.items():
        path, _, attribute = name.rpartition(".")
        owner = module.get_submodule(path)
        setattr(owner, attribute, buffer.to(getattr(owner, attribute).device))
    return module


def cache_argument(module: torch.nn.Module | type) -> str:
    """The keyword a transformers module's forward takes its KV cache by: `cache` where the installed release has
    it (it renamed `past_key_values`, warns about the old name and removes it in 5.40), `past_key_values` before.
    Resolve it once, outside compiled code: `model(..., **{runner.cache_argument: cache})`."""
    forward = (module if isinstance(module, type) else type(module)).forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype -> its name without the module, e.g. 'bfloat16' (what configs and manifests record)."""
    return str(dtype).removeprefix("torch.")


def mixed_precision(name: str) -> str:
    """A precision name ('bf16', 'fp32', 'no', ...) -> accelerate's mixed_precision ('bf16', 'fp16', 'no')."""
    if str(name).lower() == "no":
        return "no"
    return MIXED_PRECISION[dtype_name(parse_dtype(name))]
