"""Configuration of a draft head, derived from the target's Hugging Face config."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .format import (
    ARCHITECTURES, NATIVE_KEY, aux_ids_from_vllm, is_head_config, rope_of, rope_parameters, text_config,
)

HEAD_KINDS = ("eagle3", "eagle1")


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The serving engines' default aux layers: outputs of layers 1, N/2-1 and N-4 (0-indexed layer outputs)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


@dataclass
class HeadConfig:
    """Shape and provenance of a draft head.

    kind: "eagle3" (fc over k aux hidden states, draft vocabulary, own lm_head) or
          "eagle1" (fc over [embedding, last hidden], logits through the target's lm_head).
    aux_layer_ids: target layer outputs the head reads (layer k = output of decoder layer k, 0-indexed).
    """

    kind: str = "eagle3"
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    vocab_size: int = 49152
    draft_vocab_size: int = 49152
    target_hidden_size: int = 576
    target_num_layers: int = 30
    target_model_type: str = "llama"
    target_name: str = ""
    aux_layer_ids: list[int] = field(default_factory=lambda: default_aux_layer_ids(30))

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"head kind must be one of {HEAD_KINDS}, got {self.kind!r}")
        if self.kind == "eagle1":
            self.aux_layer_ids = [self.target_num_layers - 1]
            self.draft_vocab_size = self.vocab_size
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"head hidden_size ({self.hidden_size}) must equal the target's ({self.target_hidden_size}): "
                "the head borrows the target's token embedding"
            )
        bad = [i for i in self.aux_layer_ids if not 0 <= i < self.target_num_layers]
        if bad:
            raise ValueError(f"aux_layer_ids {bad} outside the target's {self.target_num_layers} layers")

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def feature_size(self) -> int:
        """Width of the target features the head consumes per token (k·target_hidden for EAGLE-3)."""
        return self.num_aux * self.target_hidden_size

    @classmethod
    def from_target_config(
        cls,
        target_config: Any,
        kind: str = "eagle3",
        draft_vocab_size: int | None = None,
        aux_layer_ids: list[int] | None = None,
        target_name: str = "",
        **overrides: Any,
    ) -> "HeadConfig":
        """A head shaped like one decoder layer of the target (any Llama/Qwen2/Mistral/Gemma-family config)."""
        cfg = text_config(target_config)
        num_layers = cfg.num_hidden_layers
        theta, scaling = rope_of(cfg)
        heads = cfg.num_attention_heads
        values = dict(
            kind=kind,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
            hidden_act=getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", "silu"),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.max_position_embeddings,
            vocab_size=cfg.vocab_size,
            draft_vocab_size=draft_vocab_size or cfg.vocab_size,
            target_hidden_size=cfg.hidden_size,
            target_num_layers=num_layers,
            target_model_type=cfg.model_type,
            target_name=target_name or getattr(target_config, "name_or_path", "") or "",
            aux_layer_ids=list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(num_layers),
        )
        values.update(overrides)
        return cls(**values)

    def llama_config(self):
        """A transformers LlamaConfig for the decoder-layer building blocks (attention, MLP, norms, rope)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act=self.hidden_act if self.hidden_act in ("silu", "gelu", "relu") else "gelu_pytorch_tanh",
            rope_parameters=rope_parameters(self.rope_theta, self.rope_scaling),
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            num_hidden_layers=1,
            attention_bias=False,
            attn_implementation="sdpa",
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "HeadConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({NATIVE_KEY: self.to_dict()}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "HeadConfig":
        values = json.loads(Path(path).read_text())
        if NATIVE_KEY not in values:
            raise ValueError(f"{path} is not a native draft-head config (no {NATIVE_KEY!r} key)")
        return cls.from_dict(values[NATIVE_KEY])

    @classmethod
    def from_folder_config(cls, values: dict[str, Any], target_config: Any | None = None) -> "HeadConfig":
        """The HeadConfig of a head folder's config.json: our own NATIVE_KEY, else the EAGLE serving fields.

        A third-party serving folder does not record the target's layer count; it is taken from `target_config`.
        """
        if NATIVE_KEY in values:
            return cls.from_dict(values[NATIVE_KEY])
        arch = (values.get("architectures") or [""])[0]
        if not is_head_config(values):
            raise ValueError(
                f"config.json is neither a native head nor an EAGLE serving folder (architectures={arch!r})"
            )
        if target_config is None:
            raise ValueError(f"this serving folder has no {NATIVE_KEY!r}: pass the target to load_head(target=...)")
        tcfg = text_config(target_config)
        hidden = values["hidden_size"]
        ids = (values.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is None and values.get("eagle_aux_hidden_state_layer_ids") is not None:
            ids = aux_ids_from_vllm(values["eagle_aux_hidden_state_layer_ids"])
        return cls(
            kind="eagle3" if arch == ARCHITECTURES["eagle3"] else "eagle1",
            hidden_size=hidden,
            intermediate_size=values["intermediate_size"],
            num_attention_heads=values["num_attention_heads"],
            num_key_value_heads=values.get("num_key_value_heads") or values["num_attention_heads"],
            head_dim=values.get("head_dim") or hidden // values["num_attention_heads"],
            rms_norm_eps=values.get("rms_norm_eps", 1e-6),
            hidden_act=values.get("hidden_act", "silu"),
            rope_theta=float(values.get("rope_theta", 10000.0)),
            rope_scaling=values.get("rope_scaling"),
            max_position_embeddings=values.get("max_position_embeddings", tcfg.max_position_embeddings),
            vocab_size=values.get("vocab_size", tcfg.vocab_size),
            draft_vocab_size=values.get("draft_vocab_size") or values.get("vocab_size", tcfg.vocab_size),
            target_hidden_size=values.get("target_hidden_size") or hidden,
            target_num_layers=tcfg.num_hidden_layers,
            target_model_type=tcfg.model_type,
            aux_layer_ids=ids if ids is not None else default_aux_layer_ids(tcfg.num_hidden_layers),
        )
