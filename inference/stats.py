"""What a generation measured: tokens, target forwards, accepted lengths, time by phase."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from .drafter import Accepted
from .tree import DraftTree


def accept_histogram(lengths: list[int]) -> dict[int, int]:
    """Accepted length (bonus included) -> number of verification steps with that length, sorted."""
    return dict(sorted(Counter(lengths).items()))


@dataclass
class GenerationStats:
    """tau = mean_accepted: tokens emitted per verification forward (accepted drafts + the bonus token)."""

    new_tokens: int = 0
    target_forwards: int = 0  # prefill + verifications
    accept_lengths: list[int] = field(default_factory=list)  # per row and verification, bonus included, before stops
    # per drafter of a composition (DraftTree.origin): drafted nodes proposed, and accepted, by each
    drafted_by: dict[str, int] = field(default_factory=dict)
    accepted_by: dict[str, int] = field(default_factory=dict)
    rows_new_tokens: list[int] = field(default_factory=list)  # new tokens of each row (request)
    rows_steps: list[int] = field(default_factory=list)  # verifications each row took until it stopped
    # the leading steps with every row of the batch decoding (continuous batching: until its queue runs dry and rows
    # start leaving): how many, the new tokens kept by then, and the seconds they took from the first step
    busy_steps: int = 0
    busy_tokens: int = 0
    busy_time_s: float = 0.0
    prefill_time_s: float = 0.0  # the prompts' forward + the drafter's begin
    admit_time_s: float = 0.0  # continuous batching: waiting requests loaded into freed rows
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0  # target forwards after the prefill + verification + cache compaction
    plain_steps: int = 0  # with speculate="auto": steps that verified every row's root alone
    total_time_s: float = 0.0

    def count(self, tree: DraftTree, accepted: Accepted, origin_names: tuple[str, ...]) -> None:
        """Record one verification: each row's accepted length and, if the tree names its drafters, who drafted what."""
        self.target_forwards += 1
        self.accept_lengths += [len(p) for p in accepted.host_paths]
        if tree.origin is None:
            return
        origin = tree.origin.tolist()  # a few dozen ints a row, counted on the host
        for row, path in zip(origin, accepted.host_paths):
            taken = [row[i] for i in path[1:]]
            for bit, name in enumerate(origin_names):
                self.drafted_by[name] = self.drafted_by.get(name, 0) + sum(o >> bit & 1 for o in row[1:])
                self.accepted_by[name] = self.accepted_by.get(name, 0) + sum(o >> bit & 1 for o in taken)

    @property
    def mean_accepted(self) -> float:
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def histogram(self) -> dict[int, int]:
        return accept_histogram(self.accept_lengths)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        return dict(asdict(self), mean_accepted=self.mean_accepted, histogram=self.histogram,
                    tokens_per_s=self.tokens_per_s)
