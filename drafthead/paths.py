"""Where the project's assets live. Imports neither torch nor transformers, so bootstrap scripts
(scripts/fetch_assets.py) can use it and still start in a fraction of a second."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The asset cache folder (real models and data sets): $DRAFTHEAD_CACHE, else ~/.cache/drafthead."""
    return Path(os.environ.get("DRAFTHEAD_CACHE", Path.home() / ".cache" / "drafthead")).expanduser()
