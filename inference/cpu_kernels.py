"""Builds and loads this project's AVX512-BF16 CPU kernels (one extension, the `drafthead_kernels` op library):
small_gemm.cpp (bf16 linears of a few rows, used by small_gemm.py) and prefix_attention.cpp (attention of a few
queries over the used prefix of a KV buffer, used by attention.py).

They are compiled on first use with the C++ compiler PyTorch's own CPU compilation needs (~40 s, cached in torch's
extension folder), only where the CPU has AVX512-BF16 (its `vdpbf16ps`); elsewhere nothing changes.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from drafthead.hardware import cpu_flags

SOURCES = ("small_gemm.cpp", "prefix_attention.cpp")
BLOCK = 32  # output columns per packed weight block (small_gemm.cpp)


@functools.cache
def kernels_available() -> bool:
    """True once the kernels are built and loaded; builds them on the first call where the CPU has AVX512-BF16."""
    if "avx512_bf16" not in cpu_flags():  # (every CPU with AVX512-BF16 also has AVX512-VNNI, used for int8)
        return False
    from torch.utils.cpp_extension import load

    sources = [str(Path(__file__).with_name(name)) for name in SOURCES]
    # -fopenmp: at::parallel_for is a header template that runs serially unless the extension itself is built
    # with OpenMP
    flags = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-fopenmp"]
    try:
        load(name="drafthead_cpu_kernels", sources=sources, extra_cflags=flags, extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
    except Exception as error:  # no compiler, or one without AVX512-BF16: PyTorch's own ops stay in use
        reason = str(error).strip().splitlines()[-1][:200]
        print(f"[drafthead] AVX512-BF16 kernels not used (building {', '.join(SOURCES)} failed: {reason})",
              file=sys.stderr)
        return False

    @torch.library.register_fake("drafthead_kernels::small_linear")
    def _(x, packed, bias):
        return x.new_empty(*x.shape[:-1], packed.shape[0] * BLOCK)

    @torch.library.register_fake("drafthead_kernels::small_linear_int8")
    def _(x, packed, columns, bias):
        return x.new_empty(*x.shape[:-1], packed.shape[0] * BLOCK)

    @torch.library.register_fake("drafthead_kernels::prefix_attention")
    def _(query, key, value, mask, scaling, length, rows):
        b, heads, n, d = query.shape
        return query.new_empty(b, n, heads, d)

    return True
