"""Read a JSONL file row by row; a malformed line is reported as `file:line`."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path


def iter_jsonl(path: str | Path, limit: int | None = None,
               error: type[BaseException] = SystemExit) -> Iterator[tuple[int, dict]]:
    """(line number, row) for each non-empty line, up to line `limit`; `error` (SystemExit for a command line)
    naming file:line on bad JSON."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(itertools.islice(f, limit), 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{n}: not valid JSON ({e})") from None
