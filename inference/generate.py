"""Command line (the library is inference/engine.py): stream a speculative generation to the terminal, then print
tau and tokens/s.

    python -m inference.generate --target PATH --draft PATH --prompt "Tell me a story" --chat \
        [--temperature 0.7 --top-p 0.9] [--max-new-tokens 128] [--device cpu] [--dtype auto] [--tree cpu]
"""

from __future__ import annotations

import argparse
import sys

import torch

from drafthead.errors import run_main

from .engine import SpeculativeGenerator
from .tree import TREE_PRESETS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m inference.generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="HF model folder of the target")
    ap.add_argument("--draft", required=True, help="draft-head folder (native or exported), a smaller causal LM's "
                    "folder (same tokenizer), or prompt-lookup")
    ap.add_argument("--hybrid", action="store_true", help="add the prompt-lookup branch to a head's tree")
    ap.add_argument("--gamma", type=int, default=4, help="draft-model chain length")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="prompt-lookup chain length")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA and on CPUs with native bf16, else fp32) | "
                    "bfloat16 | float16 | float32 | checkpoint (the checkpoint's own)")
    ap.add_argument("--tree", default="cpu", help=f"a preset ({', '.join(sorted(TREE_PRESETS))}) or "
                    "depth,top_k,total_tokens")
    ap.add_argument("--depth", type=int, default=None)
    ap.add_argument("--top-k-draft", type=int, default=None, help="draft tree branching (overrides --tree)")
    ap.add_argument("--total-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import TextStreamer

    gen = SpeculativeGenerator.from_pretrained(
        args.target, args.draft, device=args.device, dtype=None if args.dtype == "checkpoint" else args.dtype,
        tree=args.tree, depth=args.depth, top_k=args.top_k_draft, total_tokens=args.total_tokens, hybrid=args.hybrid,
        gamma=args.gamma, lookup_tokens=args.lookup_tokens,
    )
    tok = gen.tokenizer
    if tok is None:
        ap.error(f"no tokenizer found in {args.target}")
    if args.chat:
        prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
    else:
        prompt = tok(args.prompt, return_tensors="pt")
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    out = gen.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                       top_k=args.top_k, seed=args.seed, streamer=streamer)
    s = out.stats
    print(f"\n[tau {s.mean_accepted:.2f} | {s.new_tokens} tokens in {s.total_time_s:.2f} s = {s.tokens_per_s:.1f} tok/s"
          f" | target forwards {s.target_forwards} | draft {s.draft_time_s:.2f} s, verify {s.verify_time_s:.2f} s]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
