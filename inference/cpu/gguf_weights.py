"""A GGUF target's own quantized weights (Q8_0, Q6_K, Q5_0, Q4_0, Q4_1, Q4_K) in decoding steps, lossless.

transformers loads a GGUF file as a model of dequantized weights. `use_gguf_weights(model, path)` gives each
linear whose weight a tensor of the file in one of these formats dequantizes to exactly (rows matched: llama.cpp's q/k
order is found) a repacked copy of its blocks; small_gemm_avx2.cpp's small_linear_q multiplies with them bit-identically
to the float32 kernel, streaming a quarter or less of the bytes. A bf16 model's linears (rounded weights) get the same
blocks, which gguf_linear_bf16.cpp multiplies by bf16 activations as the exact dequantized weights. Prefill (many
rows) keeps the model's own weights.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from .kernels import FLOAT_BLOCK, avx2_kernels_available, kernels_available
from .small_gemm import back_to_back, sibling_groups

GROUP = 32  # weights per scale (and minimum) in every format packed here but Q6_K (16, within 256-weight blocks)


def _half(b: np.ndarray) -> np.ndarray:
    """(..., 2) bytes of float16 values -> (...) float32."""
    return b.copy().view(np.float16)[..., 0].astype(np.float32)


def _low_high(qs: np.ndarray) -> np.ndarray:
    """(..., n) bytes -> (..., 2n) 4-bit values: weight j < n in byte j's low nibble, n + j in its high one (gguf)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _column_blocks(a: np.ndarray) -> np.ndarray:
    """(N, M) per output row -> (N/16, M, 16): the kernel's blocks of 16 output columns, column index last."""
    return a.reshape(a.shape[0] // FLOAT_BLOCK, FLOAT_BLOCK, -1).transpose(0, 2, 1)


def _q8(q: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q (N, K) int8, d (N, K/G) float32 (w = q · d, G = 32 or 16) -> small_linear_q's 8-bit layout."""
    return np.ascontiguousarray(_column_blocks(q)), np.ascontiguousarray(_column_blocks(d))


def _q4(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q (N, K) values 0..15, d and m (N, K/32) float32 (w = q · d + m) -> (nibbles uint8 (N/16, K/2, 16): k = 2p in
    byte [p, c]'s low nibble, 2p + 1 in its high one; d and m (N/16, K/32, 2, 16)) in small_linear_q's 4-bit layout."""
    n = q.shape[0]
    q = _column_blocks(q)  # (N/16, K, 16)
    dm = np.stack([d, m], axis=1).reshape(n // FLOAT_BLOCK, FLOAT_BLOCK, 2, -1).transpose(0, 3, 2, 1)
    return np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4)), np.ascontiguousarray(dm)


# Each format below dequantizes (as gguf's numpy code does) to products that are exact in float32: a half scale (11
# significant bits; Q6_K: times an int8) times a value of at most 6 bits. So w = q · d, or q · d + m rounded once, is
# what the kernel's 8-bit (q · d) or 4-bit (fused q · d + m) layout computes from the repacked values, bit for bit.

def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, K/32 · 34) Q8_0 bytes: per 32 weights a half d, then int8 q; w = d · q."""
    b = blocks.reshape(len(blocks), -1, 34)
    return _q8(b[..., 2:].copy().view(np.int8).reshape(len(blocks), -1), _half(b[..., :2]))


def _q5_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, K/32 · 22) Q5_0 bytes: per 32 weights a half d, the 32 high bits, then the low nibbles; w = d · (q - 16)."""
    b = blocks.reshape(len(blocks), -1, 22)
    high = (b[..., 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1  # bit j: weight j
    q = (_low_high(b[..., 6:]) | (high.astype(np.uint8) << 4)).astype(np.int8) - 16
    return _q8(q.reshape(len(blocks), -1), _half(b[..., :2]))


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, K/32 · 18) Q4_0 bytes: per 32 weights a half d, then 4-bit q; w = d · (q - 8) = d · q + (-8 d)."""
    b = blocks.reshape(len(blocks), -1, 18)
    d = _half(b[..., :2])
    return _q4(_low_high(b[..., 2:]).reshape(len(blocks), -1), d, -8 * d)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, K/32 · 20) Q4_1 bytes: per 32 weights a half d and m, then 4-bit q; w = d · q + m."""
    b = blocks.reshape(len(blocks), -1, 20)
    return _q4(_low_high(b[..., 4:]).reshape(len(blocks), -1), _half(b[..., 0:2]), _half(b[..., 2:4]))


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, K/256 · 144) Q4_K bytes: per 256 weights a half d and dmin, a 6-bit scale and minimum for each 32, then
    4-bit q; w = (d · scale) · q - dmin · minimum: the 4-bit layout with d · scale and -dmin · minimum (exact)."""
    import gguf

    n = blocks.shape[0]
    b = blocks.reshape(-1, 144)  # (S, 144): the super-blocks, row by row
    d, dmin = _half(b[:, 0:2])[:, None], _half(b[:, 2:4])[:, None]
    scale, minimum = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])  # (S, 8) each
    q = _low_high(b[:, 16:].reshape(-1, 4, 32))  # 32 bytes a pair of sub-blocks
    return _q4(q.reshape(n, -1), (d * scale).reshape(n, -1), -(dmin * minimum).reshape(n, -1))


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, K/256 · 210) Q6_K bytes: per 256 weights the low nibbles, the high 2-bit pairs, an int8 scale for each 16,
    then a half d; w = (d · scale) · (q - 32): int8 q - 32 in the 8-bit layout with a scale per 16 weights (d · scale
    has at most 18 significant bits, times q - 32 at most 23: exact)."""
    n = blocks.shape[0]
    b = blocks.reshape(-1, 210)  # (S, 210): the super-blocks, row by row
    low = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[:, None]  # per 128 weights: 64 bytes
    high = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]  # ... and 32
    q = ((low & 0x0F).reshape(-1, 2, 4, 32) | ((high & 0x03) << 4)).astype(np.int8) - 32
    scale = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    return _q8(q.reshape(n, -1), (_half(b[:, 208:210])[:, None] * scale).reshape(n, -1))


@functools.cache
def _packers() -> dict:
    import gguf

    kinds = gguf.GGMLQuantizationType
    return {kinds.Q8_0: _q8_0, kinds.Q5_0: _q5_0, kinds.Q4_0: _q4_0, kinds.Q4_1: _q4_1, kinds.Q4_K: _q4_k,
            kinds.Q6_K: _q6_k}


def pack_gguf_tensor(qtype, blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """small_linear_q's (packed, params) of a tensor's (N, bytes) blocks (a format of _packers()); the float32 params
    as their int32 bits, which a model's .to(bfloat16) leaves alone."""
    packed, params = _packers()[qtype](np.ascontiguousarray(blocks))
    return torch.from_numpy(packed), torch.from_numpy(params.view(np.int32))


def eligible(module: nn.Module) -> bool:
    """A CPU linear a small_linear_q takes: float32 with AVX2 or bf16 with AVX512-BF16 (gguf_linear_bf16.cpp),
    out_features a multiple of 16, in_features of 32."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) and weight.device.type == "cpu"
            and (weight.dtype == torch.float32 and avx2_kernels_available()
                 or weight.dtype == torch.bfloat16 and kernels_available())
            and module.out_features % FLOAT_BLOCK == 0 and module.in_features % GROUP == 0)


@torch.inference_mode(False)  # as small_gemm.use_small_row_kernel's copies
@torch.no_grad()
def use_gguf_weights(model: nn.Module, path: str | Path) -> int:
    """Attach to each eligible linear of `model` (loaded from the GGUF file at `path`) the repacked blocks its weight
    is the exact dequantization of (in a bf16 model: rounded to bf16), as buffers `qpacked` and `qparams`. Returns
    how many have them (0 where no kernel takes the model's dtype)."""
    import gguf

    from drafthead.export_gguf import read_gguf

    linears = [m for m in model.modules() if eligible(m)]
    if not linears:
        return 0
    wanted: dict[tuple, list[nn.Linear]] = {}
    for module in linears:
        wanted.setdefault(tuple(module.weight.shape), []).append(module)
    for shape, kind, raw in read_gguf(path)[1].values():
        qtype = gguf.GGMLQuantizationType[kind]
        candidates = wanted.get(tuple(reversed(shape)), [])  # GGUF shapes run (K, N)
        if qtype not in _packers() or not candidates:
            continue
        blocks = np.frombuffer(raw, dtype=np.uint8).reshape(shape[1], -1)  # (N, K / block · bytes per block)
        values = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))  # (N, K) float32, as transformers loaded it
        # each row's bytes in the model's dtype -> its index (reversed: the first one wins)
        where = {row: i for i, row in reversed(list(enumerate(_row_bytes(values.to(candidates[0].weight.dtype)))))}
        for module in list(candidates):
            if _row_bytes(module.weight[:1].detach())[0] not in where:  # another tensor of this shape (most are)
                continue
            rows = [where.get(row) for row in _row_bytes(module.weight.detach())]
            if any(r is None for r in rows):  # not this tensor's weights (or not an exact dequantization)
                continue
            packed, params = pack_gguf_tensor(qtype, blocks[rows])  # row i: row rows[i] of the file
            module.register_buffer("qpacked", packed, persistent=False)
            module.register_buffer("qparams", params, persistent=False)
            candidates.remove(module)  # matched: later tensors of this shape are not dequantized for it
    for group in sibling_groups(model, [m for m in linears if getattr(m, "qpacked", None) is not None]):
        if len({(m.qpacked.dtype, m.qpacked.shape[1:], m.qparams.shape[1:]) for m in group}) == 1:  # one format:
            for name in ("qpacked", "qparams"):  # one call for them all (FuseSiblingLinears)
                for m, part in zip(group, back_to_back([getattr(m, name) for m in group])):
                    m.register_buffer(name, part, persistent=False)
    return len(linears) - sum(map(len, wanted.values()))  # the linears matched (each left `wanted` once)


def _row_bytes(weight: torch.Tensor) -> list[bytes]:  # (numpy has no bf16: its bits as int16)
    bits = weight.contiguous().view(torch.int16 if weight.dtype == torch.bfloat16 else weight.dtype)
    return [row.tobytes() for row in bits.numpy()]


def has_gguf_weights(model: nn.Module) -> bool:
    return any(getattr(m, "qpacked", None) is not None for m in model.modules())
