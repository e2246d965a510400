"""Prepare training data: conversations -> chat-templated token ids + assistant loss mask, train/validation split.

    python -m train.prepare configs/smollm2-135m-eagle3.yaml [data.max_conversations=500 ...]

Writes a `datasets` DatasetDict ("train", "validation"; columns id string, input_ids int32, loss_mask bool)
atomically into data.prepared_dir. The split is by conversation id ROOT (the part before the last "_", since
ShareGPT splits long chats into id_0, id_1, ...), decided by a hash of the root: deterministic, and the pieces of
one chat never straddle train and validation.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from drafthead.errors import DataError
from train.conversations import BadRecord, read_conversations
from train.loss_mask import TemplateError, tokenize_with_mask
from train.recipe import Recipe, parse_recipe
from train.recipe_help import recipe_main
from train.target import load_tokenizer

MIN_VALIDATION = 8  # fewer validation conversations than this get a warning: their eval_* figures are noise


def id_root(conversation_id: str) -> str:
    """'abc_3' -> 'abc' (ShareGPT's split long chats share the root); ids without '_' are their own root."""
    return conversation_id.rsplit("_", 1)[0] if "_" in conversation_id else conversation_id


def is_validation(conversation_id: str, fraction: float, seed: int = 0) -> bool:
    """Deterministic split: hash of (seed, id root) mapped to [0, 1) and compared with `fraction`."""
    digest = hashlib.sha256(f"{seed}:{id_root(conversation_id)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def encode(tokenizer: Any, messages: list[dict], max_length: int) -> tuple[list[int], list[bool], str]:
    """(input_ids, loss_mask, status): status is "ok" or why the conversation is dropped."""
    if not any(m["role"] == "assistant" for m in messages):
        return [], [], "no_assistant_turn"
    try:
        ids, mask = tokenize_with_mask(tokenizer, messages)
    except TemplateError:
        return [], [], "template_mismatch"
    except Exception as e:  # a template that raises on this conversation (e.g. roles must alternate)
        return [], [], f"template_error_{type(e).__name__}"
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        return [], [], "no_assistant_token_after_truncation"
    return ids, mask, "ok"


def _encode_batch(batch: dict, tokenizer: Any, max_length: int) -> dict:
    out = {"input_ids": [], "loss_mask": [], "status": []}
    for messages in batch["messages"]:
        ids, mask, status = encode(tokenizer, messages, max_length)
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
        out["status"].append(status)
    return out


def save_dataset_atomic(data: Any, folder: str | Path) -> None:
    """save_to_disk into a temp folder beside `folder`, then swap it in (a reader never sees a partial folder)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp-"))
    try:
        # one arrow file per 256 MB; an empty split needs an explicit shard or it cannot be loaded back
        shards = {name: max(1, math.ceil(split.data.nbytes / 2**28)) for name, split in data.items()}
        data.save_to_disk(str(tmp), num_shards=shards)
        old = None
        if folder.exists():
            old = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.old-"))
            os.replace(folder, old / "data")
        os.replace(tmp, folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def prepare(recipe: Recipe | dict) -> dict:
    """Run the whole preparation described by `recipe`; returns the counts it printed."""
    from datasets import Dataset, DatasetDict, Features, List, Value

    recipe = parse_recipe(recipe)
    data_cfg = recipe.data
    tokenizer = load_tokenizer(recipe.target)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"the tokenizer of {recipe.target} has no chat template")
    print(f"[prepare] device=cpu (tokenizing only: no model is loaded, no dtype) target={recipe.target}", flush=True)
    stats: Counter = Counter()
    try:
        conversations = read_conversations(data_cfg.conversations, skip_bad=data_cfg.skip_bad,
                                           limit=data_cfg.max_conversations, stats=stats,
                                           max_assistant_turns=data_cfg.max_assistant_turns)
    except BadRecord as e:
        raise DataError(f"{e} (set data.skip_bad=true to skip and count malformed records)")
    if not conversations:
        raise DataError(f"no conversations read from {data_cfg.conversations}")

    num_proc = int(data_cfg.num_proc or min(4, os.cpu_count() or 1))
    num_proc = max(1, min(num_proc, len(conversations) // 64 or 1))  # tiny inputs: no worker pool
    raw = Dataset.from_list(conversations)
    encoded = raw.map(
        _encode_batch, batched=True, batch_size=64, num_proc=num_proc if num_proc > 1 else None,
        fn_kwargs={"tokenizer": tokenizer, "max_length": data_cfg.max_length},
        remove_columns=["messages"], desc="tokenizing",
    )
    for status, count in Counter(encoded["status"]).items():
        stats["kept" if status == "ok" else f"dropped_{status}"] += count
    kept = encoded.filter(lambda s: [x == "ok" for x in s], input_columns="status", batched=True,
                          desc="filtering").remove_columns("status")

    in_val = [is_validation(i, data_cfg.validation_fraction, data_cfg.seed) for i in kept["id"]]
    features = Features({"id": Value("string"), "input_ids": List(Value("int32")), "loss_mask": List(Value("bool"))})
    splits = DatasetDict(
        train=kept.select([j for j, v in enumerate(in_val) if not v]).cast(features),
        validation=kept.select([j for j, v in enumerate(in_val) if v]).cast(features),
    )
    if len(splits["train"]) == 0:
        raise DataError(f"all {len(kept)} conversations fell into the validation split: lower "
                        f"data.validation_fraction (now {data_cfg.validation_fraction}) or add conversations")
    if len(splits["validation"]) < MIN_VALIDATION:
        print(f"warning: {len(splits['validation'])} validation conversations (data.validation_fraction="
              f"{data_cfg.validation_fraction} of {len(kept)}): " + (
                  "training will run without evaluation" if len(splits["validation"]) == 0 else
                  "evaluation will be noisy") + "; raise data.validation_fraction or add conversations",
              file=sys.stderr)
    save_dataset_atomic(splits, data_cfg.prepared_dir)

    for name, split in splits.items():
        tokens = sum(len(x) for x in split["input_ids"])
        masked = sum(sum(x) for x in split["loss_mask"])
        stats[f"{name}_conversations"] = len(split)
        stats[f"{name}_tokens"] = tokens
        stats[f"{name}_masked_tokens"] = masked
    total = stats["train_tokens"] + stats["validation_tokens"]
    result = dict(sorted(stats.items()))
    masked = stats["train_masked_tokens"] + stats["validation_masked_tokens"]
    result["masked_fraction"] = round(masked / max(total, 1), 4)
    print(f"prepared {data_cfg.prepared_dir}:")
    for key, value in result.items():
        print(f"  {key}: {value}")
    return result


if __name__ == "__main__":
    recipe_main(prepare, __doc__)
