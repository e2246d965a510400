"""Export an EAGLE-3 head as the GGUF file llama.cpp serves (`llama-server -md head.gguf --spec-type draft-eagle3`).

    python -m drafthead.export runs/x/head head.gguf --format gguf --target TARGET_DIR [--outtype f32|bf16|f16]

The file holds what llama.cpp's own `convert_hf_to_gguf.py <serving export> --target-model-dir TARGET_DIR` writes
(tests/data/eagle3_gguf_manifest.json records that converter's output for a tiny head): architecture "eagle3",
the target's tokenizer (llama-server checks it against the target's), llama.cpp's tensor names, q/k rows permuted
into its rope layout, d2t as absolute target ids, no t2d, and llama.cpp's aux ids (input of layer k: ours + 1).
It needs only the `gguf` package and the target's config and tokenizer files, never llama.cpp itself.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from hashlib import sha256
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from .checkpoint import check_compatible, load_head, stored_dtype
from .format import CONFIG_NAME, rope_type, vllm_aux_ids
from .model import DraftHead
from .utils import atomic_write_bytes, dtype_name

ARCH = "eagle3"  # llama.cpp's architecture name (the gguf package on PyPI may predate it: keys spelled out below)
OUTTYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16}
QTYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
          "bf16": gguf.GGMLQuantizationType.BF16}
OUTTYPE_OF_DTYPE = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # a torch dtype's name -> outtype

# Our EAGLE-3 tensor names -> llama.cpp's (its tensor map for the eagle3 architecture).
TENSOR_NAMES = {
    "fc.weight": "fc.weight",
    "lm_head.weight": "output.weight",
    "norm.weight": "output_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}
SKIPPED = {"t2d"}  # llama.cpp does not use it at run time

# The text llama.cpp's converter encodes to name a BPE tokenizer's pre-tokenizer: sha256 of str(token ids) ->
# tokenizer.ggml.pre, for the tokenizer families we export for (a subset of its convert_hf_to_gguf table).
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333"
    " 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======="
    " нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not"
    " sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
PRE_TOKENIZERS = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # HuggingFaceTB/SmolLM-135M
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # meta-llama/Meta-Llama-3-8B
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen/Qwen1.5-7B
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
}


def permute_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's rope layout for q/k rows: each head's (first half, second half) pairs interleaved."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def gguf_tensors(head: DraftHead) -> dict[str, torch.Tensor]:
    """llama.cpp's tensors of an EAGLE-3 head, in its names, layout and order (d2t last, as absolute ids)."""
    cfg = head.config
    state = head.saved_state_dict()
    unknown = set(state) - set(TENSOR_NAMES) - SKIPPED - {"d2t"}
    if unknown:
        raise ValueError(f"tensors llama.cpp's eagle3 architecture has no place for: {sorted(unknown)}")
    tensors = {}
    if rope_type(cfg.rope_scaling) == "llama3":  # llama.cpp reads llama3 rope as per-frequency factors
        tensors["rope_freqs.weight"] = llama3_rope_factors(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling)
    for name in sorted(TENSOR_NAMES):  # the order of the safetensors file its converter reads
        weight = state[name].detach().cpu()
        if name.endswith("q_proj.weight"):
            weight = permute_rows(weight, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = permute_rows(weight, cfg.num_key_value_heads)
        tensors[TENSOR_NAMES[name]] = weight
    d2t = state["d2t"].cpu().to(torch.int64)
    tensors["d2t"] = d2t + torch.arange(d2t.numel(), dtype=torch.int64)
    target_ids = tensors["d2t"]
    if bool(((target_ids < 0) | (target_ids >= cfg.vocab_size)).any()):
        raise ValueError(f"d2t maps draft ids outside the target vocabulary of {cfg.vocab_size}")
    if target_ids.unique().numel() != target_ids.numel():
        raise ValueError("d2t maps several draft ids to the same target id")
    return tensors


def llama3_rope_factors(theta: float, dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    """The per-frequency divisors of llama3 rope scaling (llama.cpp's rope_freqs tensor)."""
    factor = scaling.get("factor", 8.0)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors).float()


def add_tensor(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, outtype: str) -> None:
    """One tensor as llama.cpp's converter stores it: ids as I64, 1-D and norms as F32, matrices in `outtype`."""
    if tensor.dtype == torch.int64:
        writer.add_tensor(name, tensor.numpy(), raw_dtype=gguf.GGMLQuantizationType.I64)
        return
    data = tensor.float().numpy() if tensor.dtype not in (torch.float16, torch.float32) else tensor.numpy()
    qtype = QTYPES["f32" if data.ndim <= 1 or name.endswith("_norm.weight") else outtype]
    writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def add_hparams(writer: gguf.GGUFWriter, head: DraftHead, outtype: str) -> None:
    """The architecture keys llama.cpp's converter writes for an EAGLE-3 head, in its order."""
    cfg = head.config
    writer.add_block_count(1)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    kind = rope_type(cfg.rope_scaling)
    if kind == "linear" and cfg.rope_scaling.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_scaling["factor"])
    elif kind not in ("default", "llama3"):
        raise ValueError(f"rope type {kind!r} is not exported to GGUF here: use llama.cpp's convert_hf_to_gguf.py")
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_file_type(OUTTYPES[outtype])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.head_dim)


def looks_special(token: str) -> bool:
    """llama.cpp's converter's rule for added tokens that are control tokens though not marked special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def add_tokenizer(writer: gguf.GGUFWriter, target_dir: Path, vocab_size: int) -> None:
    """The target's byte-level BPE tokenizer, as llama.cpp's converter writes it (its `_set_vocab_gpt2`)."""
    from transformers import AutoTokenizer

    files = json.loads((target_dir / "tokenizer.json").read_text()) if (target_dir / "tokenizer.json").exists() \
        else None
    model = (files or {}).get("model", {})
    llama_hf = model.get("byte_fallback", False) and (files.get("decoder") or {}).get("type") == "Sequence"
    if (target_dir / "tokenizer.model").exists() or model.get("type") != "BPE" or llama_hf:
        raise ValueError(f"{target_dir}: only byte-level BPE tokenizers (tokenizer.json, no tokenizer.model) are "
                         "exported to GGUF here: use llama.cpp's convert_hf_to_gguf.py")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    check = sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    if check not in PRE_TOKENIZERS:
        raise ValueError(f"{target_dir}: unknown BPE pre-tokenizer (check hash {check}): use llama.cpp's "
                         "convert_hf_to_gguf.py")
    by_id = {i: token for token, i in tokenizer.vocab.items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        if token not in added:
            types.append(gguf.TokenType.NORMAL)
        else:
            if not decoder[i].normalized:  # llama.cpp expects added tokens pre-normalized
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZERS[check])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(target_dir, load_merges=True).add_to_gguf(writer, quiet=True)
    if vocab_size == 49152:  # llama.cpp's converter's rule for this vocabulary size (Granite/SmolLM): no BOS
        writer.add_add_bos_token(False)


def write_gguf(head: DraftHead, target_dir: str | Path, out: str | Path, outtype: str | None = None,
               name_from: str | Path | None = None) -> Path:
    """Write `head` (EAGLE-3) as llama.cpp's GGUF at `out`, atomically; `target_dir` holds the target's config.json
    and tokenizer; `name_from` is the folder whose name gives general.name (llama.cpp's naming heuristics)."""
    from transformers import AutoConfig

    cfg, target_dir, out = head.config, Path(target_dir), Path(out)
    if cfg.kind != "eagle3":
        raise ValueError(f"llama.cpp serves EAGLE-3 heads only; this head is {cfg.kind}")
    outtype = outtype or OUTTYPE_OF_DTYPE.get(dtype_name(next(head.fc.parameters()).dtype), "f32")
    if outtype not in OUTTYPES:
        raise ValueError(f"--outtype must be one of {sorted(OUTTYPES)}, got {outtype!r}")
    if not (target_dir / CONFIG_NAME).exists():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {target_dir}: --target must be the target's model folder")
    check_compatible(cfg, AutoConfig.from_pretrained(target_dir))
    writer = gguf.GGUFWriter(path=None, arch=ARCH)
    writer.add_array(f"{ARCH}.target_layers", vllm_aux_ids(cfg.aux_layer_ids))
    writer.add_uint32(f"{ARCH}.target_hidden_size", cfg.target_hidden_size)
    writer.add_bool(f"{ARCH}.norm_before_residual", False)
    writer.add_bool(f"{ARCH}.norm_before_fc", False)
    for name, tensor in gguf_tensors(head).items():
        add_tensor(writer, name, tensor, outtype)
    total, shared, expert, experts = writer.get_total_parameter_count()
    folder = Path(name_from) if name_from is not None else out.with_suffix("")
    meta = gguf.Metadata.load(None, folder if folder.is_dir() else None, None, total)
    meta.name = meta.name or folder.name
    meta.size_label = meta.size_label or gguf.size_label(total, shared, expert, experts)
    writer.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(writer)
    add_hparams(writer, head, outtype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(writer, target_dir, cfg.vocab_size)

    def write(tmp: str) -> None:
        writer.write_header_to_file(path=Path(tmp))
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write_bytes(out, write)
    return out


def export_gguf(src: str | Path, out: str | Path, target_dir: str | Path | None, outtype: str | None = None,
                force: bool = False) -> Path:
    """Export a head folder (native or serving) to a GGUF file; refuses an existing `out` unless `force`."""
    out = Path(out)
    if target_dir is None:
        raise ValueError("--format gguf needs --target: the target's model folder (its config and tokenizer)")
    if out.is_dir():
        raise ValueError(f"{out} is a folder: --format gguf writes one file, e.g. {out / 'head.gguf'}")
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists: pass --force to replace it")
    head = load_head(src, dtype=stored_dtype(src))
    return write_gguf(head, target_dir, out, outtype, name_from=src)


def read_gguf(path: str | Path) -> tuple[dict[str, tuple[str, Any]], dict[str, tuple[list[int], str, memoryview]]]:
    """A GGUF file's metadata {key: (type, value)} and tensors {name: (shape, type, bytes)}, in file order, the bytes
    mapped from the file (a plain parser: gguf.GGUFReader takes seconds over a tokenizer's hundred thousand strings)."""
    with open(path, "rb") as f:
        buf = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        value = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return value[0]

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return bytes(buf[pos - n:pos]).decode("utf-8")

    scalars = {gguf.GGUFValueType.UINT8: "B", gguf.GGUFValueType.INT8: "b", gguf.GGUFValueType.UINT16: "H",
               gguf.GGUFValueType.INT16: "h", gguf.GGUFValueType.UINT32: "I", gguf.GGUFValueType.INT32: "i",
               gguf.GGUFValueType.FLOAT32: "f", gguf.GGUFValueType.BOOL: "?", gguf.GGUFValueType.UINT64: "Q",
               gguf.GGUFValueType.INT64: "q", gguf.GGUFValueType.FLOAT64: "d"}

    def value(kind: gguf.GGUFValueType) -> tuple[str, Any]:
        if kind == gguf.GGUFValueType.STRING:
            return kind.name, string()
        if kind == gguf.GGUFValueType.ARRAY:
            item, n = gguf.GGUFValueType(take("I")), take("Q")
            items = [value(item)[1] for _ in range(n)]
            return f"{kind.name}/{item.name}", items
        return kind.name, take(scalars[kind])

    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    pos = 4
    take("I")  # the format version (3 for the files written here)
    n_tensors, n_kv = take("Q"), take("Q")
    metadata = {}
    for _ in range(n_kv):
        key = string()
        metadata[key] = value(gguf.GGUFValueType(take("I")))
    infos = []
    for _ in range(n_tensors):
        name = string()
        shape = [take("Q") for _ in range(take("I"))]
        infos.append((name, shape, gguf.GGMLQuantizationType(take("I")), take("Q")))
    alignment = metadata.get("general.alignment", ("", gguf.GGUF_DEFAULT_ALIGNMENT))[1]
    start = -(-pos // alignment) * alignment
    tensors = {}
    for name, shape, qtype, offset in infos:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = math.prod(shape) // block * size
        tensors[name] = (shape, qtype.name, buf[start + offset:start + offset + nbytes])
    return metadata, tensors


def gguf_manifest(path: str | Path) -> dict[str, Any]:
    """A GGUF file's metadata and tensors as JSON-able values: long arrays as their length and sha256, tensors as
    llama.cpp's shape, type and the sha256 of their bytes (what tests/data/eagle3_gguf_manifest.json records)."""
    fields, data = read_gguf(path)
    metadata = {}
    for key, (kind, value) in fields.items():
        if isinstance(value, list) and len(value) > 16:
            value = {"length": len(value), "sha256": sha256(json.dumps(value, ensure_ascii=False).encode()).hexdigest()}
        elif isinstance(value, float):
            value = float(np.float32(value))
        metadata[key] = {"type": kind, "value": value}
    tensors = {name: {"shape": shape, "type": kind, "sha256": sha256(raw).hexdigest()}
               for name, (shape, kind, raw) in data.items()}
    return {"metadata": metadata, "tensors": tensors}
