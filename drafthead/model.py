"""The draft head: one decoder layer plus a fusion layer over a frozen target's hidden states.

EAGLE-3 (kind="eagle3")
    hidden  = fc(concat of k target hidden states)            # or the head's own previous output
    x       = concat[input_layernorm(embed(token)), hidden_norm(hidden)]   # (B, T, 2H) into q/k/v
    h       = hidden + attn(x);  h = h + mlp(post_attention_layernorm(h))
    logits  = lm_head(norm(h))                                # over the draft vocabulary (d2t maps to target ids)
EAGLE-1/2 (kind="eagle1")
    x       = fc(concat[embed(token), hidden])                # hidden = target's last-layer output (pre-norm)
    h       = x + attn(x);  h = h + mlp(post_attention_layernorm(h))   # h regresses the next feature
    logits  = target_lm_head(target_norm(h))                  # full vocabulary, frozen target weights

Alignment (training and drafting alike): the pair (feature at position t, token t+1) sits at position t and
predicts token t+2. The token embedding (and for EAGLE-1 the target's final norm and lm_head) are the
target's, frozen, and never saved.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.nn as nn
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from .config import HeadConfig
from .format import FROZEN_PREFIXES
from .utils import cache_argument

CACHE_ARGUMENT = cache_argument(LlamaAttention)  # the keyword the installed transformers takes the KV cache by


class HeadKVCache:
    """Append-only key/value cache of the head's single layer, croppable to a prefix.

    Duck-types the `update(keys, values, layer_idx)` call that transformers' attention modules make.
    keys/values: (B, kv_heads, S, head_dim).
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int = 0, *args, **kwargs):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)
        return self.keys, self.values

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def crop(self, length: int) -> None:
        """Keep the first `length` cached positions."""
        if self.keys is not None:
            self.keys = self.keys[..., :length, :]
            self.values = self.values[..., :length, :]


class DecoderLayer(nn.Module):
    """transformers' Llama attention/MLP/norms; for EAGLE-3 q/k/v read the 2H concat [embedding, hidden]."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        lc = config.llama_config()
        h = config.hidden_size
        self.self_attn = LlamaAttention(lc, layer_idx=0)
        self.mlp = LlamaMLP(lc)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        if config.kind == "eagle3":
            attn = self.self_attn
            attn.q_proj = nn.Linear(2 * h, config.num_attention_heads * config.head_dim, bias=False)
            attn.k_proj = nn.Linear(2 * h, config.num_key_value_heads * config.head_dim, bias=False)
            attn.v_proj = nn.Linear(2 * h, config.num_key_value_heads * config.head_dim, bias=False)
            self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)


class DraftHead(nn.Module):
    """An EAGLE-3 or EAGLE-1/2 draft head. See the module docstring for the computation."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        h, th = config.hidden_size, config.target_hidden_size
        self.eagle3 = config.kind == "eagle3"
        # Frozen stand-ins until attach_target() copies the target's own modules in.
        self.embed_tokens = nn.Embedding(config.vocab_size, th)
        if self.eagle3:
            self.fc = nn.Linear(config.feature_size, h, bias=False)
        else:
            self.fc = nn.Linear(2 * h, h, bias=True)
        self.midlayer = DecoderLayer(config)
        self.rotary_emb = LlamaRotaryEmbedding(config.llama_config())
        if self.eagle3:
            self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            # until a draft vocabulary is built: draft id i = target id i (consistent d2t / t2d)
            self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)
        else:
            self.target_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
            self.target_lm_head = nn.Linear(h, config.vocab_size, bias=False)
        self._freeze_borrowed()

    # ----------------------------------------------------------------------------------- target modules
    def _freeze_borrowed(self) -> None:
        for name, p in self.named_parameters():
            if name.startswith(FROZEN_PREFIXES):
                p.requires_grad_(False)

    @torch.no_grad()
    def attach_target(self, target: nn.Module) -> "DraftHead":
        """Copy the target's token embedding (and, for EAGLE-1, its final norm and lm_head) in, frozen."""
        ref = next(self.fc.parameters())
        self.embed_tokens = copy.deepcopy(target.get_input_embeddings()).to(ref.device, ref.dtype)
        if not self.eagle3:
            self.target_norm = copy.deepcopy(target.get_decoder().norm).to(ref.device, ref.dtype)
            self.target_lm_head = copy.deepcopy(target.get_output_embeddings()).to(ref.device, ref.dtype)
        self._freeze_borrowed()
        return self

    # ----------------------------------------------------------------------------------------- compute
    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """Target features (B, T, k·TH) -> head hidden (B, T, H). EAGLE-1 reads the last hidden state as is."""
        return self.fc(target_features) if self.eagle3 else target_features

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T) tokens t+1 paired with the hidden at position t
        hidden: torch.Tensor,  # (B, T, H) fused target features or the head's own previous output
        position_ids: torch.Tensor,  # (B, T)
        attention_mask: torch.Tensor | None = None,  # (B, 1, T, past+T) additive float mask; None = causal, no past
        cache: HeadKVCache | None = None,
        **attention_kwargs,
    ) -> torch.Tensor:
        """One pass of the decoder layer; returns the head's output hidden (B, T, H) before the final norm.
        `attention_kwargs` go to the attention function (e.g. the used length of a preallocated cache)."""
        layer = self.midlayer
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        if self.eagle3:
            residual = hidden
            x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        else:
            x = self.fc(torch.cat([emb, hidden], dim=-1))
            residual = x
        position_embeddings = self.rotary_emb(x, position_ids)
        if attention_mask is None and cache is not None and len(cache) > 0:
            raise ValueError("pass an explicit attention_mask when the cache holds earlier positions")
        attn_out, _ = layer.self_attn(x, position_embeddings, attention_mask, **{CACHE_ARGUMENT: cache},
                                      **attention_kwargs)
        h = residual + attn_out
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def output_layers(self) -> tuple[nn.Module, nn.Linear]:
        """(norm, lm_head) that turn the head's output into logits: its own over the draft vocabulary (EAGLE-3) or
        the target's frozen ones over the full vocabulary (EAGLE-1)."""
        if self.eagle3:
            return self.norm, self.lm_head
        return self.target_norm, self.target_lm_head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head output (B, T, H) -> logits: draft vocabulary (EAGLE-3) or the target's full vocabulary (EAGLE-1)."""
        norm, lm_head = self.output_layers()
        return lm_head(norm(hidden))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (identity for EAGLE-1 and full draft vocabularies)."""
        if not self.eagle3:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def pruned(self, counts: torch.Tensor, keep: int) -> "DraftHead":
        """A copy of this EAGLE-3 head drafting only its `keep` most frequent draft tokens (by `counts`, indexed by
        target id): the matching rows of lm_head and d2t, no retraining. The lm_head over the draft vocabulary is
        most of a draft step's cost on a CPU; tokens left out can no longer be drafted (they are still emitted by
        the target, so output is unchanged)."""
        if not self.eagle3:
            raise ValueError("only EAGLE-3 heads have a draft vocabulary to prune")
        size = self.config.draft_vocab_size
        if not 0 < keep <= size:
            raise ValueError(f"keep must be in 1..{size}, got {keep}")
        target_ids = torch.arange(size, device=self.d2t.device) + self.d2t  # (draft,)
        by_count = torch.sort(-counts.to(target_ids.device)[target_ids].long(), stable=True).indices
        chosen = torch.sort(by_count[:keep]).values  # draft ids, so target ids stay increasing
        head = copy.deepcopy(self)
        head.config = replace(self.config, draft_vocab_size=keep)
        weight = self.lm_head.weight[chosen]
        head.lm_head = nn.Linear(weight.shape[1], keep, bias=False, device=weight.device, dtype=weight.dtype)
        head.lm_head.weight.copy_(weight)
        head.d2t = target_ids[chosen] - torch.arange(keep, device=chosen.device)
        head.t2d = torch.zeros_like(self.t2d)
        head.t2d[target_ids[chosen]] = True
        return head

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    # ------------------------------------------------------------------------------------- checkpoints
    # (drafthead.checkpoint: save_head / load_head write and read these tensors)
    def saved_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything that belongs to the head (no borrowed target weights), in the native tensor names."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(FROZEN_PREFIXES)}
