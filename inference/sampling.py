"""Sampling parameters and logit processing identical to transformers' generate.

Order and conditions follow `GenerationMixin._get_logits_processor` for do_sample=True:
TemperatureLogitsWarper (if temperature != 1), TopKLogitsWarper (if top_k not in (None, 0)),
TopPLogitsWarper (if top_p < 1), each with min_tokens_to_keep=1, all on float32 logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

@dataclass(frozen=True)
class SamplingParams:
    """do_sample=False means greedy (argmax); otherwise sample from the processed distribution."""

    do_sample: bool = False  # the others: generate's defaults, also for a field left at None in make()
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0

    @classmethod
    def make(cls, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             do_sample: bool | None = None, generation_config: Any | None = None) -> "SamplingParams":
        """Explicit arguments win over `generation_config`; None falls back to generate's defaults (temperature 1.0,
        top_k 50, top_p 1.0). Without an explicit do_sample, sampling is on iff an explicit temperature > 0 was given,
        else it follows generation_config.do_sample (off by default, as in generate)."""
        gc = generation_config
        _check_ranges(temperature, top_k, top_p)  # the caller's own values, sampling or not
        if do_sample is None:
            do_sample = temperature > 0 if temperature is not None else bool(getattr(gc, "do_sample", False))
        pick = lambda name, value: value if value is not None else getattr(gc, name, None)  # noqa: E731
        temperature, top_k, top_p = pick("temperature", temperature), pick("top_k", top_k), pick("top_p", top_p)
        if not do_sample:
            return cls(do_sample=False)
        temperature = cls.temperature if temperature is None else float(temperature)
        top_k = cls.top_k if top_k is None else int(top_k)
        top_p = cls.top_p if top_p is None else float(top_p)
        if temperature <= 0:
            raise ValueError(f"sampling needs temperature > 0, got {temperature} (use do_sample=False for greedy)")
        _check_ranges(temperature, top_k, top_p)  # (values from generation_config too)
        return cls(True, temperature, top_k, top_p)


def _check_ranges(temperature: float | None, top_k: int | None, top_p: float | None) -> None:
    """ValueError naming the first value out of its range (None: not given)."""
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> float32 processed logits (-inf where filtered), exactly as transformers' warpers."""
    scores = logits.float()
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.size(-1))).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        remove_sorted = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - params.top_p)
        remove_sorted[..., -1:] = False
        scores = scores.masked_fill(remove_sorted.scatter(-1, sorted_idx, remove_sorted), -float("inf"))
    return scores


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> float32 probabilities of the processed distribution."""
    return process_logits(logits, params).softmax(dim=-1)


def pick_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Each row's next token from logits (B, V), shape (B,): argmax, or a sample of the processed distribution."""
    return (torch.multinomial(target_probs(logits, params), 1, generator=generator)[:, 0] if params.do_sample
            else logits.float().argmax(dim=-1))
