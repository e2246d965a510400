"""Batch x context benchmark: plain batched decoding against self-speculation (StreamingLLM draft, MagicDec) and
EAGLE-head drafting with a full or a windowed KV, on long real prompts (long_context.py).

    python -m inference.bench --target T --draft HEAD --batch-size 8 --context 8192        # one cell
    python -m inference.bench --target T --draft HEAD --grid --contexts 2048,4096,8192 --batch-sizes 1,4,8,16

Each cell (context L, batch B) decodes at least `--prompts-per-cell` prompts of exactly L tokens, B at a time (with
`--continuous`, as one queue through B rows), each row `--max-new-tokens` without eos. Prompts are prefilled once
per context and every method decodes a copy of the same rows, `--repeats` times in turn, the median reported.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch

from drafthead import load_head
from drafthead.hardware import cpu_flags, resolve_device, resolve_dtype
from drafthead.utils import atomic_write_bytes, place_module

from ..decode import Request, prefilled_requests
from ..decode import decode as decode_rows
from ..drafter import PlainDrafter
from ..drafters.eagle import HeadDrafter
from ..drafters.lookup import LookupBranch
from ..drafters.self_draft import StreamingSelfDrafter
from ..loading import load_causal_lm
from ..runners.compile import compile_setting
from ..runners.static import StaticRunner
from ..sampling import SamplingParams
from ..stats import GenerationStats
from ..stopping import Stopper
from ..switch import SpeculationSwitch
from ..tree import tree_options
from ..tuning.draft_vocab import frequent_tokens
from .long_context import long_prompts

BATCH_METHODS = {
    "plain": "plain batched decoding on the batch runner (the baseline)",
    "self": "self-speculation: the target drafts gamma tokens with a sink + window KV (MagicDec)",
    "self_vocab": "the same, drafting only the --draft-vocab most frequent tokens (fewer lm_head rows a step)",
    "self_int8": "the same, drafting with an int8 copy of the target's weights (half the bytes a draft step reads)",
    "head": "EAGLE head trees, the head's KV over the whole context",
    "head_window": "EAGLE head trees, the head's KV windowed (sink + window)",
}
LOOKUP = "+lookup"  # a method's name + this: its trees with the prompt-lookup branch (drafters/lookup.py)
BATCH_METHODS.update({name + LOOKUP: f"{name}, plus the prompt-lookup branch (--lookup-tokens, --lookup-nodes)"
                      for name in ("self", "self_int8", "head", "head_window")})
AUTO = "_auto"  # a method's name + this: the same drafter, speculating only on the steps where it pays
BATCH_METHODS.update({name + AUTO: f"{name}, speculating only where its measured cost pays (switch.py)"
                      for name in ("self", "self_int8", "head", "head_window", "self_int8" + LOOKUP)})


def peak_rss_reset() -> None:
    """Reset the kernel's peak-RSS mark of this process (Linux: /proc/self/clear_refs, 5)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mb() -> float | None:
    """Peak resident memory since the last reset, MB (Linux VmHWM), or None where unavailable."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def make_drafters(args, model, head, tokenizer=None) -> dict:
    """The methods' batched drafters by name."""
    options = tree_options(args.tree)
    streaming = dict(sink=args.sink, window=args.window, gamma=args.gamma, compile=args.compile)
    drafters = {"plain": PlainDrafter(), "self": StreamingSelfDrafter(model, **streaming)}
    if "self_vocab" in args.batch_methods:
        if not isinstance(args.draft_vocab, int):
            raise SystemExit("--batch-methods self_vocab needs --draft-vocab N (a number of tokens)")
        drafters["self_vocab"] = StreamingSelfDrafter(model, **streaming, vocab=frequent_tokens(
            tokenizer, model.get_output_embeddings().weight.shape[0], args.draft_vocab, args.vocab_corpus))
    bases = {name.removesuffix(AUTO).removesuffix(LOOKUP) for name in args.batch_methods}
    if "self_int8" in bases:
        drafters["self_int8"] = StreamingSelfDrafter(model, **streaming, weights="int8")
    if head is not None:
        drafters["head"] = HeadDrafter(head, options)
        drafters["head_window"] = HeadDrafter(head, options, sink=args.sink, window=args.window)
    for name in bases & set(drafters):  # the same drafter object: its state is set afresh by every begin()
        drafters[name + LOOKUP] = LookupBranch(drafters[name], args.lookup_tokens, args.lookup_nodes)
    return {name: drafters[name.removesuffix(AUTO)] for name in args.batch_methods
            if name.removesuffix(AUTO) in drafters}


def prefill_rows(runner: StaticRunner, prompts: list[list[int]], group: int = 4) -> tuple[list[Request], float]:
    """Prefill every prompt once, `group` rows at a time: (a Request per prompt, its stopper None; seconds)."""
    device = next(runner.model.parameters()).device
    t0 = time.perf_counter()
    with torch.inference_mode():
        rows = list(prefilled_requests(runner, [torch.tensor(p, device=device) for p in prompts], group, lambda: None))
    return rows, time.perf_counter() - t0


def run_group(runner: StaticRunner, drafters: dict, rows: list[Request], max_new: int, repeats: int = 1,
              waiting: list[Request] = ()) -> dict:
    """Decode one group of prefilled rows (prefill_rows) with every drafter, each from a fresh copy of their KV,
    `repeats` times in turn; a method's figures are its median run's. `waiting`: more rows, each taking the batch row
    that frees up first (continuous batching; its admission counts as decode time)."""
    ids = torch.stack([row.ids for row in rows])
    b = ids.shape[0]
    mask = torch.ones_like(ids)
    length = max(len(row.ids) for row in [*rows, *waiting]) + max_new + max(d.tree_size for d in drafters.values())
    features = torch.stack([row.features for row in rows]) if rows[0].features is not None else None
    prefilled = (torch.stack([row.logits for row in rows]), features)
    out = {}

    def decode(name, drafter, new_tokens: int) -> tuple[list[list[int]], GenerationStats, float]:
        runner.reset(b, length)  # the same buffers, the group's prefilled rows copied in afresh
        for i, row in enumerate(rows):
            runner.admit(i, row.kv)
        stats = GenerationStats()
        stop = lambda: Stopper(set(), [], None, new_tokens)  # noqa: E731
        stoppers = [stop() for _ in range(b)]
        queue = (dataclasses.replace(row, stopper=stop()) for row in waiting)
        t0 = time.perf_counter()
        with runner.session(), torch.inference_mode():
            new = decode_rows(runner, drafter, ids, mask, SamplingParams(), stoppers, None, stats,
                              prefilled=prefilled, waiting=queue if waiting else None,
                              switch=SpeculationSwitch() if name.endswith(AUTO) else None)
        return new, stats, time.perf_counter() - t0

    for name, drafter in drafters.items():  # warm-up of two steps (a compiled drafter compiles here), timed apart
        out[name] = dict(warmup_s=decode(name, drafter, 2 * drafter.tree_size)[2], runs=[])
    for _ in range(repeats):  # the methods take turns, so a slow spell of a shared machine hits them alike
        for name, drafter in drafters.items():
            new, stats, total = decode(name, drafter, max_new)
            out[name]["runs"].append(dict(rows=new, decode_s=total - stats.prefill_time_s, stats=stats))
    for result in out.values():
        runs = sorted(result.pop("runs"), key=lambda r: r["decode_s"])
        result.update(runs[(len(runs) - 1) // 2], decode_s_runs=[round(r["decode_s"], 3) for r in runs])
    return out


def summarise_cell(groups: list[dict], names: list[str], b: int, context: int) -> dict:
    """Per-method figures of one cell from its groups; greedy rows compared with plain decoding."""
    def total(stats: list[GenerationStats], field: str) -> float:
        return sum(getattr(s, field) for s in stats)

    cell = {"context": context, "batch": b, "prompts": sum(len(g[names[0]]["rows"]) for g in groups), "methods": {}}
    for name in names:
        runs = [g[name] for g in groups]
        stats = [g["stats"] for g in runs]
        tokens = sum(len(r) for g in runs for r in g["rows"])
        decode_s = sum(g["decode_s"] for g in runs)
        steps = total(stats, "target_forwards") - len(stats)  # (the prefill of each group is no step)
        accept = [a for s in stats for a in s.accept_lengths]
        busy_steps, busy_s = total(stats, "busy_steps"), total(stats, "busy_time_s")
        m = dict(tokens=tokens, decode_s=round(decode_s, 3), tokens_per_s=tokens / decode_s,
                 tau=sum(accept) / max(len(accept), 1), steps=steps,
                 row_steps_mean=sum(sum(s.rows_steps) / b for s in stats),  # the steps a row needed, on average
                 admit_s=round(total(stats, "admit_time_s"), 3),
                 plain_steps=total(stats, "plain_steps"),  # the _auto methods' steps without drafts
                 step_ms=1000 * decode_s / max(steps, 1),
                 draft_ms_per_step=1000 * total(stats, "draft_time_s") / max(steps, 1),
                 verify_ms_per_step=1000 * total(stats, "verify_time_s") / max(steps, 1),
                 begin_s=total(stats, "prefill_time_s"), warmup_s=round(sum(g["warmup_s"] for g in runs), 2),
                 decode_s_runs=[round(sum(x), 3) for x in zip(*(g["decode_s_runs"] for g in runs))],
                 # the steps with every row decoding (as MagicDec counts a full batch): tokens_per_s adds the tail
                 busy_steps=busy_steps, busy_tokens_per_s=total(stats, "busy_tokens") / max(busy_s, 1e-9),
                 busy_step_ms=1000 * busy_s / max(busy_steps, 1))
        if name.removesuffix(AUTO).endswith(LOOKUP):
            m["lookup_proposed"] = sum(s.drafted_by.get("prompt_lookup", 0) for s in stats)
            m["lookup_accepted"] = sum(s.accepted_by.get("prompt_lookup", 0) for s in stats)
        if name != "plain" and "plain" in names:
            m["greedy_match"] = all(r == p for g in groups for r, p in zip(g[name]["rows"], g["plain"]["rows"]))
        cell["methods"][name] = m
    if "plain" in names:
        plain = cell["methods"]["plain"]
        for m in cell["methods"].values():
            m["speedup"] = m["tokens_per_s"] / plain["tokens_per_s"]
            m["busy_speedup"] = m["busy_tokens_per_s"] / plain["busy_tokens_per_s"]
    return cell


def load_target(args: argparse.Namespace) -> tuple[torch.nn.Module, Any, torch.device, torch.dtype]:
    """Both modes' target on --device in --dtype, its tokenizer, device, dtype (--threads set, --compile resolved)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, tokenizer = load_causal_lm(args.target, dtype, what="target")
    args.compile = compile_setting(args.compile, device)
    return place_module(model, device, dtype).eval(), tokenizer, device, dtype


def run_batch_bench(args: argparse.Namespace, on_cell=None) -> dict:
    """Every (context, batch) cell of the grid, or the one cell asked for; `on_cell(result)` after each."""
    model, tokenizer, device, dtype = load_target(args)
    head = load_head(args.draft, target=model, device=device, dtype=dtype) if args.draft else None
    drafters = make_drafters(args, model, head, tokenizer)
    names = list(drafters)
    runner = StaticRunner(model, next((d.feature_layers for d in drafters.values() if d.feature_layers), []),
                          compile=args.compile)
    result = {"target": str(args.target), "draft": str(args.draft), "device": str(device), "dtype": str(dtype),
              "cpu_flags": cpu_flags(), "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
              "tree": str(tree_options(args.tree)), "compile": args.compile, "sink": args.sink, "window": args.window,
              "gamma": args.gamma, "repeats": args.repeats, "continuous": args.continuous,
              "lookup_tokens": args.lookup_tokens, "lookup_nodes": args.lookup_nodes,
              "draft_vocab": args.draft_vocab if "self_vocab" in names else None,
              "methods": {n: BATCH_METHODS[n] for n in names}, "cells": []}
    for context in args.contexts:
        distinct = max(args.batch_sizes) if args.continuous else max(max(args.batch_sizes), args.prompts_per_cell)
        rows, seconds = prefill_rows(runner, long_prompts(tokenizer, context, distinct, task=args.task))
        result.setdefault("prefill", {})[str(context)] = {"prompts": len(rows), "seconds": round(seconds, 1),
                                                          "tokens_per_s": len(rows) * context / seconds}
        print(f"context {context}: prefilled {len(rows)} prompts in {seconds:.0f} s", flush=True)
        for b in args.batch_sizes:
            peak_rss_reset()
            if args.continuous:  # one queue of requests through b rows
                queue = [rows[i % len(rows)] for i in range(max(args.prompts_per_cell, b))]
                groups = [run_group(runner, drafters, queue[:b], args.max_new_tokens, args.repeats, queue[b:])]
            else:
                groups = [run_group(runner, drafters, [rows[(g * b + i) % len(rows)] for i in range(b)],
                                    args.max_new_tokens, args.repeats)
                          for g in range(math.ceil(args.prompts_per_cell / b))]
            cell = summarise_cell(groups, names, b, context)
            cell["peak_rss_mb"] = peak_rss_mb()  # the cell's batch buffers, its snapshot and every stored row
            result["cells"].append(cell)
            line = "  ".join(f"{n} {m['tokens_per_s']:.1f} tok/s x{m.get('speedup', 1):.2f} tau {m['tau']:.2f} "
                             f"(all rows busy: x{m.get('busy_speedup', 1):.2f})" for n, m in cell["methods"].items())
            print(f"context {context} batch {b}: {line}", flush=True)
            if on_cell is not None:
                on_cell(result)
        del rows
    return result


def plot_grid(result: dict, path: Path) -> None:
    """Speedup over plain batching vs batch size: a panel per method, a line per context (dotted: every row busy)."""
    from matplotlib.figure import Figure  # no pyplot: nothing needs a display or keeps the figure alive

    names = [n for n in result["methods"] if n != "plain"]
    contexts = sorted({c["context"] for c in result["cells"]})
    fig = Figure(figsize=(4.2 * len(names), 3.6), layout="tight")
    axes = fig.subplots(1, len(names), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], names):
        for context in contexts:
            cells = sorted((c for c in result["cells"] if c["context"] == context), key=lambda c: c["batch"])
            batches = [c["batch"] for c in cells]
            line, = ax.plot(batches, [c["methods"][name]["speedup"] for c in cells], marker="o",
                            label=f"{context // 1024}k context")
            busy = [c["methods"][name].get("busy_speedup") for c in cells]
            if None not in busy:
                ax.plot(batches, busy, ls=":", marker=".", color=line.get_color())
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set(title=name, xlabel="batch size")
    axes[0][0].set_ylabel("speedup over plain batched decoding")
    axes[0][-1].legend()
    fig.suptitle(f"{Path(result['target']).name}, {result['dtype']}, {result['max_new_tokens']} new tokens "
                 "(dotted: while every row of the batch is busy)")
    atomic_write_bytes(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The batch/long-context options of inference.bench."""
    g = p.add_argument_group("batch x context (with --grid, --batch-size or --context)")
    g.add_argument("--grid", action="store_true", help="every --contexts x --batch-sizes cell")
    g.add_argument("--batch-size", type=int, default=None, help="one cell: this batch size")
    g.add_argument("--context", type=int, default=None, help="one cell: prompts of exactly this many tokens")
    g.add_argument("--contexts", default="2048,4096,8192")
    g.add_argument("--batch-sizes", default="1,4,8,16")
    g.add_argument("--prompts-per-cell", type=int, default=4)
    g.add_argument("--continuous", action="store_true",
                   help="continuous batching: the cell's --prompts-per-cell requests (the largest batch's distinct "
                        "prompts, repeated) flow through B rows, each row taking the next request as it finishes")
    g.add_argument("--batch-methods", default="plain,self,head,head_window",
                   help="comma list of: " + "; ".join(f"{k}: {v}" for k, v in BATCH_METHODS.items()))
    g.add_argument("--sink", type=int, default=4, help="attention-sink positions of a streaming draft KV")
    g.add_argument("--window", type=int, default=512, help="recent positions of a streaming draft KV")
    g.add_argument("--lookup-tokens", type=int, default=4,
                   help="the +lookup methods: tokens of each row's prompt-lookup chain")
    g.add_argument("--lookup-nodes", type=int, default=1, help="the +lookup methods: at most this many of the chain's "
                   "tokens added to each row's tree, which grows by this many")
    g.add_argument("--task", default="continue", choices=["continue", "summarise"])
    g.add_argument("--repeats", type=int, default=1,
                   help="decode each batch this many times, the methods in turn; report each method's median run")


def normalise(args: argparse.Namespace) -> argparse.Namespace:
    """Parse the grid's lists; one cell when --batch-size/--context are given without --grid."""
    args.contexts = [args.context] if args.context and not args.grid else [int(x) for x in args.contexts.split(",")]
    args.batch_sizes = ([args.batch_size] if args.batch_size and not args.grid
                        else [int(x) for x in args.batch_sizes.split(",")])
    args.batch_methods = [m.strip() for m in args.batch_methods.split(",") if m.strip()]
    unknown = sorted(set(args.batch_methods) - set(BATCH_METHODS))
    if unknown:
        raise SystemExit(f"unknown batch methods {unknown}; choose from {sorted(BATCH_METHODS)}")
    if args.tree == "auto":
        args.tree = "3,2,4"
    return args
