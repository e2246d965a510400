"""Where plain decoding would stop inside a step's accepted tokens: eos, stop strings, max_new_tokens."""

from __future__ import annotations

from typing import Any


class Stopper:
    """Where plain decoding would stop inside a batch of new tokens: eos, stop strings, max_new_tokens."""

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
        if self.stop:
            hit = self._stop_string(done, batch[:limit])
            if hit is not None:
                return hit
        if end is not None or len(batch) >= room:
            return limit
        return None

    def _stop_string(self, done: list[int], batch: list[int]) -> int | None:
        decode = self.tokenizer.decode
        start = max(self.text_len - self.longest, 0)
        if not any(s in decode(done + batch)[start:] for s in self.stop):
            self.text_len = len(decode(done + batch))
            return None
        for j in range(1, len(batch) + 1):  # the first token after which a stop string is present
            if any(s in decode(done + batch[:j])[start:] for s in self.stop):
                return j
        return None
