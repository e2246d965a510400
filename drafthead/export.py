"""Export a native head folder to the layout vLLM and SGLang load (see shared/reference/checkpoint-format.md).

    python -m drafthead.export runs/x/head runs/x/eagle3-serving [--format eagle3|eagle1] [--force]

EAGLE-3: tensors fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d (the native names already);
         config.json with architectures ["LlamaForCausalLMEagle3"] and both aux-layer keys:
         eagle_config.eagle_aux_hidden_state_layer_ids = ids      (SGLang: id k = output of layer k)
         eagle_aux_hidden_state_layer_ids = [k + 1 for k in ids]  (vLLM:   id k = input of layer k)
EAGLE-1: tensors fc.weight, fc.bias, layers.0.* (midlayer.* renamed); architectures ["LlamaForCausalLMEagle"].
Both keep our own "drafthead_config" key so load_head() reloads the folder losslessly. The folder is built in
a temp directory next to OUT, validated (drafthead.validate), then renamed into place.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .checkpoint import CONFIG_NAME, WEIGHTS_NAME, atomic_write_bytes, atomic_write_json, load_head, stored_dtype
from .config import HeadConfig, default_aux_layer_ids
from .model import DraftHead

FORMATS = ("eagle3", "eagle1")
ARCHITECTURES = {"eagle3": "LlamaForCausalLMEagle3", "eagle1": "LlamaForCausalLMEagle"}
NATIVE_LAYER, SERVING_LAYER = "midlayer.", "layers.0."


def serving_tensor_names(state: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """Native names -> serving names (EAGLE-1 renames midlayer.* to layers.0.*; EAGLE-3 keeps them)."""
    if fmt == "eagle3":
        return dict(state)
    return {SERVING_LAYER + k[len(NATIVE_LAYER):] if k.startswith(NATIVE_LAYER) else k: v for k, v in state.items()}


def native_tensor_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Serving names -> native names (layers.0.* -> midlayer.*); native names pass through."""
    return {NATIVE_LAYER + k[len(SERVING_LAYER):] if k.startswith(SERVING_LAYER) else k: v for k, v in state.items()}


def serving_config(config: HeadConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json a serving engine reads, plus our own "drafthead_config" key."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        rope.update(config.rope_scaling)
        rope["rope_type"] = config.rope_scaling.get("rope_type", config.rope_scaling.get("type", "default"))
    values: dict[str, Any] = {
        "architectures": [ARCHITECTURES[config.kind]],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": config.hidden_act,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling if rope["rope_type"] != "default" else None,
        "rope_parameters": rope,  # transformers 5.x readers
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if config.kind == "eagle3":
        values.update(
            draft_vocab_size=config.draft_vocab_size,
            target_hidden_size=config.target_hidden_size,
            eagle_config={
                "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
                "use_aux_hidden_state": True,
            },
            eagle_aux_hidden_state_layer_ids=[k + 1 for k in config.aux_layer_ids],
        )
    else:
        values["eagle_fc_bias"] = True  # vLLM's EAGLE-1 loader reads this to build fc with a bias
    values["drafthead_config"] = config.to_dict()
    return values


def read_head_config(values: dict[str, Any], target_config: Any | None = None) -> HeadConfig:
    """A HeadConfig for a serving folder: from our "drafthead_config" key, else rebuilt from the Llama fields.

    A third-party folder does not record the target's layer count; it is taken from `target_config`.
    """
    if "drafthead_config" in values:
        return HeadConfig.from_dict(values["drafthead_config"])
    arch = (values.get("architectures") or [""])[0]
    if arch not in ARCHITECTURES.values() and arch != "EAGLEModel":
        raise ValueError(f"config.json is neither a native head nor an EAGLE serving folder (architectures={arch!r})")
    if target_config is None:
        raise ValueError("this serving folder has no 'drafthead_config': pass the target to load_head(target=...)")
    from .config import _text_config

    tcfg = _text_config(target_config)
    kind = "eagle3" if arch == ARCHITECTURES["eagle3"] else "eagle1"
    hidden = values["hidden_size"]
    ids = (values.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None and values.get("eagle_aux_hidden_state_layer_ids") is not None:
        ids = [k - 1 for k in values["eagle_aux_hidden_state_layer_ids"]]  # vLLM's key: input of layer k
    return HeadConfig(
        kind=kind,
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


def write_serving_folder(head: DraftHead, folder: str | Path, fmt: str | None = None) -> None:
    """Write `head` in the serving layout into `folder` (no validation, no atomic publish: see export_head)."""
    fmt = fmt or head.config.kind
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {FORMATS}, got {fmt!r}")
    if fmt != head.config.kind:
        raise ValueError(f"a {head.config.kind} head cannot be exported as {fmt}: train a {fmt} head instead")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.saved_state_dict().items()}
    state = serving_tensor_names(state, fmt)
    dtype = next(head.fc.parameters()).dtype
    atomic_write_bytes(folder / WEIGHTS_NAME, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    atomic_write_json(folder / CONFIG_NAME, serving_config(head.config, dtype))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def export_head(src: str | Path | DraftHead, out: str | Path, fmt: str | None = None, force: bool = False) -> Path:
    """Export a native head folder (or a DraftHead) to `out`, validate it, and publish it atomically.

    Refuses an existing non-empty `out` unless `force`. Raises ExportValidationError if the result is wrong.
    """
    from .validate import validate_export

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise FileExistsError(f"{out} exists and is not empty: pass --force to replace it")
    head = src if isinstance(src, DraftHead) else load_head(src, dtype=stored_dtype(src))  # keep bf16 as bf16
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    tmp.chmod(0o755)  # mkdtemp makes it private; a serving engine may run as another user
    try:
        write_serving_folder(head, tmp, fmt)
        validate_export(tmp, head=head)
        if out.exists():  # --force: move the old one aside, publish, then delete the old one
            old = out.parent / f".{out.name}.old"
            _remove(old)
            out.rename(old)
            tmp.rename(out)
            _remove(old)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m drafthead.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="native head folder (config.json + model.safetensors)")
    parser.add_argument("out", help="output folder for vLLM / SGLang")
    parser.add_argument("--format", choices=FORMATS, default=None, help="default: the head's own kind")
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty OUT")
    args = parser.parse_args(argv)
    from .validate import ExportValidationError

    try:
        out = export_head(args.src, args.out, args.format, args.force)
    except (ExportValidationError, FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"export failed: {err}", file=sys.stderr)
        return 1
    print(f"wrote and validated {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
