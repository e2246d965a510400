"""Read chat conversations: ShareGPT / OpenAI JSONL files and `datasets` folders, normalised to OpenAI messages.

Every record becomes {"id": str, "messages": [{"role": "user"|"assistant"|"system", "content": str}, ...]}.
ShareGPT `conversations: [{from, value}]` (from in human/gpt/system) and OpenAI `messages: [{role, content}]`
are both accepted. Turns with an unknown role are skipped and counted. A malformed record raises an error that
names the file and line (or split and row); with skip_bad=True it is skipped and counted instead.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from drafthead.errors import DataError

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class BadRecord(DataError):
    """A conversation record that cannot be read; the message names where it is."""


def normalize(record: Any, where: str, stats: Counter | None = None) -> dict:
    """One raw record (ShareGPT or OpenAI form) -> {"id", "messages"}; raises BadRecord naming `where`."""
    if not isinstance(record, dict):
        raise BadRecord(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise BadRecord(f"{where}: no 'conversations' (ShareGPT) or 'messages' (OpenAI) field")
    if not isinstance(turns, list):
        raise BadRecord(f"{where}: the turns must be a list, got {type(turns).__name__}")
    messages = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise BadRecord(f"{where}: turn {j} must be an object with {role_key!r} and {text_key!r}")
        content = turn[text_key]
        if not isinstance(content, str):
            raise BadRecord(f"{where}: turn {j} {text_key!r} must be a string, got {type(content).__name__}")
        role = ROLE_MAP.get(str(turn[role_key]).lower())
        if role is None:
            if stats is not None:
                stats[f"skipped_turns_role_{turn[role_key]}"] += 1
            continue
        messages.append({"role": role, "content": content})
    rid = record.get("id", record.get("conversation_id"))
    return {"id": str(rid) if rid is not None else where, "messages": messages}


def cut_turns(conversation: dict, max_assistant_turns: int | None) -> dict:
    """The conversation up to and including its N-th assistant turn (all of it when N is None)."""
    if max_assistant_turns is None:
        return conversation
    seen = 0
    for i, message in enumerate(conversation["messages"]):
        seen += message["role"] == "assistant"
        if seen == max_assistant_turns:
            return {**conversation, "messages": conversation["messages"][: i + 1]}
    return conversation


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            where = f"{path}:{lineno}"
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                yield where, BadRecord(f"{where}: invalid JSON ({e.msg} at column {e.colno})")


def _dataset_records(path: Path) -> Iterator[tuple[str, Any]]:
    from datasets import DatasetDict, load_from_disk

    data = load_from_disk(str(path))
    if isinstance(data, DatasetDict):
        split = "train" if "train" in data else next(iter(data))
        data = data[split]
    else:
        split = "data"
    for i, row in enumerate(data):
        yield f"{path}[{split}] row {i}", row


def read_conversations(
    path: str | Path, skip_bad: bool = False, limit: int | None = None, stats: Counter | None = None,
    max_assistant_turns: int | None = None,
) -> list[dict]:
    """All conversations of a JSONL file or `datasets` folder (the first `limit` if given), normalised; with
    max_assistant_turns each is cut after its N-th assistant turn (1 = first turns only)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"conversations {path} not found")
    stats = stats if stats is not None else Counter()
    records = _dataset_records(path) if path.is_dir() else _jsonl_records(path)
    out = []
    for where, raw in records:
        if limit is not None and len(out) >= limit:
            break
        try:
            if isinstance(raw, BadRecord):
                raise raw
            out.append(cut_turns(normalize(raw, where, stats), max_assistant_turns))
        except BadRecord:
            if not skip_bad:
                raise
            stats["skipped_bad_records"] += 1
    stats["read"] += len(out)
    return out
