"""Dtype names -> torch dtypes, shared by training and inference."""

from __future__ import annotations

import torch

DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype name ('bfloat16', 'bf16', 'fp32', ...), a torch dtype, or None (kept) -> torch dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    return DTYPES[name]
