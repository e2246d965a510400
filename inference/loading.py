"""Loading Hugging Face causal LMs for the engine: a folder or Hub id, or a model already in memory."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from drafthead.errors import PathNotFound

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # namespace/name


def resolve_source(source: str | Path, what: str) -> str:
    """A model reference as transformers should load it. A local path stays a local path (`~` expanded) and must
    exist; a `namespace/name` that is no local folder is a Hub id, tried only where the Hub is allowed (said on
    stderr). Raises PathNotFound naming `what` otherwise."""
    text = str(source)
    path = Path(text).expanduser()
    if path.exists():
        if not (path.is_file() and path.suffix == ".gguf") and not (path / "config.json").exists():
            raise PathNotFound(f"{what} {path}: not a model folder (no config.json)")
        return str(path)
    if isinstance(source, Path) or not _HUB_ID.fullmatch(text) or text.startswith((".", "~")):
        raise PathNotFound(f"{what} {path}: no such folder")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "false", "no", ""):
        raise PathNotFound(f"{what} {text}: no such folder (and not looked up on the Hugging Face Hub: "
                           "HF_HUB_OFFLINE is set)")
    print(f"[drafthead] {what} {text}: no local folder of that name, loading it from the Hugging Face Hub",
          file=sys.stderr)
    return text


def load_causal_lm(source: str | Path | nn.Module, dtype: torch.dtype | None = None,
                   tokenizer: Any = None, what: str = "model") -> tuple[nn.Module, Any]:
    """A causal LM (folder, Hub id or GGUF file, or an already loaded model) and its tokenizer (the given one, else
    the folder's or file's if it has one). dtype None keeps the checkpoint's. A GGUF file loads dequantized and, on a
    CPU with AVX2 (float32) or AVX512-BF16 (bf16), keeps its Q8_0 / Q6_K / Q5_0 / Q4_0 / Q4_1 / Q4_K blocks for the
    decoding steps (cpu/gguf_weights.py: the exactly dequantized weights, a fraction of the bytes)."""
    if not isinstance(source, (str, Path)):
        return source, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_source(source, what)
    where = (dict(pretrained_model_name_or_path=str(Path(source).parent), gguf_file=Path(source).name)
             if source.endswith(".gguf") else dict(pretrained_model_name_or_path=source))
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype if dtype is not None else "auto")
    if "gguf_file" in where:
        from .cpu.gguf_weights import use_gguf_weights

        use_gguf_weights(model, source)
    if tokenizer is None:
        with contextlib.suppress(OSError, ValueError):  # a folder or file without one
            tokenizer = AutoTokenizer.from_pretrained(**where)
    return model, tokenizer
