"""Loading Hugging Face causal LMs for the engine: a folder or name, or a model already in memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn


def load_causal_lm(source: str | Path | nn.Module, dtype: torch.dtype | None = None,
                   tokenizer: Any = None) -> tuple[nn.Module, Any]:
    """A causal LM (folder or name, or an already loaded model) and its tokenizer (the given one, else the
    folder's if it has one). dtype None keeps the checkpoint's."""
    if not isinstance(source, (str, Path)):
        return source, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype if dtype is not None else "auto")
    if tokenizer is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError):
            tokenizer = None
    return model, tokenizer
