"""Cost of one batched verify step against the number of tokens verified per row, at a given batch and context.

    python scripts/verify_cost.py --target PATH --batch-size 8 --context 8192 --queries 1,2,3,4,5,7 \
        [--compile on] --out docs/results/verify_cost.json

Self-speculation (MagicDec) pays when verifying γ+1 tokens per row costs about what one token costs, which holds
where a step is bound by reading the KV cache. This measures it on the batch runner itself: B rows whose buffers
hold `context` committed entries (random values: the cost does not depend on them), then one verify step of n
chained tokens per row for every n, the sizes taking turns for `--rounds` rounds (a shared machine has slow
spells); reports the median and minimum milliseconds per size and the ratio to n = 1. With `--compile on` each
size is one compiled graph (as the grid bench runs it), compiled in the warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drafthead.hardware import cpu_flags, resolve_dtype, synchronizer  # noqa: E402
from drafthead.paths import cache_dir  # noqa: E402
from drafthead.utils import atomic_write_json, place_module  # noqa: E402
from inference.runners.static import StaticRunner  # noqa: E402
from inference.loading import load_causal_lm  # noqa: E402
from inference.runners.compile import compile_setting  # noqa: E402


def measure(runner: StaticRunner, batch: int, context: int, queries: list[int], rounds: int) -> dict[int, list[float]]:
    """Milliseconds of runner.verify for every n in `queries`, `rounds` times each, the sizes in turn."""
    runner.reset(batch, context + max(queries) + 1)
    gen = torch.Generator(device=runner.device).manual_seed(0)
    for keys, values in runner.layers():
        keys.normal_(generator=gen)
        values.normal_(generator=gen)
    runner.start = torch.zeros(batch, dtype=torch.long, device=runner.device)
    runner.length = torch.full((batch,), context, dtype=torch.long, device=runner.device)
    vocab = runner.model.config.get_text_config(decoder=True).vocab_size
    steps = {}
    for n in queries:
        tokens = torch.randint(0, vocab, (batch, n), generator=gen, device=runner.device)
        depths = torch.arange(n, device=runner.device).expand(batch, n)
        chain = torch.ones(n, n, dtype=torch.bool, device=runner.device).tril().expand(batch, n, n)
        steps[n] = (tokens, depths, chain)
    times: dict[int, list[float]] = {n: [] for n in queries}
    sync = synchronizer(runner.device)
    with runner.session(), torch.inference_mode():
        for n in queries:  # warm-up
            runner.verify(*steps[n])
        for _ in range(rounds):
            for n in queries:
                sync()
                t0 = time.perf_counter()
                runner.verify(*steps[n])
                sync()
                times[n].append(1000 * (time.perf_counter() - t0))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=cache_dir() / "models" / "SmolLM2-135M-Instruct")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--queries", default="1,2,3,4,5,7", help="tokens verified per row, comma list")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="off",
                   help="compile the verify step (auto: CUDA only)")
    p.add_argument("--out", type=Path, default=Path("verify_cost.json"))
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, _ = load_causal_lm(args.target, dtype)
    model = place_module(model, device, dtype).eval()
    queries = sorted({1, *(int(x) for x in args.queries.split(","))})  # ratios are to one token per row
    compile = compile_setting(args.compile, device)
    times = measure(StaticRunner(model, [], compile=compile), args.batch_size, args.context, queries, args.rounds)
    median = {n: statistics.median(t) for n, t in times.items()}
    result = {"target": str(args.target), "device": str(device), "dtype": str(dtype), "cpu_flags": cpu_flags(),
              "threads": torch.get_num_threads(), "compile": compile, "batch": args.batch_size, "context": args.context,
              "rounds": args.rounds,
              "verify_ms": {str(n): {"median": round(median[n], 1), "min": round(min(t), 1),
                                     "ratio_to_one_token": round(median[n] / median[queries[0]], 3)}
                            for n, t in times.items()}}
    atomic_write_json(args.out, result)
    for n in queries:
        print(f"{n} tokens per row: {median[n]:.0f} ms (x{median[n] / median[queries[0]]:.2f})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
