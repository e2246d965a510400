"""Prompt-lookup drafting: copy what followed the latest earlier occurrence of the last few tokens.

Draft-free (no model): the context is the prompt plus everything generated so far. For n from `max_ngram` down to
`min_ngram`, find the most recent earlier position where the context's last n tokens occur, and propose the (up to)
`num_tokens` tokens that followed it as a chain. Like transformers' `prompt_lookup_num_tokens`, but verified by
this engine's runner; it pays on outputs that repeat their input (editing, extraction, code, summaries).
"""

from __future__ import annotations

import contextlib

import torch

from .drafter import chain_tree
from .tree import DraftTree


def lookup_continuation(context: list[int], num_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """The tokens after the most recent earlier match of the context's last n tokens (longest n first); [] if
    none. A match must be followed by at least one token."""
    end = len(context)
    for n in range(min(max_ngram, end - 1), min_ngram - 1, -1):
        pattern = context[end - n:]
        first = pattern[0]
        for start in range(end - n - 1, -1, -1):  # latest match first; a match must leave a token after it
            if context[start] == first and context[start: start + n] == pattern:
                return context[start + n: start + n + num_tokens]
    return []


class PromptLookupDrafter:
    """A drafter.Drafter proposing the prompt-lookup chain (see the module docstring)."""

    name = "prompt_lookup"
    origin_names = ("prompt_lookup",)
    feature_layers: list[int] = []

    def __init__(self, num_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1):
        if num_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need num_tokens >= 1 and 1 <= min_ngram <= max_ngram, got {num_tokens}, "
                             f"{min_ngram}, {max_ngram}")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.context: list[int] = []  # every token before the current root
        self.root: int | None = None

    def tree_sizes(self) -> list[int]:
        return list(range(1, self.num_tokens + 2))

    def warmup(self, max_length: int) -> None:
        pass

    def session(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def begin(self, input_ids: torch.Tensor, features, max_length: int) -> None:
        self.context = input_ids[0].tolist()
        self.root = None

    def continuation(self, root: torch.Tensor) -> list[int]:
        """The lookup chain after `root` (which joins the context now)."""
        self.root = int(root.view(-1)[0])
        return lookup_continuation(self.context + [self.root], self.num_tokens, self.max_ngram, self.min_ngram)

    def propose(self, root: torch.Tensor, params=None, generator=None) -> DraftTree:
        return chain_tree(root, self.continuation(root), origin=1)

    def accept(self, path, new_tokens: torch.Tensor, features) -> None:
        self.context.append(self.root)
        self.context += new_tokens[:-1].tolist()
