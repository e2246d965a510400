"""Long-context prompts of exact token lengths from real text: ShareGPT conversations in the asset cache, rendered
as "User: ...\n\nAssistant: ...", short ones joined in file order. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ..jsonl import iter_jsonl
from ..tuning.draft_vocab import default_corpus

SPEAKERS = {"human": "User", "user": "User", "system": "System"}  # every other role speaks as the assistant
INSTRUCTIONS = {"continue": "Continue the text above from exactly where it stops, in the same style.",
                "summarise": "Summarise the text above in a few short paragraphs."}
PIECE_FRACTION = 4  # conversations of at least min_chars / PIECE_FRACTION are joined into documents


def _conversation_text(path: Path, n: int, row: Any) -> str:
    """One ShareGPT row as "Speaker: text" turns separated by blank lines; ValueError naming file:line if malformed."""
    turns = row.get("conversations") if isinstance(row, dict) else None
    if not isinstance(turns, list):
        raise ValueError(f"{path}:{n}: expected an object with a 'conversations' list")  # noqa: TRY004 (bad data)
    if not all(isinstance(turn, dict) and isinstance(turn.get("value"), str) for turn in turns):
        raise ValueError(f"{path}:{n}: each turn must be an object with a string 'value'")  # noqa: TRY004
    return "\n\n".join(f"{SPEAKERS.get(turn.get('from'), 'Assistant')}: {turn['value'].strip()}" for turn in turns)


def long_documents(path: Path | None = None, min_chars: int = 20000, limit: int | None = None) -> list[str]:
    """Distinct texts of >= min_chars characters from ShareGPT (default: the cached sharegpt.jsonl): single
    conversations, then runs of shorter ones (of at least min_chars / PIECE_FRACTION each) joined in file order; each
    group longest first, ties in file order."""
    path = Path(path) if path is not None else default_corpus()
    piece_chars = max(1, min_chars // PIECE_FRACTION)
    seen: set[bytes] = set()  # digests of conversations already used (ShareGPT repeats some)
    singles: list[str] = []
    joined: list[str] = []
    run: list[str] = []  # short conversations to be joined
    for n, row in iter_jsonl(path, error=ValueError):
        text = _conversation_text(path, n, row)
        digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
        if len(text) < piece_chars or digest in seen:
            continue
        seen.add(digest)
        if len(text) >= min_chars:
            singles.append(text)
            continue
        run.append(text)
        if sum(len(t) + 2 for t in run) >= min_chars:
            joined.append("\n\n".join(run))
            run = []
    return (sorted(singles, key=len, reverse=True) + sorted(joined, key=len, reverse=True))[:limit]


def chat_token_ids(tokenizer: Any, content: str) -> list[int]:
    """Token ids of one user turn after the chat template, with the assistant generation prompt."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def _fit(tokenizer: Any, doc_ids: list[int], instruction: str, context: int, overhead: int) -> list[int] | None:
    """The templated prompt of exactly `context` tokens from a prefix of doc_ids, or None if none fits (re-tokenizing
    the decoded prefix may shift the count at the cut: it is corrected from the measured length, then searched)."""
    def prompt(k: int) -> list[int]:
        cut = tokenizer.decode(doc_ids[:k], clean_up_tokenization_spaces=False).rstrip().rstrip("\ufffd").rstrip()
        return chat_token_ids(tokenizer, f"{cut}\n\n{instruction}")

    k = context - overhead
    if len(doc_ids) < k:
        return None
    tried: set[int] = set()
    while len(tried) < 6 and k not in tried and 0 < k <= len(doc_ids):
        tried.add(k)
        ids = prompt(k)
        if len(ids) == context:
            return ids
        k += context - len(ids)
    for j in sorted(range(k - 4, k + 5), key=lambda j: abs(j - k)):
        if j not in tried and 0 < j <= len(doc_ids) and len(ids := prompt(j)) == context:
            return ids
    return None


def long_prompts(tokenizer: Any, context: int, count: int, path: Path | None = None,
                 task: str = "continue") -> list[list[int]]:
    """`count` distinct chat prompts of exactly `context` tokens: each one user turn, a different document cut to fit
    then the `task` instruction, after the chat template. ValueError if too few documents are long enough."""
    if task not in INSTRUCTIONS:
        raise ValueError(f"task must be one of {sorted(INSTRUCTIONS)}, got {task!r}")
    instruction = INSTRUCTIONS[task]
    overhead = len(chat_token_ids(tokenizer, f"\n\n{instruction}"))  # template + instruction, no document
    if context <= overhead:
        raise ValueError(f"context {context} leaves no room for a document (template + instruction: {overhead} tokens)")
    path = Path(path) if path is not None else default_corpus()
    specials = [t for t in tokenizer.all_special_tokens if t]
    prompts: list[list[int]] = []
    for doc in long_documents(path, 5 * context):  # ~4 characters a token in English prose
        text = doc[:12 * context]  # enough text for `context` tokens in any language; tokenized in one call
        if any(s in text for s in specials):  # e.g. a literal "<|im_end|>" would read as a control token
            continue
        ids = _fit(tokenizer, tokenizer(text, add_special_tokens=False).input_ids, instruction, context, overhead)
        if ids is None or ids in prompts:
            continue
        prompts.append(ids)
        if len(prompts) == count:
            return prompts
    raise ValueError(f"{path} has only {len(prompts)} documents long enough for {context}-token prompts; "
                     f"{count} were asked for")
