"""Draft-model drafting: classic speculative sampling with a smaller causal LM (Leviathan et al. 2023; Chen et al.
2023).

The draft model keeps its own KV cache (a runner like the target's: static buffers where the architecture allows)
and drafts a chain of `gamma` tokens: greedy, or sampled from its processed distribution q (same temperature,
top-k and top-p as the target). The chain carries q, so verification accepts each token with min(1, p/q) and, on a
rejection, draws the bonus from norm(max(0, p - q)) (verify.py); at temperature 0 this is exact matching. After
verification the draft cache is rolled back to the accepted prefix: drafts it holds beyond it are forgotten, and
accepted tokens it has not seen yet (the last draft, and always the bonus) are fed at the next proposal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from drafthead.masks import causal_allowed
from drafthead.utils import place_module

from .drafter import chain_tree
from .loading import load_causal_lm
from .runner import make_runner
from .sampling import SamplingParams, target_probs
from .tree import DraftTree


class TokenizerMismatchError(ValueError):
    """The draft model does not share the target's tokenizer."""


def check_same_tokenizer(draft: nn.Module, target: nn.Module, draft_tokenizer: Any = None,
                         target_tokenizer: Any = None) -> None:
    """Refuse a draft model whose token ids mean something else than the target's: the vocabularies (token ->
    id) must be equal when both tokenizers are given, else the configs' vocab sizes. Embedding rows beyond the
    tokenizer (padding) may differ."""
    if draft_tokenizer is not None and target_tokenizer is not None:
        dv, tv = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
        if dv != tv:
            differ = sorted(set(dv.items()) ^ set(tv.items()), key=lambda kv: kv[1])[:5]
            raise TokenizerMismatchError(
                f"the draft model's tokenizer differs from the target's ({len(dv)} vs {len(tv)} tokens; first "
                f"differences {differ}): a draft model must share the target's tokenizer")
        return
    dv = draft.config.get_text_config(decoder=True).vocab_size
    tv = target.config.get_text_config(decoder=True).vocab_size
    if dv != tv:
        raise TokenizerMismatchError(f"vocab size: draft model {dv}, target {tv}; a draft model must share the "
                                     "target's tokenizer (pass both tokenizers to compare the vocabularies)")


def load_draft_model(source: str | Path | nn.Module, target: nn.Module, target_tokenizer: Any = None) -> nn.Module:
    """A smaller causal LM (folder or loaded model) on the target's device and dtype, in eval mode; refused with
    TokenizerMismatchError when its tokenizer differs from the target's."""
    ref = next(target.parameters())
    model, tokenizer = load_causal_lm(source, ref.dtype, what="draft model")
    model = place_module(model, ref.device, ref.dtype).eval()
    check_same_tokenizer(model, target, tokenizer, target_tokenizer)
    return model


def match_vocab(probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft probabilities (..., V_draft) over the target's `vocab` ids: zero-padded, or cut and renormalised."""
    v = probs.shape[-1]
    if v < vocab:
        return torch.nn.functional.pad(probs, (0, vocab - v))
    if v > vocab:
        probs = probs[..., :vocab]
        return probs / probs.sum(dim=-1, keepdim=True)
    return probs


class DraftModelDrafter:
    """A drafter.Drafter: a chain of `gamma` tokens from a smaller LM with its own KV cache (module docstring)."""

    name = "draft_model"
    origin_names = ("draft_model",)
    feature_layers: list[int] = []

    def __init__(self, model: nn.Module, target_vocab: int, gamma: int = 4, runner: str = "auto",
                 compile: bool = False):
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.model = model.eval()
        self.gamma = gamma
        self.vocab = target_vocab
        self.runner = make_runner(self.model, [], runner, compile)
        self.device = next(model.parameters()).device
        self.pending = torch.zeros(1, 0, dtype=torch.long, device=self.device)  # accepted, not yet in the cache
        self.after_root = 0  # cache length right after the last root was fed

    def tree_sizes(self) -> list[int]:
        return [self.gamma + 1]

    def warmup(self, max_length: int) -> None:
        """Size the draft cache and run (compile) the step shapes drafting uses: 1 and 2 new tokens."""
        ids = torch.zeros(1, max(getattr(self.runner, "buckets", (4,))[-1], 4), dtype=torch.long,
                          device=self.device)
        self.runner.reserve(max_length)
        with self.runner.session(), torch.inference_mode():
            self.runner.reset(max_length)
            self.runner.prefill(ids)
            for m in (1, 2):
                self._step(ids[:, :m])

    def session(self):
        """The draft runner's session (its attention kernel), entered once per generation by the engine."""
        return self.runner.session()

    def begin(self, input_ids: torch.Tensor, features, max_length: int) -> None:
        self.runner.reset(max_length + self.gamma + 2)
        self.runner.prefill(input_ids)
        self.pending = input_ids[:, :0]

    def _step(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append tokens (1, m) to the draft cache; the logits after the last one (1, V) and their argmax (1,)."""
        m = tokens.shape[1]
        logits, _, greedy = self.runner.verify(tokens, torch.arange(m, device=self.device),
                                               causal_allowed(m, 0, self.device))
        self.runner.commit(torch.arange(m, device=self.device), m)
        return logits[:, -1], greedy[:, -1]

    @torch.inference_mode()
    def propose(self, root: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> DraftTree:
        drafted, qs = [], []
        tokens = torch.cat([self.pending, root.view(1, 1)], dim=1)
        for i in range(self.gamma):
            logits, greedy = self._step(tokens)
            if i == 0:
                self.after_root = self.runner.length
            if params.do_sample:
                q = match_vocab(target_probs(logits, params), self.vocab)  # (1, V)
                token = torch.multinomial(q, 1, generator=generator).view(1)
                qs.append(q)
            elif logits.shape[-1] <= self.vocab:
                token = greedy  # the runner's argmax (fused into the compiled step)
            else:
                token = logits[:, : self.vocab].argmax(dim=-1)
            drafted.append(token)
            tokens = token.view(1, 1)
        # the last draft is never fed: if it is accepted it goes with the bonus into the next proposal
        return chain_tree(root, torch.cat(drafted), torch.cat(qs) if qs else None, origin=1)

    def accept(self, path: torch.Tensor, new_tokens: torch.Tensor, features) -> None:
        """Roll the cache back to the root + the accepted drafts it holds; the rest waits for the next proposal."""
        accepted = path.shape[0] - 1
        held = min(accepted, self.gamma - 1)  # accepted drafts already in the cache
        self.runner.truncate(self.after_root + held)
        self.pending = new_tokens[held:-1].view(1, -1)
