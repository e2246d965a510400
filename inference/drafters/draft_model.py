"""Draft-model drafting: classic speculative sampling with a smaller causal LM (Leviathan et al. 2023; Chen et al.
2023). After verification the draft's cache is rolled back to the accepted prefix; accepted tokens it has not seen
yet (the last draft, and always the bonus) are fed at the next proposal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from drafthead.utils import place_module

from ..drafter import Accepted, Drafter
from ..loading import load_causal_lm
from ..runners import make_runner
from ..sampling import SamplingParams, target_probs
from ..tree import DraftTree


class TokenizerMismatchError(ValueError):
    """The draft model does not share the target's tokenizer."""


def check_same_tokenizer(draft: nn.Module, target: nn.Module, draft_tokenizer: Any = None,
                         target_tokenizer: Any = None) -> None:
    """Refuse a draft model whose token ids mean something else than the target's: the vocabularies must be equal
    when both tokenizers are given, else the configs' vocab sizes."""
    if draft_tokenizer is not None and target_tokenizer is not None:
        dv, tv = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
        if dv != tv:
            differ = sorted(set(dv.items()) ^ set(tv.items()), key=lambda kv: kv[1])[:5]
            raise TokenizerMismatchError(
                f"the draft model's tokenizer differs from the target's ({len(dv)} vs {len(tv)} tokens; first "
                f"differences {differ}): a draft model must share the target's tokenizer")
        return
    dv, tv = (model.config.get_text_config(decoder=True).vocab_size for model in (draft, target))
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
    if probs.shape[-1] > vocab:
        probs = probs[..., :vocab]
        return probs / probs.sum(dim=-1, keepdim=True)
    return torch.nn.functional.pad(probs, (0, vocab - probs.shape[-1]))


class DraftModelDrafter(Drafter):
    """A drafter: chains of `gamma` tokens from a smaller LM with its own KV buffers, every row at once."""

    name = "draft_model"
    origin_names = ("draft_model",)

    def __init__(self, model: nn.Module, target_vocab: int, gamma: int = 4, runner: str = "auto",
                 compile: bool = False):
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.model = model.eval()
        self.gamma, self.tree_size, self.vocab = gamma, gamma + 1, target_vocab
        self.runner = make_runner(self.model, [], runner, compile)
        self.session = self.runner.session  # its attention kernel, entered once per generation by the engine
        self.device = next(model.parameters()).device
        self.pending: list[list[int]] = []  # each row's accepted tokens not yet in the draft's cache
        self.after_root: torch.Tensor | None = None  # (B,) each row's cache length right after its root was fed
        self._prefill_runner = None  # continuous batching: prefills an admitted prompt alone (admit)

    def close(self) -> None:
        """Give the draft model back as it was (its runners' hooks and linears)."""
        for runner in (self.runner, self._prefill_runner):
            if runner is not None:
                runner.close()

    def begin(self, runner, input_ids: torch.Tensor, attention_mask: torch.Tensor, features) -> None:
        self.runner.reset(input_ids.shape[0], runner.capacity)
        self.runner.prefill(input_ids, attention_mask)
        self.pending = [[] for _ in range(input_ids.shape[0])]

    def _feed(self, rows: list[list[int]]) -> torch.Tensor:
        """Append each row's tokens (at least one a row) to the draft cache; the logits after each last (B, V)."""
        counts = [len(r) for r in rows]
        m = max(counts)
        tokens = torch.tensor([r + [0] * (m - len(r)) for r in rows], device=self.device)
        chain = DraftTree.chain(tokens[:, 0], tokens[:, 1:])
        logits, _, _ = self.runner.verify(chain.tokens, chain.depths, chain.ancestors)
        kept = [list(range(c)) for c in counts]  # each row's tokens, a chain: all of them stay
        self.runner.commit(Accepted.from_host(kept, kept, m, self.device))
        return logits[torch.arange(len(rows), device=self.device), torch.tensor(counts, device=self.device) - 1]

    @torch.inference_mode()
    def propose(self, roots: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> DraftTree:
        drafted, qs = [], []
        logits = self._feed([pending + [root] for pending, root in zip(self.pending, roots.tolist())])
        self.after_root = self.runner.length.clone()
        for i in range(self.gamma):  # each row's next draft token (B,), sampled: with its distribution q (B, V)
            if params.do_sample:
                q = match_vocab(target_probs(logits, params), self.vocab)
                token = torch.multinomial(q, 1, generator=generator).view(-1)
                qs.append(q)
            else:
                token = logits[:, : self.vocab].argmax(dim=-1)
            drafted.append(token)
            if i < self.gamma - 1:  # the last draft is never fed: if accepted it goes with the bonus next time
                logits = self._feed([[t] for t in token.tolist()])
        return DraftTree.chain(roots, torch.stack(drafted, dim=1), torch.stack(qs, dim=1) if qs else None, origin=1)

    def skip(self, roots: torch.Tensor) -> None:
        """A plain step: the root waits, with the other accepted tokens, for the next proposal."""
        self.after_root = None
        self.pending = [pending + [root] for pending, root in zip(self.pending, roots.tolist())]

    def accept(self, accepted: Accepted, features) -> None:
        """Roll each row's cache back to its root + the accepted drafts it holds; the rest waits."""
        if self.after_root is None:  # after a plain step the cache holds nothing the target rejected
            self.pending = [pending + tokens[:-1] for pending, tokens in zip(self.pending, accepted.host_tokens)]
            return
        held = [min(max(len(t) - 1, 0), self.gamma - 1) for t in accepted.host_tokens]  # accepted drafts cached
        self.runner.truncate(self.after_root + torch.tensor(held, device=self.device))
        self.pending = [tokens[h:-1] for tokens, h in zip(accepted.host_tokens, held)]

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.runner.keep_rows(rows)
        self.pending = [self.pending[k] for k in rows.tolist()]

    @torch.inference_mode()
    def admit(self, row: int, runner, ids: torch.Tensor, features) -> None:
        """Row `row` holds a new prompt: the draft model prefills it alone and its KV joins the draft's buffers."""
        if self._prefill_runner is None:
            self._prefill_runner = make_runner(self.model, [], "static")
        self._prefill_runner.reset(1, ids.shape[0])
        self._prefill_runner.prefill(ids.view(1, -1))
        self.runner.admit(row, self._prefill_runner.export_rows()[0]["kv"])
        self.pending[row] = []
