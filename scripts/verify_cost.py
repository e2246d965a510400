"""Cost of one batched verify step against the number of tokens verified per row, at a given batch and context.

    python scripts/verify_cost.py --target PATH --batch-size 8 --context 8192 --queries 1,2,3,4,5,7 \
        [--compile on] --out verify_cost.json

Self-speculation (MagicDec) pays when verifying γ+1 tokens per row costs about what one token costs, which holds
where a step is bound by reading the KV cache. This measures it on the batch runner itself: B rows whose buffers
hold `context` committed entries (random values: the cost does not depend on them), then one verify step of n
chained tokens per row for every n, the sizes taking turns for `--rounds` rounds (a shared machine has slow
spells); reports the median and minimum milliseconds per size and the ratio to n = 1. With `--compile on` each
size is one compiled graph (as the grid bench runs it), compiled in the warm-up; on CUDA a CUDA graph, so n = 1 at
batch 1 is the engine's graphed plain decoding step.
`--sequential` measures one size at a time (its compile, then its rounds) in the order given, rewriting the JSON
after each: for a machine whose time may run out before the last size. `--limit` adds the weight-streaming
limit: the bytes one step must read (every weight but the input embedding, unless tied) over the device's memory
bandwidth measured by a large on-device copy, and each size's time against it.
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


def measure(runner: StaticRunner, batch: int, context: int, queries: list[int], rounds: int,
            sequential: bool = False, on_size=None) -> dict[int, list[float]]:
    """Milliseconds of runner.verify for every n in `queries`, `rounds` times each, the sizes in turn (sequential:
    one size after the other, `on_size(times so far)` after each)."""
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
    times: dict[int, list[float]] = {}
    sync = synchronizer(runner.device)

    def timed(n: int) -> None:
        sync()
        t0 = time.perf_counter()
        runner.verify(*steps[n])
        sync()
        times.setdefault(n, []).append(1000 * (time.perf_counter() - t0))

    with runner.session(), torch.inference_mode():
        if sequential:
            for n in queries:
                runner.verify(*steps[n])  # warm-up (compile)
                for _ in range(rounds):
                    timed(n)
                if on_size is not None:
                    on_size(times)
            return times
        for n in queries:  # warm-up
            runner.verify(*steps[n])
        for _ in range(rounds):
            for n in queries:
                timed(n)
    return times


def bandwidth_gb_s(device: torch.device, gib: float = 2.0, reps: int = 10) -> float:
    """Memory bandwidth from a device-to-device copy of `gib` GiB (bytes read plus written), the best of `reps`."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = synchronizer(device)
    best = float("inf")
    for _ in range(reps + 1):  # the first copy warms up
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best / 1e9


def streamed_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decoding step reads: all but the input embedding (one row of it), unless it is tied."""
    embedding = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding or
               p is model.get_output_embeddings().weight)


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
    p.add_argument("--sequential", action="store_true",
                   help="one size at a time in the given order, the JSON rewritten after each")
    p.add_argument("--limit", action="store_true", help="also measure the weight-streaming limit (see above)")
    p.add_argument("--out", type=Path, default=Path("verify_cost.json"))
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, _ = load_causal_lm(args.target, dtype)
    model = place_module(model, device, dtype).eval()
    # ratios are to one token per row, measured first
    given = [int(x) for x in args.queries.split(",")]
    queries = [1, *dict.fromkeys(n for n in given if n != 1)] if args.sequential else sorted({1, *given})
    compile = compile_setting(args.compile, device)
    result = {"target": str(args.target), "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "dtype": str(dtype),
              "cpu_flags": cpu_flags(), "threads": torch.get_num_threads(), "compile": compile,
              "batch": args.batch_size, "context": args.context, "rounds": args.rounds, "verify_ms": {}}
    if args.limit:
        weights, bandwidth = streamed_bytes(model), bandwidth_gb_s(device, 2.0 if device.type == "cuda" else 0.25)
        result["weight_streaming"] = {"bytes": weights, "bandwidth_gb_s": round(bandwidth, 1),
                                      "limit_ms": round(1000 * weights / (bandwidth * 1e9), 3)}

    def write(times: dict[int, list[float]]) -> None:
        median = {n: statistics.median(t) for n, t in times.items()}
        result["verify_ms"] = {str(n): {"median": round(median[n], 3), "min": round(min(t), 3),
                                        "ratio_to_one_token": round(median[n] / median[1], 3)}
                               for n, t in sorted(times.items())}
        if args.limit:
            limit = result["weight_streaming"]["limit_ms"]
            for n in times:
                result["verify_ms"][str(n)]["ratio_to_limit"] = round(median[n] / limit, 3)
        atomic_write_json(args.out, result)

    times = measure(StaticRunner(model, [], compile=compile), args.batch_size, args.context, queries, args.rounds,
                    args.sequential, write)
    write(times)
    for n in sorted(times):
        ms = result["verify_ms"][str(n)]
        print(f"{n} tokens per row: {ms['median']:.3f} ms (x{ms['ratio_to_one_token']:.2f})")
    if args.limit:
        print(f"weight-streaming limit {result['weight_streaming']['limit_ms']:.3f} ms "
              f"({result['weight_streaming']['bandwidth_gb_s']:.0f} GB/s)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
