"""Which KV entries should a self-draft keep at long context? Simulated acceptance of greedy self-speculation.

For each long prompt (inference/long_context.py), the target drafts chains of `gamma` tokens attending only a kept
subset of the KV, and the full-KV target verifies them, greedy, one row at a time; the script reports each policy's
tokens per verification (τ). Policies, at a budget of KV entries:

- `stream_wW`: StreamingLLM (the engine's self-draft, self_draft.py): `sink` first positions + the last W;
- `snap_kK_wW`: SnapKV-style selection (Li et al. 2024) on top: the sinks, the last W, and per layer and KV head the
  K prompt positions before that window that the prompt's last `observe` tokens attend to most (summed over the
  group's query heads, max-pooled over 7 neighbours), chosen once after the prompt.

It measures acceptance only (transformers' forward with a float32 attention that masks per head; no speed): a policy
that keeps τ with fewer entries makes each draft step's attention cheaper in the engine.

    python scripts/draft_kv_policies.py --target MODEL --context 8192 --rows 8 --out docs/results/draft_kv_policies.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from drafthead.utils import atomic_write_json, cache_argument  # noqa: E402
from inference.bench.long_context import long_prompts  # noqa: E402

NAME = "draft_kv_policies"
STATE: dict = {"draft": False, "observe": False, "first": 0, "keep": None, "window": 0, "mass": {}}


def policy_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Causal attention in float32 for one row at positions first.. (STATE); while drafting, each KV head sees only
    its kept prompt positions and the last `window` positions; while observing, it records the attention mass."""
    heads, n, kv_heads, slots = query.shape[1], query.shape[2], key.shape[1], key.shape[2]
    groups = heads // kv_heads
    k, v = key.float().repeat_interleave(groups, 1), value.float().repeat_interleave(groups, 1)
    scores = (query.float() * scaling) @ k.transpose(2, 3)  # (1, heads, n, slots)
    q_pos = STATE["first"] + torch.arange(n)
    k_pos = torch.arange(slots)
    allowed = (k_pos[None, :] <= q_pos[:, None])[None, None]
    if STATE["draft"]:
        keep = STATE["keep"][module.layer_idx]  # (kv_heads, prompt length)
        kept = torch.zeros(kv_heads, slots, dtype=torch.bool)
        kept[:, : keep.shape[1]] = keep
        recent = k_pos[None, :] >= q_pos[:, None] - STATE["window"]
        allowed = allowed & (kept.repeat_interleave(groups, 0)[None, :, None, :] | recent[None, None])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    if STATE["observe"]:
        STATE["mass"][module.layer_idx] = probs[0].view(kv_heads, groups, n, slots).sum(dim=(1, 2))
    return (probs @ v).to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, policy_attention)


def forward(model, ids: list[int], first: int, cache, draft: bool = False, observe: bool = False) -> torch.Tensor:
    STATE.update(draft=draft, observe=observe, first=first)
    out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(first, first + len(ids))[None],
                **{cache_argument(model): cache}, use_cache=True)
    return out.logits[0].float()


def crop(cache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def kept_positions(mass: dict, prompt: int, sink: int, budget: int, window: int, pool: int = 7) -> dict:
    """Per layer (kv_heads, prompt) bool: the sinks, plus the `budget` positions of [sink, prompt - window) with the
    most pooled attention mass per KV head."""
    keep = {}
    for layer, m in mass.items():
        m = m[:, :prompt]
        chosen = torch.zeros_like(m, dtype=torch.bool)
        chosen[:, :sink] = True
        span = m[:, sink: max(sink, prompt - window)]
        if budget > 0 and span.shape[1] > 0:
            pooled = F.max_pool1d(span[:, None], pool, stride=1, padding=pool // 2)[:, 0]
            chosen.scatter_(1, pooled.topk(min(budget, span.shape[1]), dim=1).indices + sink, True)
        keep[layer] = chosen
    return keep


@torch.inference_mode()
def speculate(model, cache, prompt: int, first_token: int, keep: dict, window: int, gamma: int,
              new_tokens: int) -> tuple[float, list[int]]:
    """Greedy chains of `gamma` drafted with the kept KV, verified with the full KV. Returns (τ, tokens)."""
    STATE.update(keep=keep, window=window)
    tokens, length, steps = [first_token], prompt, 0
    while len(tokens) < new_tokens:
        root, drafts = tokens[-1], []
        for d in range(gamma):
            drafts.append(int(forward(model, [drafts[-1] if drafts else root], length + d, cache, draft=True)[-1]
                              .argmax()))
        crop(cache, length)
        target = forward(model, [root] + drafts, length, cache).argmax(-1).tolist()
        k = 0
        while k < gamma and drafts[k] == target[k]:
            k += 1
        tokens += drafts[:k] + [target[k]]
        crop(cache, length + k + 1)
        length += k + 1
        steps += 1
    crop(cache, prompt)
    return (len(tokens) - 1) / steps, tokens[:new_tokens]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--observe", type=int, default=32, help="last prompt tokens whose attention picks positions")
    ap.add_argument("--policies", default="stream_w512,stream_w256,snap_k128_w128,snap_k256_w256,snap_k512_w512")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    policies = {}
    for name in args.policies.split(","):
        kind, *sizes = name.split("_")
        parts = {p[0]: p[1:] for p in sizes if p}
        wanted = {"stream": {"w"}, "snap": {"k", "w"}}.get(kind)
        if wanted is None or set(parts) != wanted or len(parts) != len(sizes) or not all(
                v.isdigit() for v in parts.values()):
            ap.error(f"policy {name!r}: expected stream_wW or snap_kK_wW (e.g. stream_w512, snap_k128_w128)")
        policies[name] = (int(parts.get("k", 0)), int(parts["w"]))
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16).eval()
    result = {"target": args.target, "context": args.context, "gamma": args.gamma, "sink": args.sink,
              "observe": args.observe, "new_tokens": args.new_tokens, "dtype": "bfloat16 (float32 attention)",
              "rows": []}
    for r, ids in enumerate(long_prompts(tokenizer, args.context, args.rows, task="continue")):
        t0 = time.time()
        cache = DynamicCache(config=model.config)
        model.set_attn_implementation("sdpa")
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids[: -args.observe]]), **{cache_argument(model): cache}, use_cache=True)
        model.set_attn_implementation(NAME)
        with torch.inference_mode():
            first = int(forward(model, ids[-args.observe:], len(ids) - args.observe, cache, observe=True)[-1].argmax())
        row = {}
        for name, (budget, window) in policies.items():
            keep = kept_positions(STATE["mass"], len(ids), args.sink, budget, window)
            tau, _ = speculate(model, cache, len(ids), first, keep, window, args.gamma, args.new_tokens)
            row[name] = round(tau, 3)
        result["rows"].append(row)
        result["mean_tau"] = {n: round(sum(x[n] for x in result["rows"]) / len(result["rows"]), 3) for n in policies}
        atomic_write_json(args.out, result)
        print(f"row {r} ({time.time() - t0:.0f} s): " + "  ".join(f"{n} {t:.2f}" for n, t in row.items()), flush=True)
    print(json.dumps(result["mean_tau"], indent=1))


if __name__ == "__main__":
    main()
