"""EAGLE-style draft heads: models, draft vocabulary, checkpoints and serving export.

The names below load on first use, so `import drafthead.paths` (no torch) stays cheap for bootstrap scripts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .checkpoint import HeadMismatchError, check_compatible, load_head, save_head
    from .config import HeadConfig, default_aux_layer_ids
    from .model import DraftHead, HeadKVCache

_HOMES = {
    "DraftHead": "model", "HeadKVCache": "model", "HeadConfig": "config", "default_aux_layer_ids": "config",
    "HeadMismatchError": "checkpoint", "check_compatible": "checkpoint", "load_head": "checkpoint",
    "save_head": "checkpoint",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'drafthead' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
