"""Facts of the native and serving folder formats, and of the target configs they are read against.

A leaf module: it imports nothing from the project, so config, model, checkpoint, validate and export can
all build on it (see shared/reference/checkpoint-format.md for the serving layout).

    native folder   config.json {"drafthead_config": {...}} + model.safetensors (native tensor names)
    serving folder  config.json (Llama fields + EAGLE keys + our "drafthead_config") + model.safetensors
                    EAGLE-3 keeps the native names; EAGLE-1 renames midlayer.* to layers.0.*
"""

from __future__ import annotations

from typing import Any

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
NATIVE_KEY = "drafthead_config"  # our own config.json key: load_head reloads a folder losslessly from it
WEIGHTS_METADATA = {"format": "pt"}  # safetensors metadata transformers-style readers expect

FORMATS = ("eagle3", "eagle1")
ARCHITECTURES = {"eagle3": "LlamaForCausalLMEagle3", "eagle1": "LlamaForCausalLMEagle"}
FOREIGN_EAGLE1_ARCHITECTURE = "EAGLEModel"  # third-party EAGLE-1 folders
NATIVE_LAYER, SERVING_LAYER = "midlayer.", "layers.0."
# Borrowed target modules (token embedding; EAGLE-1: final norm and lm_head): frozen, never written to a file.
FROZEN_PREFIXES = ("embed_tokens.", "target_norm.", "target_lm_head.")


def is_head_config(values: dict[str, Any]) -> bool:
    """Whether a config.json (as a dict) describes a draft head: our native key, or an EAGLE serving architecture."""
    arch = (values.get("architectures") or [""])[0]
    return NATIVE_KEY in values or arch in ARCHITECTURES.values() or arch == FOREIGN_EAGLE1_ARCHITECTURE


def serving_tensor_names(state: dict[str, Any], fmt: str) -> dict[str, Any]:
    """Native names -> serving names (EAGLE-1 renames midlayer.* to layers.0.*; EAGLE-3 keeps them)."""
    if fmt == "eagle3":
        return dict(state)
    return {SERVING_LAYER + k[len(NATIVE_LAYER):] if k.startswith(NATIVE_LAYER) else k: v for k, v in state.items()}


def native_tensor_names(state: dict[str, Any]) -> dict[str, Any]:
    """Serving names -> native names (layers.0.* -> midlayer.*); native names pass through."""
    return {NATIVE_LAYER + k[len(SERVING_LAYER):] if k.startswith(SERVING_LAYER) else k: v for k, v in state.items()}


def vllm_aux_ids(aux_layer_ids: list[int]) -> list[int]:
    """Our aux ids (SGLang's: id k = output of layer k) -> vLLM's top-level key (id k = input of layer k)."""
    return [k + 1 for k in aux_layer_ids]


def aux_ids_from_vllm(vllm_ids: list[int]) -> list[int]:
    """vLLM's eagle_aux_hidden_state_layer_ids (input of layer k) -> ours (output of layer k)."""
    return [k - 1 for k in vllm_ids]


def text_config(target_config: Any) -> Any:
    """The language model's config: multimodal configs (e.g. Gemma3) keep its fields in `text_config`."""
    return getattr(target_config, "text_config", None) or target_config


def rope_of(cfg: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a transformers 4.x or 5.x config; rope_scaling None for default rope."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if "full_attention" in params:  # per-layer-type rope (Gemma3): the full-attention layers' settings
        params = params["full_attention"]
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    if not params:  # transformers 4.x: rope_scaling holds only the scaling
        params = dict(getattr(cfg, "rope_scaling", None) or {})
    scaling = None
    if rope_type(params) != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return float(theta), scaling


def rope_type(scaling: dict | None) -> str:
    """The rope type a rope dict names ("type" in older configs); "default" when it names none."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_parameters(theta: float, scaling: dict | None) -> dict[str, Any]:
    """The transformers 5.x `rope_parameters` dict of (rope_theta, rope_scaling)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling:
        rope.update(scaling)
        rope["rope_type"] = rope_type(scaling)
    return rope
