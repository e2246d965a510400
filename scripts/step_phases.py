"""Where a decoding step's time goes: the engine's own loop with a timer around each phase, per method.

    python scripts/step_phases.py --target PATH --draft HEAD [--draft-vocab 4096] --tree 2,2,3 \
        --num-prompts 8 --max-new-tokens 128 --rounds 3 [--repeat-draft] --out docs/results/step_phases.json

Each method (engine plain decoding and speculative decoding with the head's tree) decodes the same prompts, the
methods taking turns prompt by prompt for `--rounds` rounds (a shared machine has slow and fast spells). Per round
and method: milliseconds per verification step of drafting (`draft`: the drafter's propose, of which `draft_step`
is the head's tree expansion), the target's verify forward (`verify`), the cache compaction (`commit`) and the
rest of the loop (`host`: the greedy check, the drafter's bookkeeping, stop checks), plus the prompt's prefill
spread over the steps (`prefill`), τ and tokens/s of the loop. `--repeat-draft` runs the head's tree expansion a
second time right after each call, with the same inputs (the second call rewrites the same head cache slots with
the same values: outputs do not change), and reports it as `draft_step_again`: the step with everything it reads
warm, against the first call, which runs right after the target's step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drafthead.hardware import cpu_flags, resolve_dtype, synchronizer  # noqa: E402
from drafthead.utils import atomic_write_json  # noqa: E402
from inference.engine import SpeculativeGenerator  # noqa: E402


class PhaseTimer:
    """Wraps methods of live objects with wall-clock timers (seconds summed per phase name); `sync` waits for the
    device's queued work before each reading (CUDA runs asynchronously)."""

    def __init__(self, sync: Callable[[], None] = lambda: None) -> None:
        self.seconds: dict[str, float] = {}
        self.sync = sync

    def wrap(self, obj: object, attr: str, phase: str, again: str | None = None) -> None:
        """Time obj.attr under `phase`; with `again`, call it a second time right after and time that too."""
        inner: Callable = getattr(obj, attr)

        def timed(*args, **kwargs):
            out = None
            for name in (phase, again) if again is not None else (phase,):
                self.sync()
                start = time.perf_counter()
                out = inner(*args, **kwargs)
                self.sync()
                self.add(name, time.perf_counter() - start)
            return out

        setattr(obj, attr, timed)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


def instrument(generator: SpeculativeGenerator, repeat_draft: bool = False) -> PhaseTimer:
    """A PhaseTimer around the generator's runner and drafter (for its lifetime)."""
    timer = PhaseTimer(synchronizer(generator.device))
    runner, drafter = generator.runner, generator.drafter
    for name in ("prefill", "verify", "commit"):
        timer.wrap(runner, name, name)
    timer.wrap(drafter, "propose", "draft")
    if hasattr(drafter, "_expand"):  # a head's tree expansion, after it fed the accepted pairs (drafters/eagle.py)
        timer.wrap(drafter, "_expand", "draft_step", again="draft_step_again" if repeat_draft else None)
    return timer


def measure(generators: dict[str, SpeculativeGenerator], prompts: list[torch.Tensor], max_new_tokens: int,
            rounds: int, repeat_draft: bool = False) -> dict:
    """{"rounds": [{method: phases}], "sequences": {method: the last round's new tokens per prompt}}."""
    timers = {name: instrument(g, repeat_draft) for name, g in generators.items()}
    result: dict = {"rounds": [], "sequences": {}}
    for _ in range(rounds):
        totals = {name: {"steps": 0, "accepted": 0, "new_tokens": 0, "loop_s": 0.0} for name in generators}
        for timer in timers.values():
            timer.seconds.clear()
        result["sequences"] = {name: [] for name in generators}
        for ids in prompts:
            for name, generator in generators.items():
                out = generator.generate(ids, max_new_tokens=max_new_tokens)
                stats = out.stats
                totals[name]["steps"] += len(stats.accept_lengths)  # verification steps (not the prefill)
                totals[name]["accepted"] += sum(stats.accept_lengths)
                totals[name]["new_tokens"] += stats.new_tokens
                totals[name]["loop_s"] += stats.total_time_s - stats.prefill_time_s
                result["sequences"][name].append(out.sequences[0, ids.shape[1]:].tolist())
        summary = {}
        for name, total in totals.items():
            steps = max(total["steps"], 1)
            ms = {phase: 1000 * s / steps for phase, s in timers[name].seconds.items()}
            loop_ms = 1000 * total["loop_s"] / steps
            ms["host"] = loop_ms - sum(ms.get(p, 0.0) for p in ("draft", "verify", "commit"))
            summary[name] = {"ms_per_step": {k: round(v, 3) for k, v in sorted(ms.items())},
                             "loop_ms_per_step": round(loop_ms, 3), "steps": total["steps"],
                             "tau": total["accepted"] / steps,
                             "tokens_per_s": total["new_tokens"] / total["loop_s"] if total["loop_s"] else 0.0}
        result["rounds"].append(summary)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True, help="a draft-head folder")
    parser.add_argument("--draft-vocab", type=int, default=0, help="prune the head's draft vocabulary first")
    parser.add_argument("--tree", default="2,2,3", help="'depth,top_k,total_tokens' or a preset")
    parser.add_argument("--prompts", default="mt_bench", help="'mt_bench' or a JSONL file (as inference.bench)")
    parser.add_argument("--category", default=None, help="one MT-bench category only (as inference.bench)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat-draft", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--compile", default="on", choices=["on", "off", "auto"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    # what inference.bench's loaders read: the head from --draft, pruned to --draft-vocab
    args.methods, args.draft_model, args.vocab_corpus = "speculative", None, None

    from inference.bench import load_drafts, load_target_and_prompts

    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, tokenizer, prompts = load_target_and_prompts(args, device, dtype)
    head = load_drafts(args, model, tokenizer)[0]
    generators = {
        "engine_plain": SpeculativeGenerator.from_pretrained(model, None, tokenizer=tokenizer, tree="none",
                                                             compile=args.compile),
        "speculative": SpeculativeGenerator.from_pretrained(model, head, tokenizer=tokenizer, tree=args.tree,
                                                            compile=args.compile),
    }
    longest = max(p.shape[1] for p in prompts) + args.max_new_tokens
    start = time.perf_counter()
    for generator in generators.values():  # compiles happen here, outside the timed rounds
        generator.warmup(longest)
        generator.generate(prompts[0], max_new_tokens=8)
    warmup_s = time.perf_counter() - start
    result = measure(generators, prompts, args.max_new_tokens, args.rounds, args.repeat_draft)
    result.update(target=args.target, draft=args.draft, draft_vocab=args.draft_vocab, tree=args.tree,
                  dtype=str(dtype).replace("torch.", ""), device=str(device), cpu_flags=cpu_flags(),
                  prompts=len(prompts), max_new_tokens=args.max_new_tokens, warmup_s=warmup_s)
    for i, summary in enumerate(result["rounds"]):
        for name, row in summary.items():
            print(f"round {i} {name}: {row['tokens_per_s']:.1f} tokens/s, tau {row['tau']:.2f}, "
                  f"{row['loop_ms_per_step']:.2f} ms a step {row['ms_per_step']}")
    if args.out is not None:
        atomic_write_json(args.out, {k: v for k, v in result.items() if k != "sequences"})
    return result


if __name__ == "__main__":
    main()
