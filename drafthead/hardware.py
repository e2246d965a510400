"""Hardware-dependent defaults: the fastest exact-enough dtype for a device."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from drafthead.errors import DeviceError
from drafthead.utils import parse_dtype


def cpu_has_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX); without it bf16 matmuls are emulated
    and a multi-token forward runs several times slower than fp32 (docs/results/HISTORY.md)."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags()))


def auto_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 on GPUs that support it and on CPUs with native bf16 (a GGUF target's blocks too: inference/cpu/
    gguf_weights.py), float32 otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    return torch.float32


def resolve_device(name: str | torch.device | None, local_rank: int = 0) -> torch.device:
    """'auto' (or None) -> this process's CUDA device when CUDA is present, else the CPU; a plain 'cuda' in a
    multi-process launch -> cuda:<local_rank>; anything else as given ('cpu', 'cuda:1', ...)."""
    if name is None or name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {name!r}: CUDA is not available here (torch {torch.__version__}); "
                          "use device=auto or device=cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def resolve_dtype(name: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """'fast' (or None, or 'auto', the benchmark's old name for it) -> auto_dtype(device); otherwise a dtype name
    such as 'bfloat16' or 'float32'."""
    if name is None or name in ("fast", "auto"):
        return auto_dtype(device)
    return parse_dtype(name)


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits for the device's queued work (so timers measure work, not kernel launches)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def cpu_flags() -> list[str]:
    """The CPU features that decide the fast dtype (AVX2 / AVX512 / AVX512-BF16 / AMX)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
