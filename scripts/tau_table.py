"""Mean accepted length τ of several heads on the same prompts and tree, greedy: the heads' quality side by side.

    python scripts/tau_table.py --target PATH --heads start=HEAD_A self=HEAD_B ... [--tree gpu] [--num-prompts 80]
        [--max-new-tokens 128] [--batch-size 8] --out docs/results/tau.json

Every head decodes every prompt (MT-bench first turns by default, the target's chat template) with the engine's
speculative greedy decoding on the given tree; the target's output does not depend on the head (lossless), so
the heads differ only in how many tokens each verification accepts. Reports τ (accepted tokens per target forward,
the bonus token included), the acceptance histogram and per-depth acceptance rates, and writes a markdown table
row per head. Heads are decoded prompt by prompt in turn; timing plays no part. With --batch-size N > 1 each head
decodes the whole prompt set with the engine's batched EAGLE-2 trees (the same drafting with a batch axis),
N rows at a time with continuous batching (SpeculativeGenerator.generate_many): the same τ up to the target's bf16
near-ties (a row verified beside other rows), in a fraction of the time on a CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drafthead.paths import cache_dir  # noqa: E402
from drafthead.hardware import resolve_dtype  # noqa: E402
from drafthead.utils import atomic_write_json  # noqa: E402
from inference import SpeculativeGenerator  # noqa: E402
from inference.bench import chat_ids, load_prompts  # noqa: E402
from inference.loading import load_causal_lm  # noqa: E402


def depth_acceptance(lengths: list[int], depth: int) -> list[float]:
    """P(a >= d | a >= d - 1) for d = 1..depth, a = draft tokens accepted per step: how often the d-th draft
    position is accepted once the position before it was."""
    rates = []
    for d in range(1, depth + 1):
        reached = sum(a >= d - 1 for a in lengths)
        rates.append(round(sum(a >= d for a in lengths) / reached, 4) if reached else 0.0)
    return rates


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(cache_dir() / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--heads", nargs="+", required=True, help="NAME=HEAD_FOLDER (native or exported)")
    p.add_argument("--tree", default="gpu", help="a preset (cpu, gpu, chain) or depth,top_k,total_tokens")
    p.add_argument("--prompts", default="mt_bench")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1,
                   help="rows decoded at once (continuous batching); 1 = each prompt alone")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", default="docs/results/tau_table.json")
    args = p.parse_args(argv)

    dtype = resolve_dtype(args.dtype, "cpu")
    target, tokenizer = load_causal_lm(args.target, dtype)
    heads = dict(item.split("=", 1) for item in args.heads)
    gens = {name: SpeculativeGenerator.from_pretrained(target, path, dtype=dtype, tokenizer=tokenizer, tree=args.tree)
            for name, path in heads.items()}
    prompts = load_prompts(args.prompts, args.num_prompts)
    lengths: dict[str, list[int]] = {name: [] for name in gens}
    outputs: dict[str, list[list[int]]] = {name: [] for name in gens}
    from tqdm import tqdm

    if args.batch_size > 1:
        queue = [chat_ids(tokenizer, prompt, target.device)[0] for prompt in prompts]
        for name, gen in tqdm(gens.items(), desc="tau", unit="head"):
            out = gen.generate_many(queue, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
            lengths[name], outputs[name] = out.stats.accept_lengths, out.new_tokens
    else:
        for prompt in tqdm(prompts, desc="tau", unit="prompt"):
            ids = chat_ids(tokenizer, prompt, target.device)
            for name, gen in gens.items():
                out = gen.generate(ids, max_new_tokens=args.max_new_tokens)
                lengths[name] += out.stats.accept_lengths
                outputs[name].append(out.sequences[0, ids.shape[1]:].tolist())
    first = next(iter(outputs))
    depth = next(iter(gens.values())).options.depth
    result = {"target": args.target, "tree": args.tree, "prompts": args.prompts, "num_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
              "dtype": str(dtype).removeprefix("torch."),
              "outputs_identical_across_heads": all(outputs[n] == outputs[first] for n in outputs), "heads": {}}
    for name, path in heads.items():
        n = lengths[name]
        digest = hashlib.sha256(json.dumps(outputs[name]).encode()).hexdigest()[:16]  # compare across runs
        result["heads"][name] = {"path": path, "tau": round(sum(n) / len(n), 4), "target_forwards": len(n),
                                 "new_tokens": sum(map(len, outputs[name])), "outputs_sha256": digest,
                                 "depth_acceptance": depth_acceptance([x - 1 for x in n], depth)}
    atomic_write_json(Path(args.out), result)
    print("| head | τ | acceptance at draft depth 1..%d |" % depth)
    print("|---|---|---|")
    for name, row in result["heads"].items():
        print(f"| {name} | {row['tau']:.2f} | {' / '.join(f'{r:.2f}' for r in row['depth_acceptance'])} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
