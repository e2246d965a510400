"""Export a native head folder to the layout vLLM and SGLang load, or to llama.cpp's GGUF (export_gguf.py).

    python -m drafthead.export runs/x/head runs/x/eagle3-serving [--format eagle3|eagle1] [--force]
    python -m drafthead.export runs/x/head runs/x/head.gguf --format gguf --target TARGET_DIR [--outtype f32]

The serving layout follows shared/reference/checkpoint-format.md:

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

from .checkpoint import load_head, stored_dtype, write_head_folder
from .config import HeadConfig
from .export_gguf import OUTTYPES, export_gguf
from .format import ARCHITECTURES, FORMATS, NATIVE_KEY, rope_parameters, rope_type, serving_tensor_names, vllm_aux_ids
from .model import DraftHead
from .utils import dtype_name
from .validate import ExportValidationError, validate_export


def serving_config(config: HeadConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json a serving engine reads, plus our own "drafthead_config" key."""
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
        "rope_scaling": config.rope_scaling if rope_type(config.rope_scaling) != "default" else None,
        "rope_parameters": rope_parameters(config.rope_theta, config.rope_scaling),  # transformers 5.x readers
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype_name(dtype),
    }
    if config.kind == "eagle3":
        values.update(
            draft_vocab_size=config.draft_vocab_size,
            target_hidden_size=config.target_hidden_size,
            eagle_config={
                "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
                "use_aux_hidden_state": True,
            },
            eagle_aux_hidden_state_layer_ids=vllm_aux_ids(config.aux_layer_ids),
        )
    else:
        values["eagle_fc_bias"] = True  # vLLM's EAGLE-1 loader reads this to build fc with a bias
    values[NATIVE_KEY] = config.to_dict()
    return values


def write_serving_folder(head: DraftHead, folder: str | Path, fmt: str | None = None) -> None:
    """Write `head` in the serving layout into `folder` (no validation, no atomic publish: see export_head)."""
    fmt = fmt or head.config.kind
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {FORMATS}, got {fmt!r}")
    if fmt != head.config.kind:
        raise ValueError(f"a {head.config.kind} head cannot be exported as {fmt}: train a {fmt} head instead")
    dtype = next(head.fc.parameters()).dtype
    write_head_folder(folder, serving_tensor_names(head.saved_state_dict(), fmt), serving_config(head.config, dtype))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def export_head(src: str | Path | DraftHead, out: str | Path, fmt: str | None = None, force: bool = False) -> Path:
    """Export a native head folder (or a DraftHead) to `out`, validate it, and publish it atomically.

    Refuses an existing non-empty `out` unless `force`. Raises ExportValidationError if the result is wrong.
    """
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
    parser.add_argument("out", help="output folder for vLLM / SGLang, or the .gguf file for llama.cpp")
    parser.add_argument("--format", choices=(*FORMATS, "gguf"), default=None, help="default: the head's own kind")
    parser.add_argument("--target", default=None, help="gguf: the target's model folder (config and tokenizer)")
    parser.add_argument("--outtype", choices=sorted(OUTTYPES), default=None,
                        help="gguf: the matrices' type (default: the head's own dtype)")
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty OUT")
    args = parser.parse_args(argv)
    if args.format != "gguf" and (args.target or args.outtype):
        parser.error("--target and --outtype belong to --format gguf")
    try:
        if args.format == "gguf":
            out = export_gguf(args.src, args.out, args.target, args.outtype, args.force)
        else:
            out = export_head(args.src, args.out, args.format, args.force)
    except (ExportValidationError, FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"export failed: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}" if args.format == "gguf" else f"wrote and validated {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
