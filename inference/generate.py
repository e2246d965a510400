"""Command line (the library is inference/engine.py): stream a speculative generation to the terminal, then print
tau and tokens/s.

    python -m inference.generate --target PATH --draft PATH --prompt "Tell me a story" \
        [--temperature 0.7 --top-p 0.9] [--max-new-tokens 128] [--device auto] [--dtype fast] [--tree auto]

It first prints (stderr) the device, dtype, tree and prompt form that the options resolved to.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from drafthead.errors import run_main
from drafthead.utils import dtype_name

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
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                    help="wrap the prompt in the tokenizer's chat template (default: when the tokenizer has one; "
                         "--no-chat: the raw text, for a base model)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda, cuda:1, ...")
    ap.add_argument("--dtype", default="fast", help="fast (bf16 on CUDA and on CPUs with native bf16, else fp32) | "
                    "auto (the checkpoint's own; 'checkpoint' is its old name) | bfloat16 | float16 | float32")
    ap.add_argument("--tree", default="auto", help=f"auto (tuned for this machine once, then cached), a preset "
                    f"({', '.join(sorted(TREE_PRESETS))}), none (plain decoding) or depth,branching,total_tokens")
    ap.add_argument("--depth", type=int, default=None, help="draft tree depth (overrides --tree)")
    ap.add_argument("--branching", type=int, default=None, help="draft tree branching: children per node "
                    "(overrides --tree)")
    ap.add_argument("--top-k-draft", type=int, default=None, help=argparse.SUPPRESS)  # --branching's old name
    ap.add_argument("--total-tokens", type=int, default=None, help="drafted tokens verified a step (overrides --tree)")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                    help="torch.compile the decoding steps (auto: on CUDA only; on a CPU each step shape compiles for "
                         "minutes, paid back over long runs, not over one prompt)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.top_k_draft is not None:
        warnings.warn("--top-k-draft is now --branching; --top-k-draft goes in the next release", FutureWarning)
        args.branching = args.top_k_draft if args.branching is None else args.branching
    from transformers import TextStreamer

    gen = SpeculativeGenerator.from_pretrained(
        args.target, args.draft, device=args.device, dtype="auto" if args.dtype == "checkpoint" else args.dtype,
        tree=args.tree, depth=args.depth, branching=args.branching, total_tokens=args.total_tokens,
        hybrid=True if args.hybrid else None, gamma=args.gamma, lookup_tokens=args.lookup_tokens,
        # a one-prompt command: "auto" compiles on CUDA only (the library's tuned path compiles on a CPU too)
        compile=args.compile if args.compile != "auto" else torch.cuda.is_available() and args.device != "cpu")
    tok = gen.tokenizer
    if tok is None:
        ap.error(f"no tokenizer found in {args.target}")
    has_template = bool(getattr(tok, "chat_template", None))
    if args.chat and not has_template:
        ap.error(f"--chat: the tokenizer in {args.target} has no chat template (drop --chat to send the raw text)")
    chat = has_template if args.chat is None else args.chat
    ref = next(gen.target.parameters())
    print(f"[drafthead] {ref.device}, {dtype_name(ref.dtype)}, {gen.drafter.name} drafter, {describe_tree(gen)}, "
          f"prompt {'in the chat template' if chat else 'as raw text'}", file=sys.stderr, flush=True)
    if chat:
        prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
    else:
        prompt = tok(args.prompt, return_tensors="pt")
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    s = gen.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                     top_k=args.top_k, seed=args.seed, streamer=streamer).stats
    print(f"\n[tau {s.mean_accepted:.2f} | {s.new_tokens} tokens in {s.total_time_s:.2f} s = {s.tokens_per_s:.1f} tok/s"
          f" | target forwards {s.target_forwards} | draft {s.draft_time_s:.2f} s, verify {s.verify_time_s:.2f} s]",
          file=sys.stderr)
    return 0


def describe_tree(gen: SpeculativeGenerator) -> str:
    """The tree a head drafts (depth, branching, total tokens, with the lookup branch), or plain decoding."""
    if gen.plain:
        return "plain decoding (no speculation)"
    if gen.options is None:
        return "its own drafts"
    o = gen.options
    lookup = ", with the prompt-lookup branch" if "+lookup" in gen.drafter.name else ""
    return f"tree depth {o.depth}, branching {o.top_k}, {o.total_tokens} tokens{lookup}"


if __name__ == "__main__":
    raise SystemExit(run_main(main))
