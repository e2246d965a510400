"""Training throughput (tokens/s), peak memory and data/sync overhead of the default recipe's head, on CPU or CUDA.

    python scripts/bench_train.py --out runs/bench_train.json [--device cpu|cuda --processes 1,2 --seq-len 1024
                                  --steps 4 --sequences 8 --loss-fraction 0.7 --set train.compile_loss=false]
    python scripts/bench_train.py --online --target TARGET --accelerate configs/accelerate/gpu_zero3.yaml \
        --processes 1 --recipe configs/smollm2-135m-eagle3-gpu.yaml --out runs/bench_train_zero3.json

Uses the real target (the recipe's, or --target: for the head's shape, embedding and output layer) and SYNTHETIC
data, so it measures the trainer's cost, not learning: offline, a small feature folder (random bf16 hidden states
of the right widths, random tokens); --online, prepared sequences of random tokens that the target turns into
features inside every step (train.online, as the GPU recipe trains). The loss mask covers the last
--loss-fraction of each sequence, as after a prompt.
Every run: EAGLE-3, draft vocab and max_length from the recipe, ttt_steps from
the recipe, bf16, batch_size 1 (one sequence of --seq-len tokens per micro-batch and rank), grad_accum 1.
The multi-process run is DeepSpeed ZeRO-2 through accelerate (gloo on CPU, NCCL on CUDA); --accelerate launches
every run through accelerate with the given config (e.g. ZeRO-3 on one GPU). Everything is read from
the trainer's debug report (ranks/rank-<r>.json), over the steps after the first: tokens/s is the median of all
ranks' tokens over the slowest rank's step time; features_fraction is the share of step time spent making the
batch's features (online: the target's forward), head_fraction the share in the head's forward, backward and
optimizer step, overhead_fraction the rest (data loading, host syncs, logging; device-synchronised timers);
step_seconds lists every step's time (slow steps show there); peak RSS and (on CUDA) peak allocated GPU memory are
the largest rank's. The JSON is rewritten after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TCMALLOC = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
            Path("/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")]


def synthetic_features(folder: Path, target_path: str, aux: list[int], hidden: int, vocab: int, n: int,
                       seq_len: int, loss_fraction: float = 1.0) -> None:
    """n random sequences of seq_len tokens; the loss mask covers the last loss_fraction of each (an answer after
    its prompt)."""
    from train.features import FeatureWriter, Sequence
    from train.target import target_config_hash

    gen = torch.Generator().manual_seed(0)
    writer = FeatureWriter(folder, {"target": Path(target_path).name, "aux_layer_ids": aux,
                                    "target_config_hash": target_config_hash(target_path),
                                    "shard_sequences": n, "num_sequences_planned": n})
    loss_mask = torch.arange(seq_len) >= round(seq_len * (1 - loss_fraction))
    seqs = [Sequence(torch.randint(0, vocab, (seq_len,), generator=gen), loss_mask,
                     torch.randn(seq_len, len(aux) * hidden, generator=gen).to(torch.bfloat16),
                     torch.randn(seq_len, hidden, generator=gen).to(torch.bfloat16)) for _ in range(n)]
    writer.write_shard(0, seqs)


def synthetic_prepared(folder: Path, vocab: int, n: int, seq_len: int, loss_fraction: float = 1.0) -> None:
    """n prepared sequences (train split, as train.prepare writes them) of seq_len random tokens; the loss mask
    covers the last loss_fraction of each."""
    from datasets import Dataset, DatasetDict, Features, List, Value

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, seq_len), generator=gen).tolist()
    mask = (torch.arange(seq_len) >= round(seq_len * (1 - loss_fraction))).tolist()
    features = Features({"id": Value("string"), "input_ids": List(Value("int32")), "loss_mask": List(Value("bool"))})
    train = Dataset.from_dict({"id": [str(i) for i in range(n)], "input_ids": ids, "loss_mask": [mask] * n},
                              features=features)
    DatasetDict(train=train).save_to_disk(str(folder))


def run(cmd: list[str], env: dict) -> None:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def measure(output_dir: Path) -> dict:
    log = [json.loads(line) for line in (output_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    ranks = [json.loads(p.read_text()) for p in sorted((output_dir / "ranks").glob("rank-*.json"))]
    steps = list(zip(*(r["steps"] for r in ranks)))[1:] or list(zip(*(r["steps"] for r in ranks)))  # per step, ranks
    seconds = [max(s["seconds"] for s in step) for step in steps]
    tokens = [sum(s["tokens"] for s in step) for step in steps]
    total = sum(s["seconds"] for step in steps for s in step)
    features = sum(s.get("features", 0.0) for step in steps for s in step)
    head = sum(s["forward"] + s["backward"] + s["optimizer"] for step in steps for s in step)
    result = {"tokens_per_s": statistics.median(t / s for t, s in zip(tokens, seconds)),
              "tokens_per_step": tokens[-1], "seconds_per_step": statistics.median(seconds),
              "features_fraction": features / total, "head_fraction": head / total,
              "overhead_fraction": 1 - (features + head) / total,
              "step_seconds": [round(s, 4) for s in seconds],
              "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks), "engine": ranks[0]["engine"],
              "world_size": ranks[0]["world_size"], "device": ranks[0]["device"],
              "losses": {r["step"]: r["loss"] for r in log}}
    if "peak_cuda_mb" in ranks[0]:
        result["peak_cuda_mb"] = max(r["peak_cuda_mb"] for r in ranks)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(REPO / "configs" / "smollm2-135m-eagle3.yaml"))
    parser.add_argument("--target", default=None, help="target model folder (default: the recipe's)")
    parser.add_argument("--online", action="store_true",
                        help="the target in the loop: synthetic prepared tokens, features made every step")
    parser.add_argument("--accelerate", default=None, metavar="CONFIG",
                        help="launch every run through accelerate with this config (default: one process plain, "
                             "several with configs/accelerate/<device>_zero2.yaml)")
    parser.add_argument("--out", default="runs/bench_train.json")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the recipe's train.max_length")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--loss-fraction", type=float, default=0.7,
                        help="share of each sequence under the loss mask (its answer; ShareGPT first turns: ~0.7)")
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--precision", default="bf16", help="bf16 | fp32 (CPUs without native bf16: fp32 is faster)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"],
                        help="cuda: one GPU per process (default when one is visible)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="recipe overrides for every run, e.g. train.compile_loss=false (recorded in the JSON)")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    from drafthead.config import default_aux_layer_ids
    from drafthead.utils import atomic_write_json
    from train.recipe import load_recipe
    from transformers import AutoConfig

    recipe = load_recipe(args.recipe)
    target = args.target or recipe.target
    cfg = AutoConfig.from_pretrained(target).get_text_config()
    aux = recipe.head.aux_layer_ids or default_aux_layer_ids(cfg.num_hidden_layers)
    seq_len = args.seq_len or recipe.train.max_length
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    for key in ("ACCELERATE_USE_CPU", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # accelerate would otherwise pick a GPU
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible")
    tcmalloc = next((p for p in TCMALLOC if p.exists()), None)
    if tcmalloc:
        env["LD_PRELOAD"] = str(tcmalloc)
    results = {"target": target, "online": args.online, "accelerate": args.accelerate, "seq_len": seq_len,
               "steps": args.steps,
               "draft_vocab_size": recipe.head.draft_vocab_size, "ttt_steps": recipe.train.ttt_steps,
               "loss_fraction": args.loss_fraction, "mixed_precision": args.precision, "device": args.device,
               "cpu_count": os.cpu_count(),
               "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None, "tcmalloc": bool(tcmalloc),
               "overrides": args.set, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        tmp = Path(tmp)
        if args.online:
            synthetic_prepared(tmp / "prepared", cfg.vocab_size, args.sequences, seq_len, args.loss_fraction)
            data = ["train.online=true", f"data.prepared_dir={tmp / 'prepared'}"]
        else:
            synthetic_features(tmp / "features", target, aux, cfg.hidden_size, cfg.vocab_size,
                               args.sequences, seq_len, args.loss_fraction)
            data = ["train.online=false", f"features.dir={tmp / 'features'}"]
        for nproc in [int(p) for p in args.processes.split(",")]:
            out = tmp / f"out{nproc}"
            overrides = [f"target={target}", *data, f"train.output_dir={out}", f"train.max_steps={args.steps}",
                         "train.batch_size=1", "train.grad_accum=1", f"train.mixed_precision={args.precision}",
                         f"train.max_length={seq_len}", "train.save_every=1000000", "train.eval_every=1000000",
                         "train.warmup_steps=1", "train.debug_report=true", *args.set]  # ranks/*.json: step times
            launch = args.accelerate or (None if nproc == 1 else
                                         f"configs/accelerate/{'gpu' if args.device == 'cuda' else 'cpu'}_zero2.yaml")
            if launch is None:
                cmd = [sys.executable, "-m", "train", args.recipe, *overrides]
            else:
                cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", launch,
                       "--num_processes", str(nproc), "-m", "train", args.recipe, *overrides]
            run(cmd, {**env, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))})
            results["runs"][f"{nproc}proc"] = measure(out)
            print(json.dumps({f"{nproc}proc": results["runs"][f"{nproc}proc"]}), flush=True)
            atomic_write_json(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
