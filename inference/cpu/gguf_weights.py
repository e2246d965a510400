"""A GGUF target's own quantized weights (Q8_0, Q4_1) in the decoding steps, lossless against its dequantized model.

transformers loads a GGUF file as a float32 model of dequantized weights. `use_gguf_weights(model, path)` gives each
linear whose weight a Q8_0 / Q4_1 tensor of the file dequantizes to exactly (rows matched, so llama.cpp's q/k order
is found) a packed copy of those blocks; small_gemm_avx2.cpp's small_linear_q multiplies with them bit-identically
to the float32 kernel, streaming a quarter or less of the bytes. Prefill (many rows) keeps the float32 weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from .kernels import FLOAT_BLOCK, avx2_kernels_available

GROUP = 32  # weights per GGUF block (Q8_0 and Q4_1)


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, K/32 · 34) Q8_0 bytes -> (q int8 (N/16, K, 16), d float32 (N/16, K/32, 16)) in small_linear_q's layout."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 34)
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, G)
    q = b[..., 2:].copy().view(np.int8).reshape(n, -1)  # (N, K)
    return (np.ascontiguousarray(q.reshape(n // FLOAT_BLOCK, FLOAT_BLOCK, -1).transpose(0, 2, 1)),
            np.ascontiguousarray(d.reshape(n // FLOAT_BLOCK, FLOAT_BLOCK, -1).transpose(0, 2, 1)))


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, K/32 · 20) Q4_1 bytes -> (nibbles uint8 (N/16, K/2, 16): k = 2p in byte [p, c]'s low nibble and 2p + 1 in
    its high one, d and m float32 (N/16, K/32, 2, 16))."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 4:]  # a block's weight j < 16 in byte j's low nibble, weight 16 + j in its high one (gguf)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)  # (N, K) values 0..15
    q = q.reshape(n // FLOAT_BLOCK, FLOAT_BLOCK, -1).transpose(0, 2, 1)  # (N/16, K, 16)
    nibbles = q[:, 0::2] | (q[:, 1::2] << 4)
    dm = np.stack([d, m], axis=1).reshape(n // FLOAT_BLOCK, FLOAT_BLOCK, 2, -1).transpose(0, 3, 2, 1)
    return np.ascontiguousarray(nibbles), np.ascontiguousarray(dm)


def _packers() -> dict:
    import gguf

    return {gguf.GGMLQuantizationType.Q8_0: _q8_0, gguf.GGMLQuantizationType.Q4_1: _q4_1}


def pack_gguf_tensor(qtype, blocks: np.ndarray, rows: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """small_linear_q's (packed, params) of a Q8_0 / Q4_1 tensor's (N, bytes) blocks, its rows reordered by `rows`
    (row i of the result = row rows[i] of the file) when given."""
    if rows is not None:
        blocks = blocks[rows]
    packed, params = _packers()[qtype](np.ascontiguousarray(blocks))
    return torch.from_numpy(packed), torch.from_numpy(params)


def eligible(module: nn.Module) -> bool:
    """A float32 CPU linear small_linear_q can take: out_features a multiple of 16, in_features of 32."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and module.out_features % FLOAT_BLOCK == 0 and module.in_features % GROUP == 0)


@torch.no_grad()
def use_gguf_weights(model: nn.Module, path: str | Path) -> int:
    """Attach to each eligible linear of `model` (loaded from the GGUF file at `path`) the packed Q8_0 / Q4_1 blocks
    its weight is the exact dequantization of, as buffers `qpacked` and `qparams`. Returns how many linears have
    them; 0 on a CPU without AVX2 (nothing changes there)."""
    import gguf

    if not avx2_kernels_available():
        return 0
    linears = [m for m in model.modules() if eligible(m)]
    if not linears:
        return 0
    wanted: dict[tuple, list[nn.Linear]] = {}
    for module in linears:
        wanted.setdefault(tuple(module.weight.shape), []).append(module)
    packers = _packers()
    attached = 0
    for tensor in gguf.GGUFReader(str(path)).tensors:
        candidates = wanted.get(tuple(int(n) for n in reversed(tensor.shape)), [])  # GGUF shapes run (K, N)
        if tensor.tensor_type not in packers or not candidates:
            continue
        blocks = np.asarray(tensor.data)
        values = gguf.quants.dequantize(blocks, tensor.tensor_type)  # (N, K) float32, as transformers loaded it
        where: dict[bytes, int] = {}
        for i, row in enumerate(values):
            where.setdefault(row.tobytes(), i)
        for module in candidates:
            if module.weight[0].numpy().tobytes() not in where:  # another tensor of this shape (most are)
                continue
            rows = [where.get(row.tobytes()) for row in module.weight.numpy()]
            if any(r is None for r in rows):  # not this tensor's weights (or not an exact dequantization)
                continue
            packed, params = pack_gguf_tensor(tensor.tensor_type, blocks, np.array(rows))
            module.register_buffer("qpacked", packed, persistent=False)
            module.register_buffer("qparams", params, persistent=False)
            attached += 1
    return attached


def has_gguf_weights(model: nn.Module) -> bool:
    return any(getattr(m, "qpacked", None) is not None for m in model.modules())
