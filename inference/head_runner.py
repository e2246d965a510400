"""The draft head's side of drafting: its KV buffer and its passes, optionally compiled.

The head's single layer keeps its keys/values in a preallocated buffer of `capacity` slots. Every forward writes
its n tokens at explicit slots (index_copy_, no concatenation) and attends the WHOLE buffer through an additive
mask, so a pass has one shape — (n tokens, capacity keys) — whatever the sequence length. Two ways to compile a
drafting step (tree.py's DraftStep): WHOLE, one graph per tree shape for feeding the true pairs, every depth and
the tree selection (what decoding uses: no eager glue between the passes, one guard check a step), or PIECEWISE,
one graph per pass shape (feed: pad size; expansion: top-k) shared by every tree shape (what the tree tuner uses
to price dozens of shapes without compiling each). A prompt's pairs before the last few run eagerly (append).
"""

from __future__ import annotations

import weakref

import torch

from drafthead.masks import buffer_mask, causal_allowed
from drafthead.model import DraftHead

from .attention import KERNEL_NAME, decoding_attention
from .small_gemm import use_small_row_kernel
from .static_runner import MIN_CAPACITY, buffer_capacity, compile_step, release_step


def head_top_k(head: DraftHead, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (..., H) -> (log-probs (..., k) float32, target ids (..., k)) of each row's top-k draft tokens."""
    logp = torch.log_softmax(head.logits(hidden).float(), dim=-1)
    top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    return top.values, head.draft_to_target(top.indices)


class SlotCache:
    """Duck-types the `update(keys, values, layer_idx)` call of transformers' attention: writes the new entries at
    `slots` (a tensor of buffer positions, set before each forward) and returns the whole buffers."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # (1, kv_heads, capacity, head_dim)
        self.values: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None  # (n,)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int = 0, *args, **kwargs):
        self.keys.index_copy_(2, self.slots, keys)
        self.values.index_copy_(2, self.slots, values)
        return self.keys, self.values


class HeadRunner:
    """A head's KV buffer plus its passes and drafting steps (compiled when asked); see the module docstring."""

    def __init__(self, head: DraftHead, compile: bool = False, capacity: int = MIN_CAPACITY):
        self.head = head
        self.dtype = next(head.parameters()).dtype
        self.device = next(head.parameters()).device
        self.cache = SlotCache()
        self.attention = attention = decoding_attention(self.device, self.dtype, compile)
        if attention is not None:
            # a drafting depth is a few queries over the whole buffer: the matmul kernel, not SDPA (CPU, bf16,
            # SmolLM2's head on a 2-core EPYC: SDPA ~0.33 ms a call; a 2/6/11 tree's drafting 3.2 -> 2.4 ms a
            # step), or the AVX512-BF16 kernel. Same attention, so the head's outputs are unchanged up to rounding.
            head.midlayer.self_attn.config._attn_implementation = attention
        self.capacity = 0
        self.compiled = compile
        # bf16 on a CPU with AVX512-BF16: the head's linears (fusion, layer, draft lm_head) use the small-row GEMM
        # kernel inside the target runner's session (small_gemm.py)
        self.small_rows = use_small_row_kernel(head) > 0
        # compiled steps skip the guards on the KV buffer (compile_step's `unguarded`); reserve() releases them
        # when it replaces the buffer
        self._expand, self._feed = (compile_step(fn, self.device, unguarded=("self.cache",)) if compile else fn
                                    for fn in (self._expand_eager, self._feed_eager))
        self.steps: dict = {}  # (tree shape, whole) -> its drafting step (tree.DraftStep)
        self.reserve(capacity)

    def reserve(self, length: int) -> None:
        """Room for `length` positions (the stable prefix plus the deepest tree's nodes); growing keeps the
        contents but costs a recompile of the compiled steps, so size it up front."""
        if length <= self.capacity:
            return
        cfg = self.head.config
        old = self.capacity
        self.capacity = buffer_capacity(length)
        shape = (1, cfg.num_key_value_heads, self.capacity, cfg.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if old:
            keys[:, :, :old] = self.cache.keys
            values[:, :, :old] = self.cache.values
            for step in (self._expand, self._feed, *(s.run for s in self.steps.values())):
                release_step(step)
        if self.compiled and self.device.type == "cuda":  # reserve() always runs eagerly
            # a fixed address the compiled steps write into in place: without it CUDA graphs are skipped (the
            # buffers would count as mutated graph inputs) and every drafting depth pays its kernel launches
            torch._dynamo.mark_static_address(keys)
            torch._dynamo.mark_static_address(values)
        self.cache.keys, self.cache.values = keys, values

    def mask(self, allowed: torch.Tensor, start: int | torch.Tensor) -> torch.Tensor:
        """(1, 1, n, capacity) additive mask: every slot before `start`, then `allowed` (n, m) from `start` on."""
        return buffer_mask(allowed, start, self.capacity, self.dtype)

    def forward(self, tokens, hidden, positions, mask, slots) -> torch.Tensor:
        """Eager head pass writing its keys/values at `slots`; returns the output hidden (1, n, H). The AVX512-BF16
        attention reads only the slots up to the last one written (the mask hides the rest)."""
        self.cache.slots = slots
        extra = {"drafthead_kv_length": slots.max() + 1} if self.attention == KERNEL_NAME else {}
        return self.head(tokens, hidden, positions, mask, self.cache, **extra)

    def top_k(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return head_top_k(self.head, hidden, k)

    def _expand_eager(self, tokens, hidden, positions, mask, slots, k: int):
        out = self.forward(tokens, hidden, positions, mask, slots)  # (1, k, H)
        logp, ids = self.top_k(out[0], k)
        return out, logp, ids

    def _feed_eager(self, tokens, features, positions, mask, slots, last, k: int):
        out = self.forward(tokens, self.head.fuse(features), positions, mask, slots)  # (1, m, H)
        last_hidden = out[:, last]  # (1, 1, H)
        logp, ids = self.top_k(last_hidden[0], k)
        return last_hidden, logp, ids

    def passes(self, whole: bool):
        """(feed, expand) for a drafting step: the eager passes inside a step compiled whole, else this runner's
        own (compiled when it compiles). feed(tokens (1, m), features (1, m, F), positions, mask, slots, last, k)
        -> (head output at `last` (1, 1, H), its top-k log-probs (1, k), target ids (1, k)): depth 1 of the next
        tree. expand(frontier tokens (1, k), parent hidden (1, k, H), positions, mask, slots, k) -> (hidden
        (1, k, H), child log-probs (k, k), child target ids (k, k)): one further depth."""
        if whole:
            return self._feed_eager, self._expand_eager
        return self._feed, self._expand

    @torch.inference_mode()
    def append(self, tokens: torch.Tensor, features: torch.Tensor, start: int) -> None:
        """Write true pairs (tokens (1, m), target features (1, m, F)) at positions start..start+m-1, eagerly and
        without drafting: a prompt's pairs before the last few, which the drafting step feeds."""
        m = tokens.shape[1]
        positions = torch.arange(start, start + m, device=self.device).unsqueeze(0)
        self.forward(tokens, self.head.fuse(features.to(self.dtype)), positions,
                     self.mask(causal_allowed(m, 0, self.device), start), positions[0])

    def draft_step(self, key, build):
        """The drafting step for `key` (a tree shape and how it compiles), built once by `build()` and shared by
        every drafter of this runner (a step compiled whole is one graph per tree shape)."""
        if key not in self.steps:
            self.steps[key] = build()
        return self.steps[key]


_SHARED: "weakref.WeakKeyDictionary[DraftHead, dict[bool, HeadRunner]]" = weakref.WeakKeyDictionary()


def head_runner_for(head: DraftHead, compile: bool = False) -> HeadRunner:
    """The HeadRunner of `head` (one per head and compile setting, shared by every drafter and generator)."""
    runners = _SHARED.setdefault(head, {})
    if compile not in runners:
        runners[compile] = HeadRunner(head, compile=compile)
    return runners[compile]
