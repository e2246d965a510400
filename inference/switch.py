"""Batched decoding that speculates only while it pays: each step, speculate or take a plain step, by measured cost.

A speculative step costs the drafting plus one verification of every row's draft, and pays only while the rows
accept enough of it; with a short context (cheap KV) or a tail of rows that accept little, a plain step (each row's
root verified alone) delivers more tokens a second. Both kinds are exact, so the choice changes the speed only.

The switch keeps, per number of rows in use, the least of the last few step times of each kind (a step that compiled
a graph or met a slow spell stops counting), and per request a running mean of its tokens per speculative step; it
speculates when the expected tokens per speculative second beat the rows per plain second. A kind not yet measured
is tried once (speculation first); the other kind is tried again every `recheck_every` steps.
"""

from __future__ import annotations

from collections import deque


class SpeculationSwitch:
    """Chooses, each step of a batched decode, between speculating and a plain step (see the module docstring).
    One decode at a time: `reset()` at its start (decode.py does)."""

    def __init__(self, recheck_every: int = 32, keep: int = 4, smoothing: float = 0.5):
        if recheck_every < 2 or keep < 1 or not 0 < smoothing <= 1:
            raise ValueError("recheck_every >= 2, keep >= 1 and 0 < smoothing <= 1 expected")
        self.recheck_every, self.keep, self.smoothing = recheck_every, keep, smoothing
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[tuple[bool, int], deque] = {}  # (speculative, rows in use) -> recent step seconds
        self.gain: dict[int, float] = {}  # request -> tokens per speculative step (running mean)
        self.steps, self.choice = 0, True
        self.last_switch = 0  # the step the other kind last ran

    def cost(self, speculative: bool, rows: int) -> float | None:
        """Seconds a step of this kind takes with `rows` rows in use: the least of its last measurements there; for
        speculation without any there, the measurement at the nearest larger batch (a larger batch costs more, so
        this leans towards trying the plain step); None if nothing fits."""
        seen = self.seconds.get((speculative, rows))
        if not seen and speculative:
            larger = [b for s, b in self.seconds if s and b > rows]
            seen = self.seconds[True, min(larger)] if larger else None
        return min(seen) if seen else None

    def speculate(self, requests: list[int]) -> bool:
        """Whether the next step speculates, for the requests the batch's rows hold (finished ones excluded)."""
        rows = len(requests)
        spec, plain = self.cost(True, rows), self.cost(False, rows)
        if spec is None or not self.gain:
            choice = True
        elif plain is None:
            choice = False
        else:
            prior = sum(self.gain.values()) / len(self.gain)  # a request not measured yet: as the others
            choice = sum(self.gain.get(r, prior) for r in requests) / spec >= rows / plain
            if self.steps - self.last_switch >= self.recheck_every and choice == self.choice:
                choice = not choice  # measure the other kind again
        if choice != self.choice:
            self.last_switch = self.steps
        self.choice = choice
        return choice

    def record(self, speculative: bool, requests: list[int], seconds: float, tokens: list[int]) -> None:
        """One step done: its kind, the requests of its rows in use, its seconds and each request's new tokens."""
        self.steps += 1
        self.seconds.setdefault((speculative, len(requests)), deque(maxlen=self.keep)).append(seconds)
        if speculative:
            for r, n in zip(requests, tokens):
                old = self.gain.get(r)
                self.gain[r] = n if old is None else old + self.smoothing * (n - old)
