"""EAGLE-2 dynamic trees from a draft head for every row of a batch, with the head's KV full or windowed.

The head's KV holds, per row, the true pairs (target feature at t, token t+1) at the slot of position t, then a
shared scratch region for the current tree's drafted frontier. With `window` set the stable part is StreamingLLM's
sink + ring layout (runners/kv.py): as the head has one layer, pairs outside the window are never computed at all.
"""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path
from typing import Callable

import torch

from drafthead.masks import to_additive
from drafthead.model import DraftHead

from ..cpu.small_gemm import (BATCH_KERNEL_ROWS, int8_drafting, int8_weights, release_kernels, small_row_kernel,
                              use_small_row_kernel)
from ..drafter import Accepted, Drafter
from ..runners.attention import decoding_attention
from ..runners.compile import compile_step
from ..runners.kv import SlotMap
from ..tree import DraftTree, TreeOptions, expand_tree, select_tree

FEED_CHUNK = 256  # pairs per head forward when feeding a prompt


def head_top_k(head: DraftHead, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (..., H) -> (log-probs (..., k) float32, target ids (..., k)) of each row's top-k draft tokens."""
    logp = torch.log_softmax(head.logits(hidden).float(), dim=-1)
    top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    return top.values, head.draft_to_target(top.indices)


def widen(t: torch.Tensor, width: int) -> torch.Tensor:
    """t (B, m, ...) padded with zeros (False) along dim 1 to `width` columns (m <= width)."""
    return torch.cat([t, t.new_zeros((t.shape[0], width - t.shape[1], *t.shape[2:]))], dim=1)


def _release(head: DraftHead, int8: bool) -> None:
    release_kernels(head)
    if int8:
        release_kernels(head, "int8")


class RowSlotCache:
    """Duck-types transformers' `cache.update(keys, values, layer_idx)`: writes each row's new entries at its own
    `slots` (B, n), set before each forward, and returns the whole buffers (B, kv_heads, S, head_dim)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values
        self.slots: torch.Tensor | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int = 0, *args, **kwargs):
        rows = torch.arange(self.keys.shape[0], device=self.keys.device).unsqueeze(1)
        self.keys[rows, :, self.slots] = keys.transpose(1, 2)  # (B, n, kv_heads, D) at each row's slots (B, n)
        self.values[rows, :, self.slots] = values.transpose(1, 2)
        return self.keys, self.values


class HeadDrafter(Drafter):
    """A drafter drafting EAGLE-2 trees with a DraftHead (it runs inside the target runner's session)."""

    name = "eagle"
    origin_names = ("head",)

    def __init__(self, head: DraftHead, options: TreeOptions, sink: int = 0, window: int | None = None,
                 compile: bool = False, weights: str = "auto"):
        self.head = head.eval()
        self.dtype = next(head.parameters()).dtype
        self.device = next(head.parameters()).device
        self.kernel = use_small_row_kernel(head, float32=True) > 0
        self.attention = decoding_attention(self.device, self.dtype)
        # "auto": a float32 head drafts from int8 copies, a quarter of the bytes a depth, accepted as often
        # (docs/results/gguf_q4_1_draft_weights_int8_spr_amx.json)
        self.int8 = int8_drafting(head, weights, auto_int8=True)
        self.close = weakref.finalize(self, _release, head, self.int8)
        self.opt = options
        self.layout = SlotMap(sink, window)
        self.tree_size = self.smallest_tree = options.tree_size  # every tree holds all its total_tokens
        self.path_width = options.depth + 1  # nodes on its trees' longest path (root included): a steady step's pairs
        self.feature_layers = list(head.config.aux_layer_ids)
        self.cache: RowSlotCache | None = None
        self.slot_pos: torch.Tensor | None = None  # (B, capacity) position held by each slot, -1 if none
        self.next_pos: torch.Tensor | None = None  # (B,) pairs fed so far (the root's position)
        self.pending: dict[str, torch.Tensor] = {}  # true pairs waiting for the next root
        # a steady drafting step: compiled, one per tree shape and buffer shape (a prompt's feed runs eagerly)
        self.compiled = compile
        self._steps: dict[tuple[int, ...], Callable] = {}  # KV buffer shape -> its compiled step
        self._step = self._draft  # the current buffers' step (begin())

    @property
    def kv_shape(self) -> tuple[int, ...]:
        return tuple(self.cache.keys.shape)  # (B, kv_heads, stable + tree slots, head_dim)

    @contextlib.contextmanager
    def _drafting(self):
        """The head's kernels for the block: the small-row GEMM and the decoding attention (restored after)."""
        config = self.head.midlayer.self_attn.config
        previous = config._attn_implementation
        config._attn_implementation = self.attention or previous
        try:
            with small_row_kernel(BATCH_KERNEL_ROWS), int8_weights(self.int8):
                yield
        finally:
            config._attn_implementation = previous

    def begin(self, runner, input_ids: torch.Tensor, attention_mask, features: torch.Tensor) -> None:
        """Fresh buffers; the prompt's pairs the layout keeps wait for the first roots (the last pair's token)."""
        b, t = input_ids.shape
        device = features.device
        self.stable_slots = self.layout.size(runner.capacity)
        self.capacity = self.stable_slots + self.opt.depth * self.opt.top_k + 1
        self.dummy = self.capacity - 1  # the slot padded entries write to
        shape = (b, self.head.config.num_key_value_heads, self.capacity, self.head.config.head_dim)
        if self.cache is None or tuple(self.cache.keys.shape) != shape:  # else reused: slot_pos says what is held
            self.cache = RowSlotCache(torch.zeros(shape, dtype=self.dtype, device=device),
                                      torch.zeros(shape, dtype=self.dtype, device=device))
            self.slot_pos = torch.empty((b, self.capacity), dtype=torch.long, device=device)
            self._fix_addresses()
            if self.compiled and shape not in self._steps:
                self._steps[shape] = self._compile_step(shape, getattr(runner, "step_store", None))
            self._step = self._steps.get(shape, self._draft)
        self.slot_pos.fill_(-1)
        self.next_pos = torch.zeros(b, dtype=torch.long, device=device)
        lengths = runner.positions  # (B,) prompt tokens of each row
        positions, valid = self.layout.needed(self.next_pos, lengths)
        columns = (runner.start[:, None] + positions).clamp(max=t - 1)  # left padding: row i starts at start_i
        feats = features.gather(1, columns[..., None].expand(-1, -1, features.shape[-1]))
        tokens = input_ids.to(device).gather(1, (columns + 1).clamp(max=t - 1))
        self.pending = dict(features=feats, tokens=tokens, positions=positions, valid=valid,
                            is_root=valid & (positions == lengths[:, None] - 1))

    def _compile_step(self, shape: tuple[int, ...], store: Path | None) -> Callable:
        """The steady step compiled for KV buffers of `shape`, kept under their shape and layout in `store`."""
        name = f"draft{self.opt.depth}_{self.opt.top_k}_{self.opt.total_tokens}"
        window = f"-sink{self.layout.sink}-window{self.layout.window}" if self.layout.window else ""
        file = f"{name}-{'x'.join(map(str, shape))}{window}.pt2"
        return compile_step(self._draft, self.device, cpp_wrapper=self.device.type == "cpu", frozen=not self.kernel,
                            name=name, store=store and store / file)

    @torch.inference_mode()
    def propose(self, roots: torch.Tensor, params=None, generator=None) -> DraftTree:
        """Feed each row's pending pairs (the last one's token is its root), then draft the rows' trees."""
        steady = self.pending["tokens"].shape[1] == self.path_width
        with self._drafting():
            return DraftTree(*(self._step if steady else self._draft)(roots))

    @torch.inference_mode()
    def skip(self, roots: torch.Tensor) -> None:
        """A plain step instead of a tree: the pending pairs are fed all the same."""
        with self._drafting():
            self._feed_pending(roots)

    def accept(self, accepted: Accepted, features: torch.Tensor) -> None:
        """Row i's pairs: the accepted nodes' true features, each with the token after it (the last: the root),
        padded to path_width (the steady step's shape) unless a longer path was accepted (a lookup chain)."""
        longest = max((len(p) for p in accepted.host_paths), default=0)
        width = self.path_width if longest <= self.path_width else accepted.paths.shape[1]
        nodes = widen(accepted.paths[:, :width], width).clamp_min(0)  # (B, width); padding reads node 0, never used
        feats = features.gather(1, nodes[..., None].expand(-1, -1, features.shape[-1]))
        j = torch.arange(nodes.shape[1], device=nodes.device)[None, :]
        counts = accepted.counts[:, None]
        tokens = widen(accepted.tokens[:, :width], width).clamp_min(0)
        self.pending = dict(features=feats, tokens=tokens, positions=self.next_pos[:, None] + j, valid=j < counts,
                            is_root=j == counts - 1)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.cache.keys, self.cache.values = self.cache.keys[rows], self.cache.values[rows]
        self.slot_pos, self.next_pos = self.slot_pos[rows], self.next_pos[rows]
        self.pending = {k: v[rows] for k, v in self.pending.items()}
        self._fix_addresses()

    def _fix_addresses(self) -> None:
        """The compiled step mutates these in place: fixed addresses keep them inside its CUDA graph."""
        if self.compiled:
            for t in (self.cache.keys, self.cache.values, self.slot_pos):
                torch._dynamo.mark_static_address(t)

    @torch.inference_mode()
    def admit(self, row: int, runner, ids: torch.Tensor, features: torch.Tensor) -> None:
        """Row `row` holds a new prompt (ids (T,), features (T, F)): its kept pairs are fed now on that row alone,
        but the last one (its token is the root) waits with the other rows' pending pairs."""
        t = ids.shape[0]
        device = features.device
        positions, valid = self.layout.needed(torch.tensor([0], device=device), torch.tensor([t], device=device))
        feats = features[positions.clamp(max=t - 1)]  # positions (1, M): all valid, ascending
        tokens = ids.to(device)[(positions + 1).clamp(max=t - 1)]
        full = self.cache, self.slot_pos
        self.cache = RowSlotCache(full[0].keys[row: row + 1], full[0].values[row: row + 1])  # views of the row
        self.slot_pos = full[1][row: row + 1]
        self.slot_pos.fill_(-1)
        with self._drafting():
            self._feed_pairs(tokens[:, :-1], feats[:, :-1], positions[:, :-1], valid[:, :-1])
        self.cache, self.slot_pos = full
        self.next_pos[row] = t - 1
        width = max(self.pending["tokens"].shape[1], 1)
        for key, value in dict(features=feats, tokens=tokens, positions=positions, valid=valid, is_root=valid).items():
            merged = widen(self.pending[key], width)
            merged[row] = widen(value[:, -1:], width)[0]
            self.pending[key] = merged

    def _forward(self, tokens, hidden, positions, valid) -> torch.Tensor:
        """True pairs (B, m) at their rows' slots, each attending its row's held pairs up to its position; invalid
        entries write and attend only the dummy slot. Returns (B, m, H)."""
        slots = torch.where(valid, self.layout.slots(positions), self.dummy)
        self.slot_pos.scatter_(1, slots, torch.where(valid, positions, -1))
        self.slot_pos[:, self.dummy] = -1
        held = self.slot_pos[:, None, :]
        allowed = (held >= 0) & (held <= positions[:, :, None])  # (B, m, capacity)
        allowed[:, :, self.dummy] = ~valid
        self.cache.slots = slots
        return self.head(tokens, hidden, positions, to_additive(allowed.unsqueeze(1), self.dtype), self.cache)

    def _draft(self, roots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One drafting step: feed the pending pairs, then expand and select each row's tree; the frontier, at the
        shared scratch slots, attends its row's true pairs and its own drafted ancestors."""
        last = self._feed_pending(roots)  # (B, 1, H)
        scores, tokens = head_top_k(self.head, last[:, 0], self.opt.top_k)
        b = roots.shape[0]
        held = self.slot_pos >= 0  # (B, capacity): each row's true pairs
        s = self.stable_slots

        def step(d, f, frontier_tokens, parent_hidden, rows):
            k = frontier_tokens.shape[1]
            allowed = held[:, None, :].expand(b, k, self.capacity).clone()
            allowed[:, :, s: s + f + k] = rows
            self.cache.slots = torch.arange(s + f, s + f + k, device=roots.device).expand(b, k)
            positions = (self.next_pos - 1 + d)[:, None].expand(b, k)
            out = self.head(frontier_tokens, parent_hidden, positions, to_additive(allowed.unsqueeze(1), self.dtype),
                            self.cache)  # (B, k, H)
            return (out, *head_top_k(self.head, out, k))

        candidates = expand_tree(scores, tokens, last, self.opt.depth, step)
        return select_tree(roots, *candidates, self.opt.total_tokens, self.opt.depth)

    def _feed_pending(self, roots: torch.Tensor) -> torch.Tensor:
        """Feed the pending pairs (the last one's token: each row's root). Returns the last pair's output (B, 1, H)."""
        p = self.pending
        tokens = torch.where(p["is_root"], roots[:, None], p["tokens"])
        last = self._feed_pairs(tokens, p["features"], p["positions"], p["valid"])
        fed = torch.where(p["valid"], p["positions"], -1).max(dim=1).values + 1  # 0 for a row feeding nothing
        self.next_pos = torch.maximum(self.next_pos, fed)
        return last

    def _feed_pairs(self, tokens, features, positions, valid) -> torch.Tensor | None:
        """Feed true pairs (B, m), valid ones first in each row, in chunks. Returns each row's head output at its
        last valid pair (B, 1, H); None when m is 0."""
        chunk = min(FEED_CHUNK, self.layout.window or FEED_CHUNK)  # a chunk never wraps the ring onto itself
        end = valid.sum(dim=1) - 1  # each row's last valid pair
        last = None
        for c0 in range(0, tokens.shape[1], chunk):
            part = slice(c0, c0 + chunk)
            out = self._forward(tokens[:, part], self.head.fuse(features[:, part].to(self.dtype)),
                                positions[:, part], valid[:, part])
            at = (end - c0).clamp(0, out.shape[1] - 1)  # in this chunk, or its last pair if it comes later
            pick = out.gather(1, at[:, None, None].expand(-1, 1, out.shape[-1]))
            last = pick if last is None else torch.where((end >= c0)[:, None, None], pick, last)
        return last
