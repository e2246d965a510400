"""Benchmark speculative decoding against plain `generate` and prompt-lookup decoding, in one run.

    python -m inference.bench --target PATH --draft PATH --prompts mt_bench [--temperature 0] [--tree auto]
        [--compare-tree gpu] [--num-prompts 80] [--max-new-tokens 128] [--dtype bfloat16] --out bench.json

Spec-Bench conventions: batch 1, the target's chat template, warm-up runs, wall time of the whole generate call
(prefill included), methods interleaved prompt by prompt so drift hits all alike. speedup = mean tokens/s of a
method / that of plain transformers `generate`. A greedy divergence from plain decoding is a near tie
(inference.bench.ties) or a real mismatch. Writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import os
import platform
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from drafthead import DraftHead
from drafthead.hardware import cpu_flags
from drafthead.paths import cache_dir
from drafthead.utils import atomic_write_bytes, atomic_write_json, dtype_name

from ..cpu.small_gemm import DRAFT_WEIGHTS
from ..drafters.draft_model import DraftModelDrafter, load_draft_model
from ..drafters.lookup import prompt_lookup
from ..engine import SpeculativeGenerator
from ..jsonl import iter_jsonl
from ..runners import make_runner
from ..stats import accept_histogram
from ..tree import TreeOptions, tree_options
from ..tuning.budget import auto_tree, choose_draft_vocab
from ..tuning.draft_vocab import (AUTO_SIZES, AUTO_TUNING_SIZE, assistant_token_counts, default_corpus,
                                  parse_draft_vocab, vocab_candidates)
from . import batch as batch_bench
from .long_context import chat_token_ids
from .ties import explain_divergence


def load_prompts(spec: str, limit: int | None, category: str | None = None) -> list[str]:
    """First turns of 'mt_bench' (asset cache) or a JSONL file's `turns`/`prompt`/`messages`; of `category` if given."""
    path = cache_dir() / "data" / "mt_bench.jsonl" if spec == "mt_bench" else Path(spec)
    if spec == "mt_bench" and not path.exists():
        raise SystemExit(f"{path} missing: run `python scripts/fetch_assets.py`")
    prompts = []
    for n, row in iter_jsonl(path):
        if category is not None and row.get("category") != category:
            continue
        turn = (row["turns"][0] if "turns" in row else row.get("prompt") or
                next((m["content"] for m in row.get("messages", []) if m["role"] == "user"), None))
        if turn is None:
            raise SystemExit(f"{path}:{n}: expected a 'turns', 'prompt' or 'messages' field")
        prompts.append(turn)
    return prompts[:limit] if limit else prompts


def chat_ids(tokenizer: Any, prompt: str, device: torch.device) -> torch.Tensor:
    """(1, T) ids of one user turn after the chat template (long_context.chat_token_ids)."""
    return torch.tensor([chat_token_ids(tokenizer, prompt)], device=device)


class Method:
    """One decoding method: build(target, head) -> run, (input_ids) -> (new tokens, stats | None); build is kept to
    replay a divergence on a float32 copy of the target."""

    def __init__(self, name: str, build, model, head, depth: int | None = None):
        self.name, self.build, self.depth = name, build, depth  # depth: the tree depth of a speculative method
        self.run = build(model, head)
        self.generator: SpeculativeGenerator | None = getattr(self.run, "generator", None)  # engine methods
        self.rows: list[dict] = []


def plain_method(model, max_new_tokens: int, eos, temperature: float = 0.0, seed: int = 0, **extra) -> Any:
    """transformers' generate: greedy, or sampling with generate's default processing made explicit (top-k 50,
    top-p 1, no repetition penalty: what the engine applies), seeded per call like the engine."""
    sampling = dict(do_sample=True, temperature=temperature, top_k=50, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)

    def run(ids):
        if temperature > 0:
            torch.manual_seed(seed)
        out = model.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=eos, repetition_penalty=1.0,
                             pad_token_id=eos[0] if isinstance(eos, list) else eos, **sampling, **extra)
        return out[0, ids.shape[1]:].tolist(), None

    return run


def spec_method(gen: SpeculativeGenerator, max_new_tokens: int, temperature: float, eos, seed: int) -> Any:
    def run(ids):
        out = gen.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, eos_token_id=eos,
                           seed=seed if temperature > 0 else None)
        return out.sequences[0, ids.shape[1]:].tolist(), out.stats

    run.generator = gen
    return run


def summarise(method: Method, plain_tps: float | None) -> dict:
    rows, depth = method.rows, method.depth
    tps = [r["tokens_per_s"] for r in rows]
    summary = {"tokens_per_s": statistics.fmean(tps), "tokens_per_s_median": statistics.median(tps),
               "new_tokens": sum(r["new_tokens"] for r in rows), "wall_s": sum(r["wall_s"] for r in rows)}
    if plain_tps:
        summary["speedup"] = summary["tokens_per_s"] / plain_tps
    stats = [r["stats"] for r in rows if r.get("stats")]
    if stats:
        lengths = [n for s in stats for n in s["accept_lengths"]]
        steps = max(len(lengths), 1)
        summary["tau"] = sum(lengths) / steps
        summary["accept_histogram"] = accept_histogram(lengths)
        # acceptance by depth: share of steps whose accepted draft (bonus excluded) reaches depth d
        summary["acceptance_by_depth"] = [sum(n - 1 >= d for n in lengths) / steps for d in range(1, (depth or 0) + 1)]
        drafted, accepted = Counter(), Counter()
        for s in stats:
            drafted.update(s.get("drafted_by", {}))
            accepted.update(s.get("accepted_by", {}))
        if drafted:  # per drafter: share of its proposed nodes accepted, and accepted tokens per step
            summary["acceptance_by_drafter"] = {k: accepted[k] / max(drafted[k], 1) for k in drafted}
            summary["accepted_per_step_by_drafter"] = {k: accepted[k] / steps for k in drafted}
        draft_s, verify_s, prefill_s, total_s = (sum(s[f"{part}_time_s"] for s in stats)
                                                  for part in ("draft", "verify", "prefill", "total"))
        summary["ms_per_step"] = {"draft": 1000 * draft_s / steps, "verify": 1000 * verify_s / steps,
                                  "overhead": 1000 * (total_s - prefill_s - draft_s - verify_s) / steps}
        summary["prefill_ms_per_prompt"] = 1000 * prefill_s / max(len(stats), 1)
    return summary


def choose_tree(args, model, head, tokenizer, inputs, runner,
                vocab_heads: dict | None = None) -> tuple[TreeOptions | None, dict, Any]:
    """(tree of the main speculative method, its JSON, the head to draft it with): a preset, or `auto` (tuned here;
    None when plain decoding measured fastest); with `--draft-vocab auto`, the head of the fastest vocabulary."""
    calib = inputs[: args.calibration_prompts]
    if args.prompts == "mt_bench":  # the last MT-bench prompts (in an 80-prompt run they are also measured)
        calib = [chat_ids(tokenizer, p, inputs[0].device)
                 for p in load_prompts("mt_bench", None)[-args.calibration_prompts:]]
    if args.tree != "auto":
        options = tree_options(args.tree)
        info = {"chosen": dataclasses.asdict(options)}
        if vocab_heads:
            generator = functools.partial(SpeculativeGenerator, draft_weights=args.draft_weights)
            head, info["draft_vocab"] = choose_draft_vocab(model, vocab_heads, runner, options, calib,
                                                           args.calibration_tokens, generator=generator)
        return options, info, head
    options, report = auto_tree(model, head, calib, max_new_tokens=args.calibration_tokens, runner=runner,
                                lookup_tokens=args.hybrid_tokens if args.auto_lookup else 0, vocab_heads=vocab_heads,
                                generator=SpeculativeGenerator, draft_weights=args.draft_weights)
    if report["draft_vocab"]:
        head = vocab_heads[report["draft_vocab"]["chosen"]]
    lookup = bool(report["lookup_branch"] and report["lookup_branch"]["chosen"])
    info = {"auto": report, "chosen": dataclasses.asdict(options) if options else "none", "lookup_branch": lookup}
    if lookup:  # what the largest verify bucket leaves beside the tree, at most --hybrid-tokens
        info["lookup_tokens"] = report["lookup_branch"]["tokens"]
    return options, info, head


METHODS = {"plain": "transformers generate (the baseline; always measured, first)",
           "prompt_lookup": "transformers generate with prompt_lookup_num_tokens=--pld-tokens",
           "engine_plain": "the engine's own plain decoding on the same runner (tree='none')",
           "speculative": "the head's dynamic tree (--tree), named speculative_<tree>",
           "full_vocab": "with --draft-vocab: the unpruned head on the same tree",
           "compare": "the head with each --compare-tree preset",
           "engine_prompt_lookup": "the engine with the prompt-lookup drafter (--pld-tokens)",
           "hybrid": "the head's tree plus the prompt-lookup branch (--hybrid-tokens)",
           "tree_alone": "where --tree auto added the lookup branch: the same tree without it",
           "draft_model": "a smaller LM drafting chains of --gamma tokens (--draft-model)",
           "api_default": "SpeculativeGenerator.from_pretrained(--target, --draft) with no other argument: the "
                          "library's defaults as a user gets them (its own copy of the target; tree='auto' tuned "
                          "once and cached)"}
DEFAULT_METHODS = "plain,prompt_lookup,engine_plain,speculative,tree_alone,full_vocab,compare"


def parse_methods(spec: str) -> list[str]:
    """--methods: a comma list of METHODS keys; plain always comes first."""
    names = [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown --methods {unknown}; choose from {', '.join(METHODS)}")
    return ["plain"] + [m for m in dict.fromkeys(names) if m != "plain"]


def build_methods(args, model, head, tokenizer, eos, runner, options: TreeOptions | None, tree_info: dict,
                  full_head=None, draft_model=None) -> list[Method]:
    """The methods named by --methods (see METHODS). Engine methods share one runner (KV buffers, compiled graphs);
    a float32 replay builds them afresh on the reference model."""
    wanted = parse_methods(args.methods)

    def engine(tree: str | TreeOptions | None, drafter=None, **extra):
        def build(target, draft):
            own = target is model
            if drafter is not None:
                draft = drafter(target, own)
            weights = args.draft_weights if isinstance(draft, DraftHead) else "auto"
            gen = SpeculativeGenerator(target, draft, tokenizer, tree=tree or "none", runner=runner if own else "auto",
                                       compile=args.compile if own else False, draft_weights=weights, **extra)
            return spec_method(gen, args.max_new_tokens, args.temperature, eos, args.seed)

        return build

    def hf(**extra):
        return lambda target, _: plain_method(target, args.max_new_tokens, eos, args.temperature, args.seed, **extra)

    def small_model(target, own):
        small = draft_model if own else copy.deepcopy(draft_model).float()
        return DraftModelDrafter(small, target.config.get_text_config(decoder=True).vocab_size, gamma=args.gamma,
                                 runner=args.runner if own else "auto", compile=args.compile and own)

    methods = [Method("plain", hf(), model, head)]
    if "prompt_lookup" in wanted and not args.no_pld:
        methods.append(Method("prompt_lookup", hf(prompt_lookup_num_tokens=args.pld_tokens), model, head))
    if "engine_plain" in wanted:
        methods.append(Method("engine_plain", engine(None), model, head))
    if "speculative" in wanted:  # options None: the tuner chose plain decoding
        tokens = tree_info.get("lookup_tokens", args.hybrid_tokens)
        branch = dict(hybrid=True, lookup_tokens=tokens) if tree_info.get("lookup_branch") else {}
        depth = max(options.depth if options else 0, tokens if branch else 0)  # branch alone: prompt lookup
        methods.append(Method(f"speculative_{args.tree}", engine(options, **branch), model, head, depth))
        if "tree_alone" in wanted and branch and options is not None:
            methods.append(Method("tree_alone", engine(options), model, head, options.depth))
        if "full_vocab" in wanted and full_head is not None and options is not None:
            methods.append(Method("speculative_full_vocab", engine(options, **branch), model, full_head, depth))
    if "compare" in wanted:
        for name in [t for t in (args.compare_tree or []) if t != args.tree]:
            methods.append(Method(f"speculative_{name}", engine(name), model, head, tree_options(name).depth))
    if "engine_prompt_lookup" in wanted:
        lookup = lambda target, own: prompt_lookup(args.pld_tokens)  # noqa: E731
        methods.append(Method("engine_prompt_lookup", engine("lookup", lookup), model, head, args.pld_tokens))
    if "hybrid" in wanted:
        hybrid_tree = options or tree_options("cpu")
        methods.append(Method("hybrid", engine(hybrid_tree, hybrid=True, lookup_tokens=args.hybrid_tokens),
                              model, head, max(hybrid_tree.depth, args.hybrid_tokens)))
    if "draft_model" in wanted:
        methods.append(Method("draft_model", engine("draft", small_model), model, head, args.gamma))
    if "api_default" in wanted:
        def api_default(target, draft):  # a float32 replay passes the reference target and head instead
            gen = SpeculativeGenerator.from_pretrained(args.target, args.draft) if target is model else \
                SpeculativeGenerator.from_pretrained(target, draft, tokenizer=tokenizer)
            return spec_method(gen, args.max_new_tokens, args.temperature, eos, args.seed)

        api = Method("api_default", api_default, model, head)
        api.depth = api.generator.options.depth if api.generator.options else 0  # the tree it tuned
        methods.append(api)
    return methods


def warm_up(methods: list[Method], inputs: list[torch.Tensor], args) -> dict:
    """Size the engine's buffers for the longest prompt and run every method --warmup times; returns the engines'
    one-time compile times, reported apart from the prompts."""
    longest = max(ids.shape[1] for ids in inputs) + args.max_new_tokens
    compile_s = {}
    for m in methods:
        if m.generator is not None:
            start = time.perf_counter()
            per_bucket = m.generator.warmup(longest)
            compile_s[m.name] = {"total": time.perf_counter() - start, "first_verify_per_bucket": per_bucket}
    for _ in range(args.warmup):
        for m in methods:
            m.run(inputs[0][:, :64])
    return compile_s


def load_drafts(args, model, tokenizer) -> tuple[Any, Any, Any, dict | None]:
    """(head, unpruned head, draft model, {size: head} vocabulary candidates) as the methods need them. The head is
    pruned to --draft-vocab; with `auto`, to AUTO_TUNING_SIZE (else the smallest size) while the tree is tuned."""
    wanted = set(parse_methods(args.methods))
    head = full_head = draft_model = vocab_heads = None
    if wanted & {"speculative", "compare", "hybrid"}:
        if args.draft is None:
            raise SystemExit("--methods speculative/compare/hybrid need a head: pass --draft HEAD_FOLDER")
        head = full_head = SpeculativeGenerator.from_pretrained(model, args.draft, tokenizer=tokenizer, tree="cpu").head
        if args.draft_vocab:
            counts = assistant_token_counts(tokenizer, args.vocab_corpus or default_corpus(), head.config.vocab_size)
            if args.draft_vocab == "auto":
                vocab_heads = vocab_candidates(head, counts, args.vocab_sizes)
                head = vocab_heads[AUTO_TUNING_SIZE if AUTO_TUNING_SIZE in vocab_heads else min(vocab_heads)]
            else:
                head = head.pruned(counts, args.draft_vocab)
    if "draft_model" in wanted:
        if args.draft_model is None:
            raise SystemExit("--methods draft_model needs --draft-model MODEL_FOLDER")
        draft_model = load_draft_model(args.draft_model, model, tokenizer)
    return head, full_head, draft_model, vocab_heads


def run_bench(args: argparse.Namespace, on_prompt=None) -> dict:
    """Every method on every prompt, interleaved (plain first: the greedy reference); `on_prompt(result)` gets the
    summary so far after each prompt, so a killed run keeps what it measured."""
    from tqdm import tqdm

    model, tokenizer, device, dtype = batch_bench.load_target(args)
    if tokenizer is None:
        raise SystemExit(f"no tokenizer in {args.target}: the prompts need the target's chat template")
    prompts = load_prompts(args.prompts, args.num_prompts, args.category)
    if not prompts:
        raise SystemExit(f"no prompts in {args.prompts}" + (f" of category {args.category!r}" if args.category else ""))
    inputs = [chat_ids(tokenizer, p, device) for p in prompts]
    head, full_head, draft_model, vocab_heads = load_drafts(args, model, tokenizer)
    runner = make_runner(model, head.config.aux_layer_ids if head is not None else [], args.runner, args.compile)
    tree_start = time.perf_counter()
    options, tree_info = None, {}
    if head is not None:
        options, tree_info, head = choose_tree(args, model, head, tokenizer, inputs, runner, vocab_heads)
    tree_info["tuning_s"] = time.perf_counter() - tree_start
    methods = build_methods(args, model, head, tokenizer, model.generation_config.eos_token_id, runner, options,
                            tree_info, full_head if full_head is not head else None, draft_model)
    setup = {"draft_vocab": head.config.draft_vocab_size if head is not None and args.draft_vocab else None,
             "runner": type(runner).__name__, "compile": args.compile, "warmup_s": warm_up(methods, inputs, args),
             "tree": tree_info}
    divergences = DivergenceLog(model, head, dtype, methods[0])
    result = {}
    for i, ids in enumerate(tqdm(inputs, desc="bench", unit="prompt")):
        for m in methods:
            start = time.perf_counter()
            tokens, stats = m.run(ids)
            wall = time.perf_counter() - start
            row = {"prompt": i, "new_tokens": len(tokens), "wall_s": wall, "tokens_per_s": len(tokens) / wall}
            if stats is not None:
                row["stats"] = stats.to_dict()
            if m.name == "plain":
                plain_tokens = tokens
            elif args.temperature == 0:
                row["greedy_match"] = tokens == plain_tokens
                if tokens != plain_tokens:
                    divergences.add(i, ids, m, tokens, plain_tokens)
            m.rows.append(row)
        result = assemble(args, device, dtype, inputs[: i + 1], methods, divergences.mismatches, setup)
        if on_prompt is not None:
            on_prompt(result)
    return result


class DivergenceLog:
    """Greedy divergences from plain decoding, classified (ties.py); one that is no near-tie is replayed with both
    methods on float32 copies of target and head, made at the first need."""

    def __init__(self, model, head, dtype: torch.dtype, plain: Method):
        self.model, self.head, self.dtype, self.plain = model, head, dtype, plain
        self.reference = self.reference_head = None
        self.mismatches: list[dict] = []

    def add(self, i: int, ids: torch.Tensor, method: Method, tokens: list[int], plain_tokens: list[int]) -> None:
        if self.reference is None and self.dtype != torch.float32:
            self.reference = torch.nn.Module.float(copy.deepcopy(self.model))  # transformers' float() refuses GGUF
            if self.head is not None:
                self.reference_head = copy.deepcopy(self.head).float().attach_target(self.reference)
        prompt_ids = ids[0].tolist()
        div = explain_divergence(self.model, torch.tensor(prompt_ids + tokens), torch.tensor(prompt_ids + plain_tokens),
                                 reference=self.reference)
        if div is None:  # one output stopped early on an equal prefix
            return
        info = dataclasses.asdict(div)
        if not div.is_near_tie and self.reference is not None:
            replay = [x.build(self.reference, self.reference_head)(ids)[0] for x in (self.plain, method)]
            info["float32_replay_match"] = replay[0] == replay[1]
        self.mismatches.append({"method": method.name, "prompt": i, **info})


def assemble(args, device, dtype, inputs, methods: list[Method], mismatches: list[dict], setup: dict) -> dict:
    """The JSON of the run so far."""
    plain_tps = statistics.fmean(r["tokens_per_s"] for r in methods[0].rows)
    summaries = {m.name: summarise(m, plain_tps) for m in methods}
    main_name = f"speculative_{args.tree}"
    if main_name not in summaries:  # no head: the first drafting method
        main_name = next((m.name for m in methods if m.generator is not None and m.name != "engine_plain"),
                         "engine_plain" if "engine_plain" in summaries else "plain")
    tps = {name: s["tokens_per_s"] for name, s in summaries.items()}
    ratio = lambda a, b: tps[a] / tps[b] if a in tps and b in tps else None  # noqa: E731
    drafting = [m for m in methods if m.generator is not None and not m.generator.plain]  # every drafter's rows
    greedy_rows = [r for m in drafting for r in m.rows if "greedy_match" in r]
    near_ties = [x for x in mismatches if x["is_near_tie"]]
    replayed = [x for x in mismatches if x.get("float32_replay_match")]
    singles = [n for n in (f"speculative_{args.tree}", "engine_prompt_lookup") if n in summaries]
    best_single = max(singles, key=tps.get) if len(singles) == 2 else None
    return {"target": str(args.target), "draft": str(args.draft),
            "draft_model": str(args.draft_model) if args.draft_model else None,
            "methods_requested": args.methods, "draft_vocab_requested": args.draft_vocab,
            "device": str(device) if device.type != "cpu" else f"cpu ({platform.processor() or platform.machine()}, "
                                                                  f"{torch.get_num_threads()} threads)",
            "cpu_flags": cpu_flags(), "dtype": dtype_name(dtype), "draft_weights": args.draft_weights,
            "torch": torch.__version__, "tcmalloc": "tcmalloc" in os.environ.get("LD_PRELOAD", ""),
            "prompts": len(inputs), "prompts_planned": args.num_prompts,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, **setup,
            "main_method": main_name, "speedup": summaries[main_name].get("speedup", 1.0),
            "speedup_vs_engine_plain": ratio(main_name, "engine_plain"),
            "engine_plain_speedup": ratio("engine_plain", "plain"),
            "speedup_vs_prompt_lookup": ratio(main_name, "prompt_lookup"),
            "hybrid_vs_best_single": ratio("hybrid", best_single) if best_single else None,
            "best_single_drafter": best_single, "tau": summaries[main_name].get("tau"), "tokens_per_s": tps,
            "greedy_match": (sum(r["greedy_match"] for r in greedy_rows) / len(greedy_rows)) if greedy_rows else None,
            "greedy_divergences": {"near_tie": len(near_ties), "float32_replay_match": len(replayed),
                                   "real_mismatch": len(mismatches) - len(near_ties) - len(replayed),
                                   "details": mismatches},
            "methods": summaries, "per_prompt": {m.name: list(m.rows) for m in methods},
            **{f"tau_{name.removeprefix('speculative_')}_tree": s.get("tau") for name, s in summaries.items()
               if name.startswith("speculative_") and name != f"speculative_{args.tree}"}}


def plot(result: dict, path: Path) -> None:
    """Speedup per method and the accepted-length histogram of each speculative method."""
    from matplotlib.figure import Figure  # no pyplot: nothing needs a display or keeps the figure alive

    methods = result["methods"]
    fig = Figure(figsize=(11, 4), layout="tight")
    ax1, ax2 = fig.subplots(1, 2)
    ax1.bar(list(methods), [s.get("speedup", 1.0) for s in methods.values()], color="tab:blue")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_ylabel("speedup vs plain generate")
    ax1.set_title(f"{result['prompts']} prompts, {result['dtype']}, T={result['temperature']}")
    ax1.set_xticks(range(len(methods)), list(methods), rotation=30, ha="right")
    for name, s in methods.items():
        hist = s.get("accept_histogram")
        if hist:  # sorted by length (stats.accept_histogram)
            total = sum(hist.values())
            ax2.plot(list(hist), [n / total for n in hist.values()], marker="o", label=f"{name} (τ={s['tau']:.2f})")
    ax2.set(xlabel="tokens per verification (accepted + bonus)", ylabel="share of steps")
    ax2.legend()
    atomic_write_bytes(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m inference.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=None, help="head folder (native or exported), for the head's methods")
    p.add_argument("--draft-model", default=None, help="a smaller causal LM's folder sharing the target's "
                   "tokenizer, for --methods draft_model")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma list of: " + "; ".join(f"{k}: {v}" for k, v in METHODS.items()))
    p.add_argument("--gamma", type=int, default=4, help="draft-model chain length (self-speculation's too)")
    p.add_argument("--hybrid-tokens", type=int, default=6, help="prompt-lookup tokens in the hybrid tree")
    p.add_argument("--auto-lookup", action=argparse.BooleanOptionalAction, default=True,
                   help="with --tree auto: keep the prompt-lookup branch (--hybrid-tokens) if it measures as fast")
    p.add_argument("--prompts", default="mt_bench", help="mt_bench or a JSONL file")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--category", default=None, help="only prompts of this category (MT-bench: coding, math, ...)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tree", default="auto", help="auto (tuned for this hardware), a preset (cpu, gpu, chain) or "
                   "depth,top_k,total_tokens")
    p.add_argument("--compare-tree", nargs="*", default=["gpu"], help="extra tree presets measured in the same run")
    p.add_argument("--calibration-prompts", type=int, default=3)
    p.add_argument("--calibration-tokens", type=int, default=96)
    p.add_argument("--no-pld", action="store_true", help="skip the prompt_lookup (transformers) method")
    p.add_argument("--pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    p.add_argument("--draft-vocab", type=parse_draft_vocab, default=None,
                   help="prune the head's draft vocabulary to its N most frequent tokens; auto: keep the fastest "
                        "of a few sizes and the unpruned head on the chosen tree")
    p.add_argument("--vocab-sizes", type=lambda v: tuple(int(x) for x in v.split(",") if x.strip()),
                   default=AUTO_SIZES, help="with --draft-vocab auto: the pruned sizes tried besides the unpruned head "
                   f"(default {','.join(map(str, AUTO_SIZES))})")
    p.add_argument("--vocab-corpus", type=Path, default=None, help="JSONL conversations for --draft-vocab counts "
                   "(default: the ShareGPT asset)")
    p.add_argument("--runner", default="auto", choices=["auto", "static", "eager"],
                   help="the engine's target runner: static KV buffers (auto, where the architecture allows) or eager")
    p.add_argument("--compile", default="on", choices=["auto", "on", "off"],
                   help="torch.compile the engine's steps (auto: CUDA only); compile time is reported apart")
    p.add_argument("--device", default="auto", help="auto: CUDA when present, else the CPU")
    p.add_argument("--dtype", default="fast", help="fast: bf16 where the hardware has it, else float32")
    p.add_argument("--draft-weights", default="auto", choices=DRAFT_WEIGHTS,
                   help="the head's drafting weights: int8 copies (auto: where its weights are float32 on a CPU)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench.json"))
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default: next to --out)")
    batch_bench.add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> None:
    """`python -m inference.bench ...`; a user error (missing head or prompts file, mismatched head) is one line."""
    args = build_parser().parse_args(argv)
    grid = bool(args.grid or args.batch_size or args.context)  # the batch x context benchmark (batch.py)
    run, draw = (batch_bench.run_batch_bench, batch_bench.plot_grid) if grid else (run_bench, plot)
    result = run(batch_bench.normalise(args) if grid else args, functools.partial(atomic_write_json, args.out))
    draw(result, args.plot or args.out.with_suffix(".png"))
    if not grid:
        print(f"\n{result['prompts']} prompts, {result['dtype']} on {result['device']}")
        for name, s in result["methods"].items():
            extra = f"  tau {s['tau']:.2f}" if "tau" in s else ""
            print(f"  {name:24s} {s['tokens_per_s']:7.2f} tok/s  speedup {s.get('speedup', 1):.2f}x{extra}")
        div = result["greedy_divergences"]
        print(f"greedy match {result['greedy_match']}, divergences {div['near_tie']} near-tie / "
              f"{div['float32_replay_match']} identical when replayed in float32 / {div['real_mismatch']} real")
    print(f"wrote {args.out}")
