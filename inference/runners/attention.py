"""Matmul attention for short query blocks over a preallocated KV buffer, registered with transformers'
public AttentionInterface so any model that dispatches through it can use it.

Why: on CPU, PyTorch's bf16 SDPA kernel is built for long query blocks and costs several times two small matmuls
for the 1-64 queries of decoding and tree verification (docs/results/HISTORY.md). Where the CPU has one, the runners use
the C++ kernels (`kernel_attention`: prefix_attention.cpp in bf16, prefix_attention_avx2.cpp in float32), which
read only the used slots of the buffer in place.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from transformers import AttentionInterface

from ..cpu.kernels import avx2_kernels_available, kernels_available

NAME = "drafthead_matmul"
# Inside a compiled step, query blocks up to this size are traced (attend() inline: the compiler fuses the mask,
# softmax and layout copies around its two matmuls, and no Python op runs per layer) instead of calling the opaque
# prefix_attention op, which saves the op's per-layer overhead (docs/results/HISTORY.md). Larger blocks (a prompt's
# chunks) and calls with `rows` keep the op, which slices to the used prefix and skips the rows not in use.
TRACED_MAX_QUERIES = 16
PREFILL_NAME = "drafthead_sdpa_prefix"


@torch.library.custom_op("drafthead::prefix_attention", mutates_args=())
def prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scaling: float, length: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """softmax((q·scaling)·kᵀ + mask) · v over the first `length` keys (the mask hides every slot after them).
    query (B, heads, n, D); key/value (B, kv_heads, S, D); mask (B, 1, n, S) additive; length: 0-dim tensor, the
    used prefix of the buffer (everything after it is masked anyway); rows: 0-dim tensor, the leading rows of the
    batch that are in use (the static runner keeps its shape as rows finish; later rows get zeros, unread). Returns
    (B, n, heads, D).
    An opaque op, so a compiled step keeps one static shape while the work follows the sequence length and the
    rows in use. A prefix of the buffer is not contiguous across (row, head) and PyTorch's CPU matmul would copy it
    first (docs/results/HISTORY_LONG_CONTEXT.md), so the whole buffer is read (the mask hides the unused slots) when the
    extra scores (queries × unused slots) are fewer than the used slots a slice would copy."""
    used, alive = int(length), int(rows)
    full, heads, n, d = query.shape
    if alive < full:
        out = query.new_zeros(full, n, heads, d)
        out[:alive] = prefix_attention(query[:alive], key[:alive], value[:alive], mask[:alive], scaling, length,
                                       rows)
        return out
    if n * (key.shape[2] - used) > used:  # (see the docstring)
        key, value, mask = key[:, :, :used], value[:, :, :used], mask[..., :used]
    return attend(query, key, value, mask, scaling, add_in_place=True)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float,
           add_in_place: bool = False) -> torch.Tensor:
    """softmax((q·scaling)·kᵀ + mask) · v over every key given: query (B, heads, n, D), key/value (B, kv_heads,
    S, D), mask (B, 1, n, S) additive. Returns (B, n, heads, D). Grouped-query attention folds the query heads of
    each KV head into the query axis (no copy of the keys per head). `add_in_place` adds the mask into the scores'
    own storage (eager: one pass fewer; traced code leaves fusing to the compiler)."""
    b, heads, n, d = query.shape
    kv_heads, used = key.shape[1], key.shape[2]
    groups = heads // kv_heads  # query head h reads KV head h // groups
    q = (query * scaling).reshape(b, kv_heads, groups * n, d)
    scores = torch.matmul(q, key.transpose(2, 3)).view(b, heads, n, used)
    scores = scores.add_(mask) if add_in_place else scores + mask
    probs = scores.softmax(dim=-1)
    out = torch.matmul(probs.view(b, kv_heads, groups * n, used), value)  # (B, kv_heads, groups·n, D)
    return out.view(b, heads, n, d).transpose(1, 2).contiguous()


@prefix_attention.register_fake
def _(query, key, value, mask, scaling, length, rows):
    b, heads, n, d = query.shape
    return query.new_empty(b, n, heads, d)


def matmul_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                     drafthead_kv_length: torch.Tensor | None = None, drafthead_rows: torch.Tensor | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (query (B, heads, n, D), key/value (B, kv_heads, S, D),
    attention_mask (B, 1, n, S) additive); `drafthead_kv_length` (passed to the model's forward by the
    static runner) limits the work to the used part of a preallocated buffer, `drafthead_rows` (the static runner)
    to the leading rows in use."""
    b, _, n, _ = query.shape
    if attention_mask is None:
        attention_mask = query.new_zeros(b, 1, n, key.shape[2])
    if drafthead_rows is None and n <= TRACED_MAX_QUERIES and torch.compiler.is_compiling():
        return attend(query, key, value, attention_mask, scaling), None
    if drafthead_kv_length is None:
        drafthead_kv_length = torch.tensor(key.shape[2])
    if drafthead_rows is None:
        drafthead_rows = torch.tensor(b)
    return prefix_attention(query, key, value, attention_mask, scaling, drafthead_kv_length, drafthead_rows), None


AttentionInterface.register(NAME, matmul_attention)

KERNEL_NAME = "drafthead_kernel"
KERNEL_MAX_QUERIES = 16  # the kernels' limit: decoding steps and trees (a prompt's chunks go elsewhere)


_KERNEL_OPS: dict[torch.dtype, object] = {}  # filled by kernel_op, read by kernel_attention (traced: no build there)


def kernel_op(dtype: torch.dtype):
    """The prefix-attention kernel for `dtype` on this CPU, or None: prefix_attention.cpp (AVX512-BF16) for bf16,
    prefix_attention_avx2.cpp (AVX2) for float32. Builds it on first use (decoding_attention calls this when a
    runner is set up, before any step is traced)."""
    if dtype == torch.bfloat16 and kernels_available():
        _KERNEL_OPS[dtype] = torch.ops.drafthead_kernels.prefix_attention
    if dtype == torch.float32 and avx2_kernels_available():
        _KERNEL_OPS[dtype] = torch.ops.drafthead_avx2.prefix_attention
    return _KERNEL_OPS.get(dtype)


def kernel_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                     drafthead_kv_length: torch.Tensor | None = None, drafthead_rows: torch.Tensor | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """The C++ prefix-attention kernels (kernel_op: bf16 with AVX512-BF16, float32 with AVX2; up to
    KERNEL_MAX_QUERIES queries): read the used slots of the buffer in place, each KV head's keys and values once
    for all its queries, float32 softmax; anything else goes to matmul_attention. Faster than the matmuls because
    it reads only the used slots, once (docs/results/HISTORY.md; float32: docs/results/prefix_attention_avx2_ab_zen3.json)."""
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
    """PyTorch SDPA over the used prefix of a preallocated buffer only: for long query blocks (a prompt's chunks),
    where SDPA's fused kernel wins and attending the whole buffer would multiply the work (docs/results/HISTORY_LONG_CONTEXT.md)."""
    used = int(drafthead_kv_length) if drafthead_kv_length is not None else key.shape[2]
    key, value = key[:, :, :used], value[:, :, :used]
    mask = attention_mask[..., :used] if attention_mask is not None else None
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                           enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(PREFILL_NAME, prefix_sdpa_attention)


def kv_length_kwargs(model: nn.Module, kv_length: int | torch.Tensor | None,
                     rows: torch.Tensor | None = None) -> dict:
    """The forward kwargs that tell this project's attention kernels the used slots of a preallocated buffer and
    (matmul kernel) the leading rows of the batch in use (empty when `model` dispatches attention elsewhere; a
    None entry is left out)."""
    implementation = model.config._attn_implementation
    kwargs = {}
    if kv_length is not None and implementation in (NAME, KERNEL_NAME, PREFILL_NAME):
        kwargs["drafthead_kv_length"] = torch.as_tensor(kv_length)
    if rows is not None and implementation in (NAME, KERNEL_NAME):
        kwargs["drafthead_rows"] = rows
    return kwargs


def prefers_matmul_attention(device: torch.device, dtype: torch.dtype, compiled: bool = False) -> bool:
    """True where matmul attention beats SDPA for short query blocks: CPU in bf16/fp16, and CPU in any dtype inside
    compiled steps, where short blocks are traced and fused (eager fp32 SDPA is as fast as the matmuls;
    docs/results/HISTORY.md)."""
    return device.type == "cpu" and (compiled or dtype in (torch.bfloat16, torch.float16))


def decoding_attention(device: torch.device, dtype: torch.dtype, compiled: bool = False) -> str | None:
    """The attention the static runner's decoding steps dispatch to: the C++ kernel for its dtype where the CPU has one
    (kernel_op), the matmul kernel where prefers_matmul_attention, else None (the model's own)."""
    if device.type == "cpu" and kernel_op(dtype) is not None:
        return KERNEL_NAME
    return NAME if prefers_matmul_attention(device, dtype, compiled) else None


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
