"""The target runner: B rows (batch 1 is B = 1) in preallocated KV buffers, each row advancing by its own accepted
length; verify steps of fixed shapes, optionally compiled (docs/architecture.md has the design).

Layout of one row in the (B, kv_heads, capacity, head_dim) buffers (kv.static_cache: every layer a view of one tensor):

    [ left padding | committed tokens: slots start_i .. length_i-1 | hole | tree: W .. W+n-1 | ... | scratch ]

verify() writes every row's tree at W = max_i length_i (per-row positions and 4D mask), padded to a bucket: one
compiled graph per bucket and buffer shape (on a CPU, one row's buckets on the small-row kernel share one).
commit() copies each row's accepted nodes down to its length, so the hole never outlives a step. The rows in use
are always the leading ones; the lengths are mirrored on the host.
"""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from transformers import StaticCache

from drafthead.capture import HiddenStateCapture
from drafthead.masks import to_additive
from drafthead.utils import cache_argument

from ..cpu.gguf_weights import has_gguf_weights
from ..cpu.small_gemm import BATCH_KERNEL_ROWS, live_entries, release_kernels, small_row_kernel, use_small_row_kernel
from ..drafter import Accepted
from .attention import PREFILL_NAME, attention_implementation, decoding_attention, kv_length_kwargs
from .compile import compile_step, release_steps, scoped_settings
from .kv import buffer_capacity, keep_leading_rows, set_write_slot, static_cache, static_cache_supported

DEFAULT_BUCKETS = (1, 4, 8, 12, 16, 32, 64)
SMALL_GEMM_ROWS = 4  # verify steps of up to this many rows x tokens without the kernel: inductor's C++ GEMMs
PREFILL_CHUNK = 512


def release_target(model: nn.Module, capture: HiddenStateCapture | None) -> None:
    """Give `model` back as it was handed to a runner: no feature hooks, its own linears (the last user's release)."""
    if capture is not None:
        capture.detach()
    release_kernels(model)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds n tokens."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"a tree of {n} tokens exceeds the largest verify bucket {buckets[-1]}")


class StaticRunner:
    """The target runner over preallocated KV buffers; `feature_layers`: decoder-layer outputs the head reads."""

    def __init__(self, model: nn.Module, feature_layers: list[int], compile: bool = False,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS):
        reason = static_cache_supported(model)
        if reason is not None:
            raise NotImplementedError(f"static KV buffers do not support {reason}")
        self.model = model
        self.cache_argument = cache_argument(model)
        self.feature_layers = list(feature_layers)
        self.capture = HiddenStateCapture(model, self.feature_layers).attach() if self.feature_layers else None
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.attention = decoding_attention(self.device, self.dtype, compile)
        self.small_rows = use_small_row_kernel(model, float32=True) > 0
        self.quantized = has_gguf_weights(model)  # a GGUF target's own blocks (cpu/gguf_weights.py)
        self.release = weakref.finalize(self, release_target, model, self.capture)
        self.buckets = tuple(sorted(buckets))
        self.compiled = compile
        self.shapes: set[tuple[int, int, int]] = set()  # (rows, capacity, bucket) of every step used
        self._steps: dict[int | str, Callable] = {}  # bucket (or "shared") -> a verify step of the current buffers
        self.cache: StaticCache | None = None
        self.rows = 0  # rows of the buffers (the batch the runner was reset for)
        self.capacity = self.scratch = 0  # scratch: the last slot, which no row reads (padded copies land there)
        self.min_capacity = 0  # tree="auto": the slots the tuning compiled its steps for (tuning/auto.py)
        self.step_store: Path | None = None  # tree="auto": the folder keeping compiled steps for later processes
        self.slot_ids = torch.zeros(0, dtype=torch.long, device=self.device)  # arange(capacity)
        self.start = self.length = torch.zeros(0, dtype=torch.long, device=self.device)
        self.lengths: list[int] = []  # self.length on the host
        self.tree_at = 0  # W: the slot of the last verified tree's root

    def reset(self, batch: int, length: int) -> None:
        """Buffers for `batch` rows of up to `length` slots (padded prompt + new tokens), reused where they fit."""
        capacity = max(buffer_capacity(length + self.buckets[-1] + 1), self.min_capacity)  # + the scratch slot
        if self.cache is None or self.rows != batch or self.capacity < capacity:  # new buffers, new steps
            release_steps(self._steps.values())
            self.cache, self._steps = None, {}  # the old buffers can go before the new ones are allocated
            self.cache = static_cache(self.model, batch, capacity)
            self.rows, self.capacity, self.scratch = batch, capacity, capacity - 1
            self.slot_ids = torch.arange(capacity, device=self.device)
        self.start = self.length = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.lengths = [0] * batch

    @property
    def batch(self) -> int:
        """Rows in use: the leading `batch` rows of the buffers."""
        return len(self.lengths)

    @property
    def positions(self) -> torch.Tensor:
        """(B,) the next position of each row (its committed token count)."""
        return self.length - self.start

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) views of the rows in use of every layer, each (B, kv_heads, capacity, head_dim)."""
        b = self.batch
        return [(layer.keys[:b], layer.values[:b]) for layer in self.cache.layers]

    @torch.inference_mode()
    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the rows in use), in that order, as the leading rows; only moved rows copy."""
        index = rows.tolist()
        used = [slice(int(start), self.lengths[k]) for start, k in zip(self.start[rows].tolist(), index)]
        keep_leading_rows(self.cache.drafthead_kv, index, used)
        self.start, self.length = self.start[rows], self.length[rows]
        self.lengths = [self.lengths[k] for k in index]

    def truncate(self, lengths: torch.Tensor) -> None:
        """Row i forgets its tokens from slot lengths[i] on (a draft model rolling back); lengths (B,) on the device."""
        self.length = lengths
        self.lengths = lengths.tolist()

    def export_rows(self) -> list[dict]:
        """Each row's committed entries [start_i, length_i) of every layer (for admit() into other batches)."""
        return [{"kv": [(k[i: i + 1, :, start: end].clone(), v[i: i + 1, :, start: end].clone())
                        for k, v in self.layers()]}
                for i, (start, end) in enumerate(zip(self.start.tolist(), self.lengths))]

    @torch.inference_mode()
    def admit(self, row: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Row `row` now holds another request: its prompt's entries `kv` (export_rows()'s per-layer (keys,
        values), each (1, kv_heads, T, head_dim)) from slot 0."""
        t = kv[0][0].shape[2]
        if t + self.buckets[-1] >= self.scratch:
            raise RuntimeError(f"a {t}-token request does not fit the KV buffers ({self.capacity} slots)")
        for (keys, values), (k, v) in zip(self.layers(), kv):
            keys[row, :, :t] = k[0]
            values[row, :, :t] = v[0]
        index = torch.tensor([row], device=self.device)
        self.start, self.length = self.start.index_fill(0, index, 0), self.length.index_fill(0, index, t)
        self.lengths[row] = t

    @contextlib.contextmanager
    def session(self):
        """The decoding session: the compiler settings of the compiled steps (the drafter's too), attention
        dispatched to the runner's kernel, and the linears of up to BATCH_KERNEL_ROWS rows to the small-row kernel."""
        rows = small_row_kernel(BATCH_KERNEL_ROWS) if self.small_rows else contextlib.nullcontext()
        with scoped_settings(self.device.type != "cuda"), attention_implementation(self.model, self.attention), rows:
            yield

    def close(self) -> None:
        """Free the compiled steps and buffers, and give the model back as it was (hooks, linears)."""
        release_steps(self._steps.values())
        self._steps, self.cache = {}, None
        self.release()

    def _step_forward(self, input_ids, position_ids, mask, kv_length, rows, keep: int = 0):
        """One forward over all B rows of the buffers, n tokens each (`mask` additive (B, 1, n, capacity)): a verify
        step, or a prefill chunk; attention reads the first `kv_length` slots of the leading `rows` rows (0-dim
        tensors for a verify step; rows None for one row); `keep`: logits of the last `keep` positions only (0: all).
        Returns (logits (B, n, V), features (B, n, F) or None, argmax (B, n))."""
        if self.capture is not None:
            self.capture.recording = True
        logits = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                            **{self.cache_argument: self.cache}, use_cache=True, logits_to_keep=keep,
                            **kv_length_kwargs(self.model, kv_length, rows)).logits
        features = None
        if self.capture is not None:
            features = self.capture.stacked(self.feature_layers)
            self.capture.recording = False
            # left empty, so a compiled step finds the same dict at every call (no second graph)
            self.capture.outputs.clear()
        # the greedy choice inside the graph: a fused argmax beats an eager one over the vocabulary
        return logits, features, logits.argmax(dim=-1)

    def _step(self, size: int) -> Callable:
        """The verify step of a `size`-token bucket: eager, or its compiled step for the current buffers (built on
        first use). On a CPU, one row's buckets whose linears run small_gemm.py's kernel share one step, the tree's
        size symbolic in it (1 too: scoped_settings): one compile instead of one per bucket, as fast
        (docs/results/shared_verify_graph.json, shared_verify_graph_one_token_zen3.json; a batch verifies one size)."""
        self.shapes.add((self.rows, self.capacity, size))
        if not self.compiled:
            return self._step_forward
        if size not in self._steps:
            # the linears run small_gemm.py's kernel (a CPU's only; also at one row, where inductor's C++ GEMMs are
            # about as fast but their graphs cannot be cached: docs/results/small_gemm_avx2_chunk_zen3.json)
            kernel = self.small_rows and self.rows * size <= BATCH_KERNEL_ROWS
            small = self.rows * size <= SMALL_GEMM_ROWS and not kernel
            shared = self.rows == 1 and kernel
            key = "shared" if shared else size
            if key not in self._steps:  # shared: tokens, positions and mask have the tree's size in dims 1, 1, 2
                # the buffers' guards are skipped (`unguarded`): new buffers come with new steps (reset)
                name = f"verify{self.rows}x{key}"
                store = self.step_store and self.step_store / f"{name}-{self.capacity}{'-q' * self.quantized}.pt2"
                self._steps[key] = compile_step(self._step_forward, self.device, small_gemm=small, frozen=not kernel,
                                                dynamic={0: 1, 1: 1, 2: 2} if shared else None, name=name,
                                                unguarded=("self.cache",), store=store)
            self._steps[size] = self._steps[key]
        return self._steps[size]

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Left-padded prompts (B, T) and their mask (1 = token, 0 = padding on the left). Returns (last logits
        (B, V), features (B, T, F) or None; padded positions hold junk)."""
        b, t = input_ids.shape
        if b != self.batch:
            raise ValueError(f"{b} prompts for a runner reset for {self.batch} rows")
        if t + self.buckets[-1] >= self.scratch:
            raise RuntimeError(f"a {t}-token prompt does not fit the KV buffers ({self.capacity} slots)")
        mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).to(self.device).long()
        start = t - mask.sum(dim=1)
        slot = self.slot_ids[:t]
        if not torch.equal(mask.bool(), slot[None, :] >= start[:, None]):
            raise ValueError("batched prompts must be left-padded: each attention_mask row is 0s then 1s "
                             "(tokenizer.padding_side = 'left')")
        if (start >= t).any():
            raise ValueError("every prompt needs at least one token")
        positions = (slot[None, :] - start[:, None]).clamp_min(0)  # padding sits at position 0
        features = []
        with attention_implementation(self.model, PREFILL_NAME):
            for c0 in range(0, t, PREFILL_CHUNK):
                c1 = min(c0 + PREFILL_CHUNK, t)
                query = slot[c0:c1]
                allowed = (self.slot_ids <= query[:, None]) & (self.slot_ids >= start[:, None, None])  # (B, n, S)
                allowed |= self.slot_ids == query[:, None]  # padding attends itself (never all-masked)
                set_write_slot(self.cache, c0)
                logits, feats, _ = self._step_forward(input_ids[:, c0:c1].to(self.device), positions[:, c0:c1],
                                                      to_additive(allowed.unsqueeze(1), self.dtype), c1, None, keep=1)
                features.append(feats)
        self.start, self.length = start, torch.full_like(start, t)
        self.lengths = [t] * b
        return logits[:, -1], (torch.cat(features, dim=1) if features[0] is not None else None)

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor,
               largest: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One forward over every row's tree: tokens (B, n) root first; depths (B, n); ancestors (B, n, n) bool;
        padded to the next bucket, or for a batch to `largest` (the drafter's largest tree) where that is smaller.
        Returns (logits (B, n, V), features (B, n, F) or None, argmax (B, n))."""
        b, n = tokens.shape
        size = bucket_for(n, self.buckets)
        if self.rows > 1 and n <= largest < size:
            size = largest
        w = max(self.lengths)
        if w + size > self.scratch:
            raise RuntimeError(f"rows of up to {w} slots + a {size}-token tree exceed the KV buffers "
                               f"({self.capacity}); reset() with the full length first")
        prefix = (self.slot_ids >= self.start[:, None]) & (self.slot_ids < self.length[:, None])  # (B, capacity)
        allowed = prefix.unsqueeze(1).expand(b, size, self.capacity).clone()
        allowed[:, :n, w: w + n] = ancestors
        if size > n:  # padded nodes: token 0 at the root's position, attending only to themselves
            tokens, depths = (torch.nn.functional.pad(x, (0, size - n)) for x in (tokens, depths))
            pad = torch.arange(n, size, device=self.device)
            allowed[:, pad, w + pad] = True
        positions = self.positions[:, None] + depths
        if b < self.rows:  # rows that stopped: repeat the last row in use (their writes land in unused rows)
            pad = torch.arange(self.rows, device=self.device).clamp_max(b - 1)
            tokens, positions, allowed = tokens[pad], positions[pad], allowed[pad]
        else:  # a fresh tensor of standard strides (a compiled graph guards on strides)
            tokens = tokens.contiguous()
        set_write_slot(self.cache, w)
        mask = to_additive(allowed.unsqueeze(1), self.dtype)
        with live_entries(b) as rows:  # rows that stopped cost neither attention nor GEMM work
            logits, features, greedy = self._step(size)(tokens, positions, mask, torch.tensor(w + size),
                                                        rows if self.rows > 1 else None)
        self.tree_at = w
        return logits[:b, :n], (features[:b, :n] if features is not None else None), greedy[:b, :n]

    @torch.inference_mode()
    def commit(self, accepted: Accepted) -> None:
        """Row i appends the nodes accepted.paths[i] (indices into its last verified tree, root first)."""
        paths, counts = accepted.paths, accepted.counts
        # nothing to move where every row's tree starts at its length and it kept a prefix of it (plain steps, chains)
        if not all(self.tree_at == n and p == list(range(len(p))) for n, p in zip(self.lengths, accepted.host_paths)):
            j = torch.arange(paths.shape[1], device=self.device)
            valid = j[None, :] < counts[:, None]
            src = torch.where(valid, self.tree_at + paths, self.scratch)
            dst = torch.where(valid, self.length[:, None] + j, self.scratch)
            kv = self.cache.drafthead_kv  # (2, layers, rows, kv_heads, slots, head_dim): all layers (static_cache)
            rows = torch.arange(self.batch, device=self.device)[:, None]
            kv[:, :, rows, :, dst] = kv[:, :, rows, :, src]
        self.length = self.length + counts
        self.lengths = [n + len(p) for n, p in zip(self.lengths, accepted.host_paths)]
