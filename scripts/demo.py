"""`make demo`: the whole product on the default target (SmolLM2-135M-Instruct), end to end, on this machine.

fetch assets -> prepare a ShareGPT subset -> collect target features -> train an EAGLE-3 head with
`accelerate launch` + DeepSpeed (ZeRO-2; bf16 where the CPU has native bf16, else fp32) -> export + validate for vLLM/SGLang -> benchmark on MT-bench
prompts against plain `generate` and prompt-lookup decoding -> print tau and speedup.

Every step is a plain command (printed before it runs) that resumes or skips when its output already exists, so
re-running `make demo` after an interruption continues where it stopped. Outputs go to $RUN_DIR (runs/demo).
Sizes can be changed through environment variables (DEMO_CONVERSATIONS, DEMO_STEPS, DEMO_PROMPTS, ...).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from drafthead.hardware import cpu_has_bf16  # noqa: E402
from drafthead.paths import cache_dir  # noqa: E402
PY = sys.executable
RECIPE = "configs/smollm2-135m-eagle3.yaml"


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def run(cmd: list[str], env: dict | None = None) -> None:
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})})
    if result.returncode != 0:
        sys.exit(f"demo step failed (exit {result.returncode}): {shlex.join(cmd)}")
    print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)


def main() -> None:
    run_dir = Path(os.environ.get("RUN_DIR", "runs/demo"))
    target = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    # bf16 where the CPU multiplies it natively; on AVX2-only CPUs bf16 is emulated and ~8x slower than fp32
    precision = os.environ.get("DEMO_PRECISION") or ("bf16" if cpu_has_bf16() else "fp32")
    device = os.environ.get("DEMO_DEVICE", "cpu")
    overrides = [
        f"device={device}",
        f"run_dir={run_dir}",
        f"data.max_conversations={env_int('DEMO_CONVERSATIONS', 120)}",
        f"data.max_length={env_int('DEMO_MAX_LENGTH', 512)}",
        f"data.validation_fraction={os.environ.get('DEMO_VALIDATION_FRACTION', '0.1')}",
        f"train.output_dir={run_dir}/head",
        f"train.max_steps={env_int('DEMO_STEPS', 40)}",
        f"train.save_every={env_int('DEMO_SAVE_EVERY', 20)}",
        f"train.eval_every={env_int('DEMO_EVAL_EVERY', 20)}",
        f"train.eval_batches={env_int('DEMO_EVAL_BATCHES', 4)}",
        f"train.warmup_steps={env_int('DEMO_WARMUP', 5)}",
        f"train.lr={os.environ.get('DEMO_LR', '1e-3')}",
        f"train.batch_tokens={env_int('DEMO_BATCH_TOKENS', 2048)}",
        "train.grad_accum=1",
        f"train.max_length={env_int('DEMO_MAX_LENGTH', 512)}",
        f"train.ttt_steps={env_int('DEMO_TTT_STEPS', 3)}",
        f"train.mixed_precision={precision}",
        f"head.draft_vocab_size={env_int('DEMO_DRAFT_VOCAB', 4096)}",
    ]
    started = time.perf_counter()
    run([PY, "scripts/fetch_assets.py"])
    if not (run_dir / "prepared").exists():
        run([PY, "-m", "train.prepare", RECIPE, *overrides])
    run([PY, "-m", "train.collect", RECIPE, *overrides])
    accelerate = str(Path(PY).with_name("accelerate"))
    run([accelerate, "launch", "--config_file",
         os.environ.get("DEMO_ACCELERATE_CONFIG", "configs/accelerate/cpu_zero2.yaml"),
         "--num_processes", os.environ.get("DEMO_PROCESSES", "1"), "-m", "train", RECIPE, *overrides])
    export = run_dir / "export"
    run([PY, "-m", "drafthead.export", str(run_dir / "head" / "final"), str(export), "--format", "eagle3", "--force"])
    run([PY, "-m", "inference.bench", "--target", str(target), "--draft", str(export), "--prompts", "mt_bench",
         "--num-prompts", str(env_int("DEMO_PROMPTS", 6)), "--max-new-tokens", str(env_int("DEMO_NEW_TOKENS", 96)),
         "--calibration-prompts", str(env_int("DEMO_CALIBRATION_PROMPTS", 2)),
         "--calibration-tokens", str(env_int("DEMO_CALIBRATION_TOKENS", 64)), "--device", device,
         "--tree", "auto", "--compare-tree", "gpu", "--dtype", "fast", "--out", str(run_dir / "bench.json")])
    bench = json.loads((run_dir / "bench.json").read_text())
    minutes = (time.perf_counter() - started) / 60
    print("\n================ demo done ================")
    print(f"target          {target.name} (Q4_1, dequantized), {bench['dtype']} on {bench['device']}")
    print(f"head            {run_dir / 'head' / 'final'}  (training log: {run_dir / 'head' / 'log.jsonl'})")
    print(f"export          {export}  (validated for vLLM / SGLang)")
    chosen, branch = bench["tree"]["chosen"], bench["tree"].get("lookup_branch")
    if chosen == "none":  # a head trained for minutes may draft too little to pay on this machine
        chosen = "no tree (plain decoding measured faster than this head's trees here)" + \
            ("; prompt lookup alone, measured faster still" if branch else "")
    elif branch:
        chosen = f"{chosen} + the prompt-lookup branch (measured faster)"
    print(f"tree (auto)     {chosen}")
    print(f"tau             {bench['tau']:.2f} tokens per target forward (the tuned choice); "
          f"{bench.get('tau_gpu_tree', float('nan')):.2f} with the GPU default tree")
    print(f"engine plain    {bench['engine_plain_speedup']:.2f}x vs plain generate ({bench['runner']}, "
          f"compile {'on' if bench['compile'] else 'off'}: the runner alone, no drafting)")
    print(f"speedup         {bench['speedup']:.2f}x vs plain generate, "
          f"{bench['speedup_vs_engine_plain']:.2f}x vs the engine's own plain decoding, "
          f"{bench['speedup_vs_prompt_lookup']:.2f}x vs prompt lookup")
    div = bench["greedy_divergences"]
    print(f"lossless        {div['real_mismatch']} real mismatches with plain greedy: {bench['greedy_match']:.0%} of "
          f"the outputs equal it token for token, {div['near_tie']} part at an exact {bench['dtype']} near-tie of the "
          f"top-2 logits (a tree and a single token round apart), {div['float32_replay_match']} equal it once replayed "
          "in float32")
    print(f"results         {run_dir / 'bench.json'}, {run_dir / 'bench.png'}")
    print(f"total time      {minutes:.1f} min")


if __name__ == "__main__":
    main()
