"""Validate an exported serving folder: vLLM and SGLang load a wrong checkpoint SILENTLY, so we must not.

Checks, each with its own message: config keys present and coherent; every tensor name known and present
(EAGLE-3 must use midlayer.*, not layers.0.*); shapes match what config.json implies; draft_vocab_size equals
lm_head's rows; d2t maps into the target vocabulary and agrees with t2d; and, given the source head, a reload
through our own loader reproduces its logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from .checkpoint import load_head
from .format import ARCHITECTURES, CONFIG_NAME, NATIVE_KEY, NATIVE_LAYER, SERVING_LAYER, WEIGHTS_NAME, vllm_aux_ids
from .errors import UserError
from .model import DraftHead


class ExportValidationError(UserError, ValueError):
    """An exported folder that a serving engine would load wrongly; the message says what is wrong."""


COMMON_KEYS = (
    "architectures", "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "rope_theta", "max_position_embeddings",
    "vocab_size", "tie_word_embeddings",
)
EAGLE3_KEYS = ("draft_vocab_size", "target_hidden_size", "eagle_config", "eagle_aux_hidden_state_layer_ids")


def expected_shapes(cfg: dict[str, Any], kind: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape that the serving config implies."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    attn_in = 2 * h if kind == "eagle3" else h
    layer = NATIVE_LAYER if kind == "eagle3" else SERVING_LAYER
    shapes = {
        f"{layer}self_attn.q_proj.weight": (q, attn_in),
        f"{layer}self_attn.k_proj.weight": (kv, attn_in),
        f"{layer}self_attn.v_proj.weight": (kv, attn_in),
        f"{layer}self_attn.o_proj.weight": (h, q),
        f"{layer}mlp.gate_proj.weight": (inter, h),
        f"{layer}mlp.up_proj.weight": (inter, h),
        f"{layer}mlp.down_proj.weight": (h, inter),
        f"{layer}post_attention_layernorm.weight": (h,),
    }
    if kind == "eagle3":
        num_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        shapes.update({
            "fc.weight": (h, num_aux * cfg["target_hidden_size"]),
            f"{layer}input_layernorm.weight": (h,),
            f"{layer}hidden_norm.weight": (h,),
            "norm.weight": (h,),
            "lm_head.weight": (cfg["draft_vocab_size"], h),
            "d2t": (cfg["draft_vocab_size"],),
            "t2d": (cfg["vocab_size"],),
        })
    else:
        shapes.update({"fc.weight": (h, 2 * h), "fc.bias": (h,)})
    return shapes


def _check_config(cfg: dict[str, Any]) -> str:
    """Required keys and their coherence; returns the head kind."""
    for key in COMMON_KEYS:
        if key not in cfg:
            raise ExportValidationError(f"config.json is missing key {key!r}")
    arch = cfg["architectures"][0] if cfg["architectures"] else None
    kinds = {v: k for k, v in ARCHITECTURES.items()}
    if arch not in kinds:
        raise ExportValidationError(f"config.json architectures {cfg['architectures']} is not one of {list(kinds)}")
    kind = kinds[arch]
    if cfg["model_type"] != "llama" or cfg["num_hidden_layers"] != 1:
        raise ExportValidationError(
            f"config.json must say model_type 'llama' and num_hidden_layers 1, "
            f"got {cfg['model_type']!r} and {cfg['num_hidden_layers']}"
        )
    if cfg["tie_word_embeddings"]:
        raise ExportValidationError("config.json tie_word_embeddings must be false (the head has its own lm_head)")
    if kind == "eagle3":
        for key in EAGLE3_KEYS:
            if key not in cfg:
                raise ExportValidationError(f"config.json is missing key {key!r}")
        eagle = cfg["eagle_config"]
        if "eagle_aux_hidden_state_layer_ids" not in eagle:
            raise ExportValidationError("config.json is missing key 'eagle_config.eagle_aux_hidden_state_layer_ids'")
        if not eagle.get("use_aux_hidden_state", False):
            raise ExportValidationError("config.json eagle_config.use_aux_hidden_state must be true")
        sglang, vllm = eagle["eagle_aux_hidden_state_layer_ids"], cfg["eagle_aux_hidden_state_layer_ids"]
        if vllm_aux_ids(sglang) != list(vllm):
            raise ExportValidationError(
                f"aux layer ids disagree: eagle_config (SGLang, output of layer k) has {sglang}, so the top-level "
                f"vLLM key (input of layer k) must be {vllm_aux_ids(sglang)}, got {vllm}"
            )
    return kind


def _check_native_agreement(cfg: dict[str, Any], kind: str) -> None:
    """Our own "drafthead_config" key (used by load_head) must say what the serving fields say."""
    native = cfg.get(NATIVE_KEY)
    if native is not None:
        keys = ["hidden_size", "intermediate_size", "vocab_size"] + (["draft_vocab_size"] if kind == "eagle3" else [])
        for key in keys:
            if native.get(key) != cfg[key]:
                raise ExportValidationError(
                    f"drafthead_config.{key}={native.get(key)} disagrees with config.json {key}={cfg[key]}"
                )
        if kind == "eagle3" and native.get("aux_layer_ids") != cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]:
            raise ExportValidationError("drafthead_config.aux_layer_ids disagrees with eagle_config's aux ids")


def _check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise ExportValidationError(f"d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    target_ids = torch.arange(d2t.numel()) + d2t
    bad = ((target_ids < 0) | (target_ids >= vocab_size)).nonzero().flatten()
    if bad.numel():
        i = bad[0].item()
        raise ExportValidationError(
            f"d2t out of range: draft id {i} maps to target id {target_ids[i].item()}, outside [0, {vocab_size}) "
            f"({bad.numel()} draft ids affected)"
        )
    mapped = torch.zeros(vocab_size, dtype=torch.bool)
    mapped[target_ids] = True
    if target_ids.unique().numel() != target_ids.numel():
        raise ExportValidationError("d2t is inconsistent: several draft ids map to the same target id")
    if not torch.equal(mapped, t2d):
        only_t2d = (t2d & ~mapped).nonzero().flatten()[:5].tolist()
        only_d2t = (mapped & ~t2d).nonzero().flatten()[:5].tolist()
        raise ExportValidationError(
            f"d2t is inconsistent with t2d: target ids marked in t2d but not reached by d2t {only_t2d}, "
            f"reached by d2t but not marked in t2d {only_d2t}"
        )


def _check_tensors(state: dict[str, torch.Tensor], cfg: dict[str, Any], kind: str) -> None:
    names = set(state)
    if kind == "eagle3":
        if any(n.startswith(SERVING_LAYER) for n in names):
            raise ExportValidationError(
                "EAGLE-3 tensors are named layers.0.*; SGLang silently drops them: they must be midlayer.*"
            )
        for buf in ("d2t", "t2d"):
            if buf not in names:
                raise ExportValidationError(
                    f"missing {buf!r}: without it the engines map draft ids to the first target ids"
                )
        if "lm_head.weight" in state and state["lm_head.weight"].shape[0] != cfg["draft_vocab_size"]:
            raise ExportValidationError(
                f"draft_vocab_size {cfg['draft_vocab_size']} in config.json disagrees with lm_head.weight, "
                f"which has {state['lm_head.weight'].shape[0]} rows"
            )
    shapes = expected_shapes(cfg, kind)
    unknown = sorted(names - set(shapes))
    if unknown:
        raise ExportValidationError(f"unknown tensor names (the engines would drop them silently): {unknown}")
    missing = sorted(set(shapes) - names)
    if missing:
        raise ExportValidationError(f"missing tensors: {missing}")
    for name, shape in shapes.items():
        if tuple(state[name].shape) != shape:
            raise ExportValidationError(
                f"tensor {name} has shape {tuple(state[name].shape)}, config.json implies {shape}"
            )
    if kind == "eagle3":
        _check_vocab_maps(state["d2t"], state["t2d"], cfg["vocab_size"])


@torch.no_grad()
def check_reload(folder: str | Path, head: DraftHead, seq_len: int = 6, seed: int = 0) -> None:
    """Reload `folder` through load_head and compare its logits with `head`'s on the same random inputs."""
    ref = next(head.fc.parameters())
    reloaded = load_head(folder, device=ref.device, dtype=ref.dtype)
    if reloaded.config.kind != head.config.kind:
        raise ExportValidationError(f"reloaded head is {reloaded.config.kind}, source head is {head.config.kind}")
    # the borrowed target modules are not in the file: share the source head's
    reloaded.embed_tokens = head.embed_tokens
    if not head.eagle3:
        reloaded.target_norm, reloaded.target_lm_head = head.target_norm, head.target_lm_head
    gen = torch.Generator().manual_seed(seed)
    cfg = head.config
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len), generator=gen).to(ref.device)
    width = cfg.feature_size if head.eagle3 else cfg.hidden_size
    feats = torch.randn(1, seq_len, width, generator=gen).to(ref.device, ref.dtype)
    pos = torch.arange(seq_len, device=ref.device)[None]
    was_training = head.training
    head.eval()
    expected = head.logits(head(ids, head.fuse(feats), pos))
    head.train(was_training)
    got = reloaded.eval().logits(reloaded(ids, reloaded.fuse(feats), pos))
    tol = 1e-5 if ref.dtype == torch.float32 else 1e-2
    if not torch.allclose(got, expected, atol=tol, rtol=tol):
        raise ExportValidationError(
            f"reloading {folder} does not reproduce the head's logits (max abs diff "
            f"{(got.float() - expected.float()).abs().max().item():.3g})"
        )
    if head.eagle3:
        draft_ids = torch.arange(cfg.draft_vocab_size, device=ref.device)
        if not torch.equal(reloaded.draft_to_target(draft_ids), head.draft_to_target(draft_ids)):
            raise ExportValidationError("reloaded d2t maps draft ids differently from the source head")


def validate_export(folder: str | Path, head: DraftHead | None = None) -> None:
    """Raise ExportValidationError if `folder` is not a correct serving folder (and, given `head`, its export)."""
    folder = Path(folder)
    if not (folder / CONFIG_NAME).exists():
        raise ExportValidationError(f"{folder} has no {CONFIG_NAME}")
    if not (folder / WEIGHTS_NAME).exists():
        raise ExportValidationError(f"{folder} has no {WEIGHTS_NAME}")
    try:
        cfg = json.loads((folder / CONFIG_NAME).read_text())
    except json.JSONDecodeError as err:
        raise ExportValidationError(f"{folder / CONFIG_NAME} is not valid JSON: {err}") from err
    kind = _check_config(cfg)
    _check_tensors(load_file(str(folder / WEIGHTS_NAME)), cfg, kind)
    _check_native_agreement(cfg, kind)
    if head is not None:
        check_reload(folder, head)
