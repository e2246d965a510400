"""Batched target runner: B rows in preallocated KV buffers, each row advancing by its own accepted length.

Layout of one row in the (B, kv_heads, capacity, head_dim) buffers (transformers' StaticCache):

    [ left padding | committed tokens: slots start_i .. length_i-1 | hole | tree: W .. W+n-1 | ... | scratch ]

- prefill() takes left-padded prompts (B, T) with their attention mask: row i's tokens start at slot start_i.
- verify() writes every row's tree at the same slots W = max_i length_i (StaticCache writes one slot range for
  the whole batch) with per-row positions (length_i - start_i + depth) and a per-row 4D mask: the row's committed
  range plus its tree's ancestor pattern. A shorter row has a masked hole between its length and W.
- commit() copies each row's accepted nodes down to its own length (one gather + one scatter for every layer and
  row at once), so a row's committed tokens stay contiguous and the hole never outlives a step: the buffers never
  fragment, and nothing needs re-packing while rows are alive.
- The buffers keep their batch size while a batch decodes: the rows in use are always the leading rows (a
  contiguous slice), keep_rows() moves the rows still decoding forward (only the rows that move are copied), and
  verify() pads its inputs to the buffers' size, passing the attention kernel and the small-row GEMM
  (small_gemm.live_entries) the number of rows in use, so rows that stop stop costing attention (the bulk of a
  long-context step) and GEMM work, and a compiled verify keeps one graph per (batch, tree size). admit() puts a
  waiting request's prefilled KV into a finished row instead (continuous batching).

Prompts are prefilled in chunks under SDPA over the used prefix of the buffers (fused and memory-efficient for
long query blocks); the short verify steps use the same attention kernel as the single-sequence fast runner
(attention.py), over the whole buffer: in bf16 a sliced buffer makes the batched matmul copy it (measured 24 ms
against 7 ms per layer for 8 rows of 8k keys), while the buffer is sized to the batch's longest row anyway.
With `compile`, the verify step is one torch.compile graph per tree size for the current buffers (inductor with
prepacked weights on CPU: 8 rows × 8k keys, SmolLM2 bf16, 2-core Zen 5 EPYC: one token per row 89 -> 78 ms, four
131 -> 115 ms). A graph keeps the buffers it was traced with and its own prepacked weights, so buffers of a new
shape (rows, capacity) come with a new step, and the old buffers are freed with the old step's graphs: memory
stays that of one batch shape (keeping every shape's buffers ran a 2k/4k/8k × 1-16 rows grid out of 24 GB).
Prefill runs eagerly.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence
from transformers import StaticCache

from drafthead.masks import to_additive
from drafthead.utils import cache_argument

from .attention import PREFILL_NAME, attention_implementation, kv_length_kwargs
from .slots import keep_leading_rows
from .small_gemm import BATCH_KERNEL_ROWS, live_entries
from .static_runner import (attach_target, buffer_capacity, compile_step, decoding_session, forward_with_features,
                            release_step, set_write_slot, static_cache)

PREFILL_CHUNK = 512


def forward_on_cache(model: nn.Module, cache: StaticCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     allowed: torch.Tensor, write_at: int, kv_length: int | None = None, keep: int = 0):
    """One forward of `model` (B, n tokens at explicit positions) over a StaticCache: the new entries are written at
    slots write_at..write_at+n-1 for every row, and row b's query i attends the slots where allowed[b, i] (bool
    (B, n, slots)). `kv_length`: the used slots, for this project's prefix-aware attention kernels. `keep`: logits
    of the last `keep` positions only (0: all). Returns the model's output."""
    set_write_slot(cache, write_at)
    extra = kv_length_kwargs(model, kv_length)
    return model(input_ids=input_ids, position_ids=position_ids,
                 attention_mask=to_additive(allowed.unsqueeze(1), cache.layers[0].keys.dtype),
                 **{cache_argument(model): cache}, use_cache=True, logits_to_keep=keep, **extra)


class BatchRunner:
    """Target runner for a batch of rows (see the module docstring). `feature_layers`: decoder-layer outputs the
    head reads ([] for none)."""

    def __init__(self, model: nn.Module, feature_layers: list[int], prefill_chunk: int = PREFILL_CHUNK,
                 compile: bool = False):
        attach_target(self, model, feature_layers, "batched decoding runs on static KV buffers, which do not support",
                      compile, float32_kernel=True)
        self.prefill_chunk = prefill_chunk
        self.compiled = compile
        self.compile_s: dict[tuple[int, int, int], float] = {}  # (rows, capacity, tree size) -> first step's seconds
        self._step = None  # the verify step of the current buffers (built on first use)
        self._traced: set[int] = set()  # tree sizes the current step has run
        self.cache: StaticCache | None = None
        self.capacity = 0
        self.slot_ids = torch.zeros(0, dtype=torch.long, device=self.device)  # arange(capacity)
        self.start = self.length = torch.zeros(0, dtype=torch.long, device=self.device)
        self.tree_at = 0  # W: the slot of the last verified tree's root

    # --------------------------------------------------------------------------------------------- buffers
    def reset(self, batch: int, length: int) -> None:
        """Buffers for `batch` rows of up to `length` slots each (prompt with its padding + new tokens + the
        largest tree); reused when they already fit."""
        capacity = buffer_capacity(length + 1)  # + the scratch slot
        if self.cache is None or self.rows != batch or self.capacity < capacity:
            # a compiled graph keeps the buffers it was traced with (and its own prepacked weights): new buffers get
            # a new step, and the old buffers go with the old step's graphs, so memory stays that of one batch shape
            release_step(self._step)
            self.cache = self._step = None  # the old buffers can go before the new ones are allocated
            self._traced = set()
            self.cache = static_cache(self.model, batch, capacity)
            self.capacity = capacity
            self.slot_ids = torch.arange(capacity, device=self.device)
        self.start = self.length = torch.zeros(batch, dtype=torch.long, device=self.device)

    @property
    def rows(self) -> int:
        """Rows of the buffers (the batch the runner was reset for)."""
        return self.cache.layers[0].keys.shape[0] if self.cache is not None else 0

    @property
    def batch(self) -> int:
        """Rows in use: the leading `batch` rows of the buffers."""
        return self.start.shape[0] if self.cache is not None else 0

    @property
    def scratch(self) -> int:
        """A slot no row ever reads: padded copies land there."""
        return self.capacity - 1

    @property
    def positions(self) -> torch.Tensor:
        """(B,) the next position of each row (its committed token count)."""
        return self.length - self.start

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) of the rows in use of every layer, each (B, kv_heads, capacity, head_dim): views of the
        leading rows of the buffers."""
        b = self.batch
        return [(layer.keys[:b], layer.values[:b]) for layer in self.cache.layers]

    def slots_of(self, positions: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Buffer slots of committed positions (B, M) of each row in use, or (R, M) of the rows `rows` (R,)."""
        start = self.start if rows is None else self.start[rows]
        return start[:, None] + positions

    @torch.inference_mode()
    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the rows in use), in that order, as the leading rows of the same buffers;
        only the rows whose place changes are copied (so keep the rows that stay where they are)."""
        # (8 rows × 8k, 30 layers: a row moved in place ~8 ms, gathered ~33: its used slots read and written once)
        used = [slice(int(start), int(stop)) for start, stop in zip(self.start[rows], self.length[rows])]
        keep_leading_rows(self.cache.drafthead_kv, rows.tolist(), used)
        self.start, self.length = self.start[rows], self.length[rows]

    def snapshot(self) -> dict:
        """A copy of the buffers and row state (to rerun the same prefilled batch with another drafter)."""
        return {"kv": [(k.clone(), v.clone()) for k, v in self.layers()], "start": self.start.clone(),
                "length": self.length.clone()}

    @torch.inference_mode()
    def restore(self, state: dict) -> None:
        """Back to a snapshot() of this runner (same rows), in the same buffers."""
        self.start, self.length = state["start"].clone(), state["length"].clone()
        for (keys, values), (k, v) in zip(self.layers(), state["kv"]):
            keys.copy_(k)
            values.copy_(v)

    def export_rows(self) -> list[dict]:
        """Each row's committed entries [start_i, length_i) of every layer (to rebuild other batches from the
        same prefilled prompts with load_rows)."""
        rows = []
        for i in range(self.batch):
            part = slice(int(self.start[i]), int(self.length[i]))
            rows.append({"kv": [(k[i: i + 1, :, part].clone(), v[i: i + 1, :, part].clone())
                                for k, v in self.layers()]})
        return rows

    @torch.inference_mode()
    def load_rows(self, rows: list[dict]) -> None:
        """Fill a reset() batch with rows from export_rows(), row i's entries from slot 0."""
        self.start = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        self.length = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        for i, row in enumerate(rows):
            self.admit(i, row["kv"])

    @torch.inference_mode()
    def admit(self, row: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Row `row` now holds another request: its prompt's entries `kv` (per layer (keys, values), each
        (1, kv_heads, T, head_dim), as export_rows() gives them) from slot 0."""
        t = kv[0][0].shape[2]
        if t >= self.scratch:
            raise RuntimeError(f"a {t}-token request does not fit the KV buffers ({self.capacity} slots)")
        for (keys, values), (k, v) in zip(self.layers(), kv):
            keys[row, :, :t] = k[0]
            values[row, :, :t] = v[0]
        index = torch.tensor([row], device=self.device)
        self.start, self.length = self.start.index_fill(0, index, 0), self.length.index_fill(0, index, t)

    def session(self) -> contextlib.AbstractContextManager:
        """The model dispatches attention to this runner's kernel inside it, and multiplies a step's rows × tree
        tokens with the small-row GEMM up to small_gemm.BATCH_KERNEL_ROWS (static_runner.decoding_session)."""
        return decoding_session(self, BATCH_KERNEL_ROWS)

    def close(self) -> None:
        if self.capture is not None:
            self.capture.detach()

    # --------------------------------------------------------------------------------------------- forward
    def _step_forward(self, input_ids, position_ids, mask, rows):
        """One verify step over the whole buffers (B rows of the buffers, n tokens each; `mask` additive (B, 1, n,
        capacity)), attention computed for the leading `rows` rows only (0-dim tensor). Returns (logits (B, n, V),
        features (B, n, F) or None, argmax (B, n)): the compiled graph when compile is on."""
        logits, features = forward_with_features(self, lambda: self.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
            **{self.cache_argument: self.cache}, use_cache=True, **kv_length_kwargs(self.model, None, rows)))
        # the greedy choice inside the graph: a fused argmax beats eager bf16 argmax over the vocabulary
        return logits, features, logits.argmax(dim=-1)

    def _forward(self, input_ids, position_ids, allowed, write_at: int, kv_length: int | None, keep: int = 0):
        return forward_with_features(self, lambda: forward_on_cache(self.model, self.cache, input_ids, position_ids,
                                                                    allowed, write_at, kv_length, keep))

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Left-padded prompts (B, T) and their mask (1 = token, 0 = padding on the left). Returns (last logits
        (B, V), features (B, T, F) or None; padded positions hold junk)."""
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(self.device).long()
        start = t - attention_mask.sum(dim=1)
        slot = self.slot_ids[:t]
        if not torch.equal(attention_mask.bool(), slot[None, :] >= start[:, None]):
            raise ValueError("batched prompts must be left-padded: each attention_mask row is 0s then 1s "
                             "(tokenizer.padding_side = 'left')")
        if (start >= t).any():
            raise ValueError("every prompt needs at least one token")
        self.start, self.length = start, torch.zeros_like(start)
        positions = (slot[None, :] - start[:, None]).clamp_min(0)  # padding sits at position 0
        keys = self.slot_ids
        features = []
        with attention_implementation(self.model, PREFILL_NAME):
            for c0 in range(0, t, self.prefill_chunk):
                c1 = min(c0 + self.prefill_chunk, t)
                query = slot[c0:c1]
                allowed = (keys[None, None, :] <= query[None, :, None]) & (keys[None, None, :] >= start[:, None, None])
                allowed |= keys[None, None, :] == query[None, :, None]  # padding attends itself (never all-masked)
                logits, feats = self._forward(input_ids[:, c0:c1].to(self.device), positions[:, c0:c1], allowed,
                                              c0, c1, keep=1)
                features.append(feats)
        self.length = torch.full_like(start, t)
        return logits[:, -1], (torch.cat(features, dim=1) if features[0] is not None else None)

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, depths: torch.Tensor,
               ancestors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One forward over every row's tree: tokens (B, n) root first; depths (B, n); ancestors (B, n, n) bool.
        Returns (logits (B, n, V), features (B, n, F) or None, argmax (B, n))."""
        b, n = tokens.shape
        w = int(self.length.max())
        if w + n > self.scratch:
            raise RuntimeError(f"rows of up to {w} slots + a {n}-token tree exceed the KV buffers "
                               f"({self.capacity}); reset() with the full length first")
        keys = self.slot_ids
        prefix = (keys[None, :] >= self.start[:, None]) & (keys[None, :] < self.length[:, None])  # (B, capacity)
        allowed = prefix.unsqueeze(1).expand(b, n, self.capacity).clone()
        allowed[:, :, w: w + n] = ancestors
        positions = self.positions[:, None] + depths
        if b < self.rows:  # rows that stopped: repeat the last row in use (their writes land in unused rows)
            pad = torch.arange(self.rows, device=self.device).clamp_max(b - 1)
            tokens, positions, allowed = tokens[pad], positions[pad], allowed[pad]
        set_write_slot(self.cache, w)
        mask = to_additive(allowed.unsqueeze(1), self.dtype)
        if self._step is None:
            # the buffers' guards are skipped (compile_step's `unguarded`): new buffers come with a new step (reset)
            self._step = (compile_step(self._step_forward, self.device, name="batch_verify", unguarded=("self.cache",))
                          if self.compiled else self._step_forward)
        t0 = time.perf_counter()
        with live_entries(b) as rows:  # rows that stopped cost neither attention nor GEMM work
            logits, features, greedy = self._step(tokens, positions, mask, rows)
        if n not in self._traced:
            self._traced.add(n)
            self.compile_s[(self.rows, self.capacity, n)] = time.perf_counter() - t0
        self.tree_at = w
        return logits[:b], (features[:b] if features is not None else None), greedy[:b]

    @torch.inference_mode()
    def commit(self, paths: list[torch.Tensor]) -> None:
        """Row i keeps the nodes paths[i] (indices into its last verified tree, root first) after its committed
        tokens."""
        counts = torch.tensor([p.shape[0] for p in paths], device=self.device)
        m = int(counts.max())
        j = torch.arange(m, device=self.device)
        valid = j[None, :] < counts[:, None]
        src = torch.where(valid, self.tree_at + pad_sequence(paths, batch_first=True).to(self.device), self.scratch)
        dst = torch.where(valid, self.length[:, None] + j, self.scratch)
        kv = self.cache.drafthead_kv  # (2, layers, rows, kv_heads, slots, head_dim): all layers (static_cache)
        rows = torch.arange(self.batch, device=self.device)[:, None]
        kv[:, :, rows, :, dst] = kv[:, :, rows, :, src]
        self.length = self.length + counts
