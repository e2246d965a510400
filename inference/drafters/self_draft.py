"""Self-speculation with a StreamingLLM draft (MagicDec; Chen et al. 2024).

The target drafts chains of `gamma` for itself, each draft forward attending only the first `sink` and the last
`window` positions (its own buffers, copied from the target's after every verification); the full target verifies.
Once the context is long a target step reads far more KV than weights, a draft step only sink + window entries.

`weights="int8"`: the draft multiplies with an int8 copy of the target's linear weights (small_gemm.int8_weights).
`vocab`: the target ids the draft may propose (draft_vocab.frequent_tokens), its logits computed over those only.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from transformers import StaticCache

from drafthead.masks import to_additive
from drafthead.utils import cache_argument

from ..cpu.small_gemm import int8_drafting, int8_weights, live_entries, release_kernels
from ..drafter import Drafter
from ..runners.attention import kv_length_kwargs
from ..runners.compile import compile_step
from ..runners.kv import SlotMap, keep_leading_rows, set_write_slot, static_cache
from ..sampling import SamplingParams, target_probs
from ..tree import DraftTree


class StreamingSelfDrafter(Drafter):
    """A drafter: the target with a StreamingLLM KV drafts chains of `gamma`."""

    name = "self"
    origin_names = ("self",)

    def __init__(self, model: nn.Module, sink: int = 4, window: int = 512, gamma: int = 3, compile: bool = False,
                 vocab: torch.Tensor | None = None, weights: str = "same"):
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.int8 = int8_drafting(model, weights)
        self.model = model
        self.close = weakref.finalize(self, release_kernels, model, "int8") if self.int8 else (lambda: None)
        self.cache_argument = cache_argument(model)
        lm_head = model.get_output_embeddings()
        self.vocab_size = lm_head.weight.shape[0]  # the target's
        self.vocab = self.vocab_weight = None
        if vocab is not None:  # the lm_head rows of the tokens the draft may propose, one contiguous copy
            if vocab.ndim != 1 or len(vocab) == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= self.vocab_size:
                raise ValueError(f"vocab must be a 1-D tensor of target ids in 0..{self.vocab_size - 1}")
            if getattr(lm_head, "bias", None) is not None:
                raise ValueError("a draft vocabulary needs an lm_head without bias")
            self.vocab = vocab.to(lm_head.weight.device, torch.long)
            self.vocab_weight = lm_head.weight.detach()[self.vocab].contiguous()  # (K, H)
        # the buffers' guards are skipped: each batch size keeps its own buffers (begin) and graph (tokens' shape)
        device = next(model.parameters()).device
        self._step = (compile_step(self._draft_step, device, name="self_draft", unguarded=("self.cache",),
                                   cpp_wrapper=device.type == "cpu") if compile else self._draft_step)
        self.batches: set[int] = set()  # the draft batch sizes whose step has run (compiled: one graph each)
        self.layout = SlotMap(sink, window)
        self.gamma, self.tree_size = gamma, gamma + 1
        self.scratch = self.layout.size(0)  # first draft slot, after the sinks and the ring
        self.capacity = self.scratch + gamma + 1
        self.dummy = self.capacity - 1  # the slot padded copies write to
        self.kv_length = torch.tensor(self.capacity)  # the attention kernel reads every draft slot
        self.cache: StaticCache | None = None
        self._caches: dict[int, StaticCache] = {}  # batch size -> its draft buffers
        self.slot_pos: torch.Tensor | None = None  # (B, capacity) position held by each slot, -1 if none
        self.runner = None
        self.drafted_from: torch.Tensor | None = None  # (B,) the root position of the last chain

    @property
    def alive(self) -> int:
        """Rows still decoding: the first `alive` rows of the draft buffers; the rest repeat the last of them."""
        return self.runner.batch

    @property
    def kv_shape(self) -> tuple[int, ...]:
        return tuple(self.cache.layers[0].keys.shape)  # (B, kv_heads, sink + window + gamma + 1, head_dim)

    def begin(self, runner, input_ids, attention_mask, features) -> None:
        """Fresh draft buffers for the runner's rows, filled with the prompt's sinks and last `window` entries."""
        self.runner = runner
        b = runner.batch
        # one set of buffers per batch size, kept: a compiled graph keeps writing the buffers it was traced with
        if b not in self._caches:
            self._caches[b] = static_cache(self.model, b, self.capacity)
        self.cache = self._caches[b]
        self.slot_pos = torch.full((b, self.capacity), -1, dtype=torch.long, device=runner.device)
        self._refresh(list(range(b)), torch.zeros_like(runner.positions))

    def _refresh(self, rows: list[int], start: torch.Tensor) -> None:
        """Copy the kept committed positions of `rows` from start_i (start (R,)) up to the runner's from the target's
        buffers: per row one copy along the slots for all layers at once."""
        index = torch.tensor(rows, device=start.device)
        positions, valid = self.layout.needed(start, self.runner.positions[index])
        if positions.shape[1] == 0:
            return
        src = torch.where(valid, self.runner.start[index][:, None] + positions, self.runner.scratch)
        dst = torch.where(valid, self.layout.slots(positions), self.dummy)
        target, draft = self.runner.cache.drafthead_kv, self.cache.drafthead_kv  # (2, layers, B, kv_heads, S, D)
        for i, row in enumerate(rows):
            draft[:, :, row].index_copy_(3, dst[i], target[:, :, row].index_select(3, src[i]))
        self.slot_pos[index] = self.slot_pos[index].scatter(1, dst, torch.where(valid, positions, -1))
        self.slot_pos[:, self.dummy] = -1

    def _draft_step(self, tokens: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                    kv_length: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft token per row (B, 1) at the cache's write slot, attention for the leading `rows` rows only (0-dim
        tensor). Returns (logits (B, V), or (B, K) over a draft vocabulary; the greedy target ids (B, 1))."""
        inputs = dict(input_ids=tokens, position_ids=position_ids, attention_mask=mask, use_cache=True,
                      **{self.cache_argument: self.cache}, **kv_length_kwargs(self.model, kv_length, rows))
        if self.vocab is None:
            logits = self.model(**inputs, logits_to_keep=1).logits[:, -1]
            return logits, logits.argmax(dim=-1, keepdim=True)
        hidden = self.model.get_decoder()(**inputs).last_hidden_state[:, -1]  # (B, H), after the final norm
        kept = hidden @ self.vocab_weight.T  # (B, K)
        return kept, self.vocab[kept.argmax(dim=-1)].unsqueeze(1)

    @torch.inference_mode()
    def propose(self, roots: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> DraftTree:
        b = roots.shape[0]
        self.drafted_from = self.runner.positions
        full = self.slot_pos.shape[0]  # the draft batch: b alive rows, then copies of the last one
        pad = torch.arange(full, device=roots.device).clamp_max(b - 1)
        positions = self.drafted_from[pad][:, None]
        # (B, 1, 1, capacity): every held position precedes the root; the chain's slots open one per depth
        mask = to_additive((self.slot_pos >= 0)[:, None, None, :], self.cache.layers[0].keys.dtype)
        tokens, drafted, qs = roots[pad].view(full, 1), [], []
        self.batches.add(full)
        for d in range(self.gamma):
            mask[..., self.scratch + d] = 0
            set_write_slot(self.cache, self.scratch + d)
            with int8_weights(self.int8), live_entries(b) as rows:
                logits, tokens = self._step(tokens, positions + d, mask, self.kv_length, rows)
            if params.do_sample:  # a sample instead of the greedy token
                if self.vocab is not None:  # the draft's own law: zero outside its vocabulary
                    logits = logits.new_full((full, self.vocab_size), float("-inf")).index_copy_(1, self.vocab, logits)
                q = target_probs(logits, params)  # (B, V)
                tokens = torch.multinomial(q, 1, generator=generator)
                qs.append(q[:b])
            drafted.append(tokens[:b])
        return DraftTree.chain(roots, torch.cat(drafted, dim=1), torch.stack(qs, dim=1) if qs else None)

    def skip(self, roots: torch.Tensor) -> None:
        """A plain step: accept() copies what it commits from the positions as they are now."""
        self.drafted_from = self.runner.positions

    def accept(self, accepted, features) -> None:
        """The runner has committed each row's accepted path: copy those entries into the draft buffers."""
        self._refresh(list(range(self.alive)), self.drafted_from)

    @torch.inference_mode()
    def admit(self, row: int, runner, ids, features) -> None:
        """Row `row` holds a new prompt in the runner: its sinks and last `window` entries, nothing else."""
        self.slot_pos[row] = -1
        self._refresh([row], runner.positions.new_zeros(1))

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Only `rows` go on, moved to the front of the same buffers (the batch keeps its size and graph)."""
        pad = rows[torch.arange(self.slot_pos.shape[0], device=rows.device).clamp_max(rows.shape[0] - 1)]
        keep_leading_rows(self.cache.drafthead_kv, rows.tolist())
        self.slot_pos = self.slot_pos[pad]
