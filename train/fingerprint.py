"""Fingerprints of what a run's inputs were made from, so that nothing stale is reused: collected features
record the prepared data and the target they came from (train.collect refuses a folder that holds another's),
and a checkpoint records the data and the recipe keys that fix its data order (a resume refuses a changed one).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
EDGE = 1 << 20  # bytes read from each end of a weight file


def split_fingerprint(split: Any, rows: int = 8192) -> str:
    """sha256 (16 hex digits) of a prepared split's content: every sequence's input_ids and loss_mask, in order."""
    import numpy as np
    import pyarrow.compute as pc

    digest = hashlib.sha256()
    table = split.with_format("arrow")
    for start in range(0, len(split), rows):
        chunk = table[start: start + rows]
        for column in ("input_ids", "loss_mask"):
            values = chunk[column]
            digest.update(np.asarray(pc.list_value_length(values), dtype=np.int64).tobytes())
            digest.update(np.asarray(pc.list_flatten(values)).tobytes())
    return digest.hexdigest()[:16]


def weights_fingerprint(folder: str | Path) -> str:
    """sha256 (16 hex digits) of a model folder's weight files: names, sizes and the first and last MiB of each. A
    fine-tuned model of the same architecture differs there; reading a few MiB costs nothing next to a forward."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).expanduser().iterdir() if p.name.endswith(WEIGHT_SUFFIXES)):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(EDGE))
            if size > 2 * EDGE:
                f.seek(size - EDGE)
                digest.update(f.read(EDGE))
    return digest.hexdigest()[:16]


def differences(recorded: dict, current: dict) -> list[str]:
    """'key: was X, now Y' for each key of `current` whose value differs from `recorded` (a key `recorded` lacks
    was not recorded by the version that wrote it, and differs too)."""
    return [f"{key}: was {recorded.get(key, 'not recorded')!r}, now {value!r}"
            for key, value in current.items() if recorded.get(key) != value]
