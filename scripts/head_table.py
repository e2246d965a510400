"""Print the README's head-size table (markdown): trainable parameters and saved file size per head kind.

    python scripts/head_table.py [--target PATH] [--draft-vocab 32000]

Builds each head from the target's config (random weights: sizes do not depend on training), saves it with
save_head in bf16 and fp32 into a temp folder, and reports the real model.safetensors sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drafthead import DraftHead, HeadConfig, save_head  # noqa: E402
from drafthead.format import WEIGHTS_NAME  # noqa: E402
from drafthead.paths import cache_dir  # noqa: E402


def default_target() -> Path:
    return cache_dir() / "models" / "SmolLM2-135M-Instruct"


def file_mb(head: DraftHead, dtype: torch.dtype) -> float:
    """Size in MB (10^6 bytes) of the head's model.safetensors saved in `dtype` (d2t/t2d keep their dtypes)."""
    with tempfile.TemporaryDirectory() as tmp:
        save_head(head.to(dtype), tmp)
        return (Path(tmp) / WEIGHTS_NAME).stat().st_size / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=default_target(), help="target HF folder (config.json)")
    parser.add_argument("--draft-vocab", type=int, default=32000, help="EAGLE-3 draft vocabulary size")
    args = parser.parse_args(argv)
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(args.target)
    raw = json.loads((args.target / "config.json").read_text())
    name = raw.get("_name_or_path") or args.target.name  # e.g. "SmolLM2-135M-Instruct Q4_1, dequantized"
    print(f"Target: {name} ({target_config.num_hidden_layers} layers, hidden {target_config.hidden_size}, "
          f"vocab {target_config.vocab_size})\n")
    print("| head | draft vocab | aux layers | trainable params | file bf16 (MB) | file fp32 (MB) |")
    print("|---|---|---|---|---|---|")
    for kind, vocab in (("eagle3", args.draft_vocab), ("eagle1", None)):
        config = HeadConfig.from_target_config(target_config, kind=kind, draft_vocab_size=vocab)
        head = DraftHead(config)
        params = head.num_trainable_parameters()
        bf16, fp32 = file_mb(head, torch.bfloat16), file_mb(head, torch.float32)
        label = "EAGLE-3" if kind == "eagle3" else "EAGLE-1/2"
        print(f"| {label} | {config.draft_vocab_size:,} | {config.aux_layer_ids} | {params / 1e6:.2f} M ({params:,}) "
              f"| {bf16:.1f} | {fp32:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
