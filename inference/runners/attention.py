"""Attention for short query blocks over a preallocated KV buffer, registered with transformers' public
AttentionInterface: on CPU, SDPA is built for long query blocks and costs several times two small matmuls for the
1-64 queries of decoding and tree verification (docs/results/HISTORY.md). Where the CPU has one, the runners use
the C++ kernels (`kernel_attention`), which read only the used slots of the buffer in place.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from transformers import AttentionInterface

from ..cpu.kernels import avx2_kernels_available, kernels_available

NAME = "drafthead_matmul"
# Inside a compiled step, query blocks up to this size are traced (attend(), fused by the compiler); larger blocks and
# calls with `rows` keep the opaque prefix_attention op, reading only the used slots and rows (docs/results/HISTORY.md).
TRACED_MAX_QUERIES = 16
PREFILL_NAME = "drafthead_sdpa_prefix"


@torch.library.custom_op("drafthead::prefix_attention", mutates_args=())
def prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scaling: float, length: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """softmax((q·scaling)·kᵀ + mask) · v over the first `length` keys (the mask hides every slot after them).
    query (B, heads, n, D); key/value (B, kv_heads, S, D); mask (B, 1, n, S) additive; length, rows: 0-dim tensors,
    the used prefix of the buffer and the leading rows in use (later rows get zeros). Returns (B, n, heads, D).
    An opaque op, so a compiled step keeps one shape while the work follows the used length and rows."""
    used, alive = int(length), int(rows)
    full, heads, n, d = query.shape
    if alive < full:
        out = query.new_zeros(full, n, heads, d)
        out[:alive] = prefix_attention(query[:alive], key[:alive], value[:alive], mask[:alive], scaling, length, rows)
        return out
    # a prefix is not contiguous (matmul copies it): slice only where the whole buffer's extra scores cost more
    if n * (key.shape[2] - used) > used:
        key, value, mask = key[:, :, :used], value[:, :, :used], mask[..., :used]
    return attend(query, key, value, mask, scaling, add_in_place=True)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float,
           add_in_place: bool = False) -> torch.Tensor:
    """softmax((q·scaling)·kᵀ + mask) · v over every key given (shapes as prefix_attention's). Grouped-query
    attention folds each KV head's query heads into the query axis (no copy of the keys). `add_in_place` adds the
    mask into the scores' storage (eager: one pass fewer; traced code leaves fusing to the compiler)."""
    b, heads, n, d = query.shape
    kv_heads, used = key.shape[1], key.shape[2]
    groups = heads // kv_heads  # query head h reads KV head h // groups
    q = (query * scaling).reshape(b, kv_heads, groups * n, d)
    scores = torch.matmul(q, key.transpose(2, 3)).view(b, heads, n, used)
    scores = scores.add_(mask) if add_in_place else scores + mask
    out = torch.matmul(scores.softmax(dim=-1).view(b, kv_heads, groups * n, used), value)  # (B, kv_heads, groups·n, D)
    return out.view(b, heads, n, d).transpose(1, 2).contiguous()


@prefix_attention.register_fake
def _(query, key, value, mask, scaling, length, rows):
    return query.new_empty(query.transpose(1, 2).shape)  # (B, n, heads, D)


def matmul_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                     drafthead_kv_length: torch.Tensor | None = None, drafthead_rows: torch.Tensor | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; `drafthead_kv_length` and `drafthead_rows` (from the static
    runner) limit the work to the used slots and the leading rows in use."""
    b, _, n, _ = query.shape
    if attention_mask is None:
        attention_mask = query.new_zeros(b, 1, n, key.shape[2])
    if drafthead_rows is None and n <= TRACED_MAX_QUERIES and torch.compiler.is_compiling():
        return attend(query, key, value, attention_mask, scaling), None
    length = drafthead_kv_length if drafthead_kv_length is not None else torch.tensor(key.shape[2])
    rows = drafthead_rows if drafthead_rows is not None else torch.tensor(b)
    return prefix_attention(query, key, value, attention_mask, scaling, length, rows), None


AttentionInterface.register(NAME, matmul_attention)

KERNEL_NAME = "drafthead_kernel"
KERNEL_MAX_QUERIES = 16  # the kernels' limit: decoding steps and trees (a prompt's chunks go elsewhere)
_KERNEL_OPS: dict[torch.dtype, object] = {}  # filled by kernel_op, read by kernel_attention (traced: no build there)


def kernel_op(dtype: torch.dtype):
    """The prefix-attention kernel for `dtype` on this CPU, or None; built on first use (before any step is traced)."""
    if dtype == torch.bfloat16 and kernels_available():
        _KERNEL_OPS[dtype] = torch.ops.drafthead_kernels.prefix_attention
    if dtype == torch.float32 and avx2_kernels_available():
        _KERNEL_OPS[dtype] = torch.ops.drafthead_avx2.prefix_attention
    return _KERNEL_OPS.get(dtype)


def kernel_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                     drafthead_kv_length: torch.Tensor | None = None, drafthead_rows: torch.Tensor | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """The C++ prefix-attention kernels (kernel_op; up to KERNEL_MAX_QUERIES queries): each KV head's used slots
    read once in place for all its queries, float32 softmax; anything else goes to matmul_attention
    (docs/results/HISTORY.md; float32: docs/results/prefix_attention_avx2_ab_zen3.json)."""
    b, _, n, d = query.shape
    op = _KERNEL_OPS.get(query.dtype)
    if (op is None or n > KERNEL_MAX_QUERIES or attention_mask is None or d not in (32, 64, 128)
            or attention_mask.dtype not in (torch.float32, query.dtype) or attention_mask.shape[-1] < key.shape[2]
            or not (key.is_contiguous() and value.is_contiguous())):
        return matmul_attention(module, query, key, value, attention_mask, scaling, dropout, drafthead_kv_length,
                                drafthead_rows, **kwargs)
    length = drafthead_kv_length if drafthead_kv_length is not None else torch.tensor(key.shape[2])
    rows = drafthead_rows if drafthead_rows is not None else torch.tensor(b)
    return op(query, key, value, attention_mask, scaling, length, rows), None


AttentionInterface.register(KERNEL_NAME, kernel_attention)


def prefix_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                          drafthead_kv_length: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """SDPA over the used prefix of a buffer only, for a prompt's chunks (docs/results/HISTORY_LONG_CONTEXT.md)."""
    used = int(drafthead_kv_length) if drafthead_kv_length is not None else key.shape[2]
    key, value = key[:, :, :used], value[:, :, :used]
    mask = attention_mask[..., :used] if attention_mask is not None else None
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                           enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(PREFILL_NAME, prefix_sdpa_attention)


def kv_length_kwargs(model: nn.Module, kv_length: int | torch.Tensor, rows: torch.Tensor | None = None) -> dict:
    """The forward kwargs telling this project's attention kernels the used slots of a buffer and the rows in use."""
    implementation = model.config._attn_implementation
    kwargs = {}
    if implementation in (NAME, KERNEL_NAME, PREFILL_NAME):
        kwargs["drafthead_kv_length"] = torch.as_tensor(kv_length)
    if rows is not None and implementation in (NAME, KERNEL_NAME):
        kwargs["drafthead_rows"] = rows
    return kwargs


def decoding_attention(device: torch.device, dtype: torch.dtype, compiled: bool = False) -> str | None:
    """The attention the static runner's decoding steps dispatch to: the C++ kernel for its dtype where the CPU has
    one, the matmuls where they beat SDPA (a CPU's bf16/fp16 or compiled steps), else None (the model's own)."""
    if device.type == "cpu" and kernel_op(dtype) is not None:
        return KERNEL_NAME
    return NAME if device.type == "cpu" and (compiled or dtype in (torch.bfloat16, torch.float16)) else None


@contextlib.contextmanager
def attention_implementation(model: nn.Module, name: str | None):
    """Run the block with `model` dispatching attention to `name` (None: leave it), then restore the previous one."""
    previous = model.config._attn_implementation  # transformers has a public setter for it, no public getter
    if name is None or name == previous:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
