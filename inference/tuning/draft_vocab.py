"""Prune a head's draft vocabulary to the tokens a corpus of assistant answers uses most.

On a CPU the head's lm_head over a 32k draft vocabulary costs more than the rest of a draft step; keeping the
most frequent N tokens (rows of lm_head and d2t, no retraining; `DraftHead.pruned`) makes every drafting depth
cheaper, at the price of never drafting the rare tokens. Output stays lossless: the target still decides.

    python -m inference.tuning.draft_vocab --draft HEAD --target TARGET --keep 8192 --out PRUNED_HEAD
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

import torch

from drafthead.paths import cache_dir

from ..jsonl import iter_jsonl

ASSISTANT = {"gpt", "assistant", "chatgpt", "bard", "bing"}
# `--draft-vocab auto`: the sizes the tuner tries besides the unpruned head, and the one it tunes the tree with
# (4,096 drafted much faster and kept most of the acceptance: docs/results/engine_bench_mtbench80_pruned4096.json)
AUTO_SIZES = (2048, 4096, 8192)
AUTO_TUNING_SIZE = 4096


def default_corpus() -> Path:
    """ShareGPT conversations in the asset cache (scripts/fetch_assets.py)."""
    return cache_dir() / "data" / "sharegpt.jsonl"


def assistant_token_counts(tokenizer: Any, path: str | Path, vocab_size: int, limit: int = 2000) -> torch.Tensor:
    """Token counts (vocab_size,) over the assistant turns of the first `limit` conversations of a JSONL file
    (ShareGPT `conversations: [{from, value}]` or OpenAI `messages: [{role, content}]`)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no corpus to count draft tokens in (ShareGPT: scripts/fetch_assets.py)")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for _, row in iter_jsonl(path, limit):
        turns = row.get("conversations") or row.get("messages") or []
        texts = [t.get("value", t.get("content", "")) for t in turns if t.get("from", t.get("role")) in ASSISTANT]
        for ids in tokenizer(texts, add_special_tokens=False).input_ids if texts else []:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    if counts.sum() == 0:
        raise SystemExit(f"{path}: no assistant turns found")
    return counts


def frequent_tokens(tokenizer: Any, vocab_size: int, keep: int, corpus: str | Path | None = None) -> torch.Tensor:
    """The `keep` target ids the assistant turns of `corpus` (default: the ShareGPT asset) use most, sorted by id:
    the draft vocabulary of a self-draft (self_draft.StreamingSelfDrafter's `vocab`)."""
    if not 0 < keep <= vocab_size:
        raise ValueError(f"keep must be in 1..{vocab_size}, got {keep}")
    counts = assistant_token_counts(tokenizer, corpus or default_corpus(), vocab_size)
    return torch.sort(torch.sort(-counts, stable=True).indices[:keep]).values


def parse_draft_vocab(value: str) -> int | str:
    """--draft-vocab: a positive number of draft tokens to keep, or "auto"."""
    if value == "auto":
        return value
    with contextlib.suppress(ValueError):
        if int(value) > 0:
            return int(value)
    raise argparse.ArgumentTypeError(f"expected a positive number of draft tokens or 'auto', got {value!r}")


def vocab_candidates(head: Any, counts: torch.Tensor, sizes: tuple[int, ...] = AUTO_SIZES) -> dict[int, Any]:
    """{draft vocabulary size: the head pruned to it} for each of `sizes` below the head's own, plus the head
    itself under its own size (what `--draft-vocab auto` has the tuner try)."""
    full = head.config.draft_vocab_size
    return {size: head.pruned(counts, size) for size in sizes if size < full} | {full: head}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", required=True, help="EAGLE-3 head folder (native or exported)")
    p.add_argument("--target", required=True, help="the target's HF folder (tokenizer and embeddings)")
    p.add_argument("--keep", type=int, required=True, help="draft tokens to keep")
    p.add_argument("--corpus", type=Path, default=None, help="JSONL conversations (default: ShareGPT asset)")
    p.add_argument("--conversations", type=int, default=2000)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafthead import load_head
    from drafthead.export import export_head

    head = load_head(args.draft, target=AutoModelForCausalLM.from_pretrained(args.target))
    counts = assistant_token_counts(AutoTokenizer.from_pretrained(args.target), args.corpus or default_corpus(),
                                    head.config.vocab_size, args.conversations)
    export_head(head.pruned(counts, args.keep), args.out)
    print(f"wrote {args.out}: draft vocabulary {head.config.draft_vocab_size} -> {args.keep}")


if __name__ == "__main__":
    main()
