"""Benchmark feature collection against a bare target forward on the same batches (SmolLM2 + ShareGPT).

    python scripts/bench_collect.py --out runs/bench_collect.json [--dtype bfloat16|float32] [--sequences 200]

Reports tokens/s of collection (forward + capture + bf16 copy + shard write, as train.collect runs it) and of
the bare base-model forward over exactly the same length-sorted padded batches, their ratio (goal >= 0.9), and
disk bytes per token against (k+1)·hidden·2 + 5 (bf16 features + int32 id + bool mask; goal within 5%).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drafthead.capture import decoder_layers  # noqa: E402
from drafthead.config import default_aux_layer_ids  # noqa: E402
from drafthead.utils import cache_dir  # noqa: E402
from train.collect import collect_split, length_batches  # noqa: E402
from train.conversations import read_conversations  # noqa: E402
from train.prepare import encode  # noqa: E402
from train.target import load_target, load_tokenizer  # noqa: E402


@torch.no_grad()
def bare_forward(model, split, shard_sequences: int, batch_tokens: int, device: torch.device) -> float:
    """Seconds for the base-model forward over the same shards and batches collect_split uses (no hooks, no copy)."""
    start = time.perf_counter()
    for s in range(0, len(split), shard_sequences):
        ids = split[s : s + shard_sequences]["input_ids"]
        for batch in length_batches([len(x) for x in ids], batch_tokens):
            longest = max(len(ids[j]) for j in batch)
            x = torch.zeros(len(batch), longest, dtype=torch.long)
            for b, j in enumerate(batch):
                x[b, : len(ids[j])] = torch.as_tensor(ids[j])
            model.get_decoder()(input_ids=x.to(device), use_cache=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(cache_dir() / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--data", default=str(cache_dir() / "data" / "sharegpt.jsonl"))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sequences", type=int, default=200)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--shard-sequences", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed passes of each; the fastest is reported")
    parser.add_argument("--out", required=True, help="JSON results path")
    args = parser.parse_args()

    device = torch.device(args.device)
    tokenizer = load_tokenizer(args.target)
    model = load_target(args.target, device=device, dtype=args.dtype)
    rows = {"input_ids": [], "loss_mask": []}
    for conv in read_conversations(args.data, skip_bad=True, limit=args.sequences * 2):
        ids, mask, status = encode(tokenizer, conv["messages"], args.max_length)
        if status == "ok" and len(rows["input_ids"]) < args.sequences:
            rows["input_ids"].append(ids)
            rows["loss_mask"].append(mask)
    from datasets import Dataset

    split = Dataset.from_dict(rows)
    tokens = sum(len(x) for x in rows["input_ids"])
    num_layers = len(decoder_layers(model))
    aux = default_aux_layer_ids(num_layers)
    hidden = model.config.get_text_config().hidden_size
    print(f"{len(split)} sequences, {tokens} tokens, {args.dtype}, threads={torch.get_num_threads()}")

    bare_forward(model, split.select(range(min(8, len(split)))), args.shard_sequences, args.batch_tokens, device)
    bare_s, collect_s, disk = [], [], 0
    for _ in range(args.repeats):  # interleaved, so drifting machine load hits both alike
        bare_s.append(bare_forward(model, split, args.shard_sequences, args.batch_tokens, device))
        with tempfile.TemporaryDirectory() as folder:
            start = time.perf_counter()
            collect_split(model, split, folder, {"target": "bench", "target_config_hash": "bench",
                                                 "hidden_size": hidden}, aux, args.shard_sequences,
                          args.batch_tokens, device)
            collect_s.append(time.perf_counter() - start)
            disk = sum(p.stat().st_size for p in Path(folder).glob("shard-*.safetensors"))
        print(f"bare {bare_s[-1]:.1f} s, collect {collect_s[-1]:.1f} s")

    expected = (len(aux) + 1) * hidden * 2 + 5
    result = {
        "target": Path(args.target).name, "dtype": args.dtype, "device": str(device),
        "threads": torch.get_num_threads(), "sequences": len(split), "tokens": tokens,
        "max_length": args.max_length, "batch_tokens": args.batch_tokens, "shard_sequences": args.shard_sequences,
        "bare_forward_tok_s": round(tokens / min(bare_s), 1), "collect_tok_s": round(tokens / min(collect_s), 1),
        "ratio": round(min(bare_s) / min(collect_s), 3),
        "disk_bytes_per_token": round(disk / tokens, 2), "expected_bytes_per_token": expected,
        "disk_overhead": round(disk / tokens / expected - 1, 4),
        "bare_s": [round(x, 2) for x in bare_s], "collect_s": [round(x, 2) for x in collect_s],
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
