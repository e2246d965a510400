"""EAGLE-style draft heads: models, draft vocabulary, checkpoints and serving export."""

from .checkpoint import HeadMismatchError, check_compatible, load_head, save_head
from .config import HeadConfig, default_aux_layer_ids
from .model import DraftHead, HeadKVCache

__all__ = [
    "DraftHead",
    "HeadConfig",
    "HeadKVCache",
    "HeadMismatchError",
    "check_compatible",
    "default_aux_layer_ids",
    "load_head",
    "save_head",
]
