"""Teacher-forced evaluation of a head on validation features: accuracy per unroll step and simulated tau.

acc_i  = share of valid positions where the head's step-i token equals the target's greedy token.
tau    = 1 + mean accepted draft tokens of a greedy chain started at every valid position t. Step i is
         accepted when steps 0..i all matched the target's greedy token AND the tokens the unroll was fed
         (the data's x_{t+j+2}, j < i) equal those greedy tokens, so the unroll state is exactly the chain a
         greedy drafter would have built. Where the data differs from the target's greedy continuation the
         chain stops: tau is exact on target-generated data and a lower bound otherwise.
tau_decode = what greedy chain decoding would measure (tokens per target forward): a forward at start t yields
         the chain's accepted tokens there plus the target's own token, and the next forward starts right after
         them, so the chains counted are only those decoding would start. tau averages every start position alike;
         decoding spends few forwards on easy stretches and many on hard ones, so tau_decode is lower (the figure
         to compare with the engine's tau on a chain tree, e.g. `python -m inference.bench --tree 7,1,7`).
"""

from __future__ import annotations

import torch


def decode_walk(accepted: torch.Tensor, starts: torch.Tensor) -> tuple[int, int]:
    """(tokens, forwards) of greedy chain decoding over each row's start positions: at start t a forward yields
    accepted[b, t] draft tokens plus the target's own, and decoding goes on at t + accepted[b, t] + 1 (or at the
    next start, past the end of a span)."""
    tokens = forwards = 0
    for row, is_start in zip(accepted.long().tolist(), starts.tolist()):
        t = 0
        while t < len(row):
            if is_start[t]:
                tokens, forwards = tokens + row[t] + 1, forwards + 1
                t += row[t] + 1
            else:
                t += 1
    return tokens, forwards


def step_statistics(out: dict, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-batch sums from DraftTrainModule outputs: correct[i], count[i] (steps,), accepted, chains,
    decode_tokens, decode_forwards (scalars)."""
    steps = len(out["preds"])
    correct = torch.zeros(steps, dtype=torch.float64, device=input_ids.device)
    count = torch.zeros_like(correct)
    n0 = out["preds"][0].shape[1] if steps else 0
    chain = torch.ones(input_ids.shape[0], n0, dtype=torch.bool, device=input_ids.device)  # (B, n0), indexed by t
    accepted = torch.zeros_like(chain, dtype=torch.float64)
    for i in range(steps):
        pred, target, valid = out["preds"][i], out["targets"][i], out["valid"][i]  # (B, n_i)
        n = pred.shape[1]
        hit = (pred == target) & valid
        correct[i] = hit.sum()
        count[i] = valid.sum()
        chain = torch.nn.functional.pad(chain[:, :n] & hit, (0, n0 - n))  # t >= n_i: no step i (end of sequence)
        accepted += chain
        fed = torch.nn.functional.pad(input_ids[:, i + 2 : i + 2 + n] == target, (0, n0 - n))
        chain = chain & fed  # the next step is fed the data token x_{t+i+2}: the chain goes on only if it is greedy
    starts = out["valid"][0] if steps else chain
    decode_tokens, decode_forwards = decode_walk(accepted, starts)
    return {
        "correct": correct,
        "count": count,
        "accepted": (accepted * starts).sum().reshape(1),
        "chains": starts.sum().to(torch.float64).reshape(1),
        "decode_tokens": torch.tensor([decode_tokens], dtype=torch.float64, device=input_ids.device),
        "decode_forwards": torch.tensor([decode_forwards], dtype=torch.float64, device=input_ids.device),
    }


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, reduce=None) -> dict[str, float]:
    """Run `model` (a DraftTrainModule, possibly engine-wrapped) over `batches` (dicts on the right device).

    `reduce(tensor) -> tensor` sums across processes (accelerator.reduce(..., "sum")); every rank must call it.
    Returns eval_loss, acc_<i> per unroll step, tau and tau_decode.
    """
    was_training = model.training
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    loss_sum, batches_seen = 0.0, 0
    for batch in batches:
        out = model(**batch)
        stats = step_statistics(out, batch["input_ids"])
        for key, value in stats.items():
            totals[key] = totals[key] + value if key in totals else value
        loss_sum += float(out["loss"])
        batches_seen += 1
    if was_training:
        model.train()
    if not totals:
        raise ValueError("evaluation got no batches")
    packed = torch.cat([totals["correct"], totals["count"], totals["accepted"], totals["chains"],
                        totals["decode_tokens"], totals["decode_forwards"],
                        torch.tensor([loss_sum, batches_seen], dtype=torch.float64, device=totals["count"].device)])
    if reduce is not None:
        packed = reduce(packed)
    steps = totals["correct"].numel()
    correct, count = packed[:steps], packed[steps : 2 * steps]
    accepted, chains, decode_tokens, decode_forwards, loss_sum, batches_seen = packed[2 * steps :].tolist()
    result = {"eval_loss": loss_sum / max(batches_seen, 1), "tau": 1.0 + accepted / max(chains, 1.0),
              "tau_decode": decode_tokens / max(decode_forwards, 1.0)}
    for i in range(steps):
        result[f"acc_{i}"] = float(correct[i] / count[i].clamp(min=1))
    return result
