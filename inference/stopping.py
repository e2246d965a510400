"""Where plain decoding would stop inside a step's accepted tokens: eos, stop strings, max_new_tokens."""

from __future__ import annotations

from typing import Any


class Stopper:
    def __init__(self, eos: set[int], stop: list[str], tokenizer: Any, max_new_tokens: int):
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer=... to from_pretrained or generate")
        self.eos, self.stop, self.tokenizer, self.max_new = eos, stop, tokenizer, max_new_tokens
        self.longest = max((len(s) for s in stop), default=0)
        self.text_len = 0  # characters of the decoded new tokens so far

    def cut(self, done: list[int], batch: list[int]) -> int | None:
        """Number of tokens of `batch` to keep if generation ends inside it (or right after it), else None."""
        room = self.max_new - len(done)
        end = next((j + 1 for j, tok in enumerate(batch[:room]) if tok in self.eos), None)
        limit = end if end is not None else min(len(batch), room)
        hit = self._stop_string(done, batch[:limit]) if self.stop else None
        return limit if hit is None and (end is not None or len(batch) >= room) else hit

    def _stop_string(self, done: list[int], batch: list[int]) -> int | None:
        decode = self.tokenizer.decode
        start = max(self.text_len - self.longest, 0)
        text = decode(done + batch)
        if not any(s in text[start:] for s in self.stop):
            self.text_len = len(text)
            return None
        hits = (j for j in range(1, len(batch) + 1) if any(s in decode(done + batch[:j])[start:] for s in self.stop))
        return next(hits)  # the first token after which a stop string is present (the whole batch holds one)
