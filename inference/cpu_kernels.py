"""Builds and loads this project's CPU kernels: the AVX512-BF16 extension (the `drafthead_kernels` op library):
small_gemm.cpp (bf16 linears of a few rows, used by small_gemm.py) and prefix_attention.cpp (attention of a few
queries over the used prefix of a KV buffer, used by attention.py); and the AVX2 one (`drafthead_avx2`), their
float32 counterparts for CPUs where float32 is the fast dtype: small_gemm_avx2.cpp and prefix_attention_avx2.cpp.

They are compiled on first use with the C++ compiler PyTorch's own CPU compilation needs (~40 s, cached in torch's
extension folder), only where the CPU has the instructions (AVX512-BF16's `vdpbf16ps`; AVX2 and FMA); elsewhere
nothing changes.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from pathlib import Path

import torch

from drafthead.hardware import cpu_flags

SOURCES = ("small_gemm.cpp", "prefix_attention.cpp")
BLOCK = 32  # output columns per packed weight block (small_gemm.cpp)
AVX2_SOURCES = ("small_gemm_avx2.cpp", "prefix_attention_avx2.cpp")
FLOAT_BLOCK = 16  # output columns per packed float32 weight block (small_gemm_avx2.cpp)


def _build(name: str, sources: tuple[str, ...], flags: list[str], what: str) -> bool:
    """Compile and load one extension of this folder's C++ sources; False (with a note) where that fails."""
    from torch.utils.cpp_extension import load

    paths = [str(Path(__file__).with_name(source)) for source in sources]
    # torch rebuilds an extension when its sources or flags change, not its headers: their digest is a flag
    headers = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.h"))))
    try:
        # -fopenmp: at::parallel_for is a header template that runs serially unless the extension itself is built
        # with OpenMP
        cflags = ["-O3", *flags, "-fopenmp", f"-DHEADERS={headers.hexdigest()[:16]}"]
        load(name=name, sources=paths, extra_cflags=cflags, extra_ldflags=["-fopenmp"], is_python_module=False,
             verbose=False)
    except Exception as error:  # no compiler, or one without these instructions: PyTorch's own ops stay in use
        reason = str(error).strip().splitlines()[-1][:200]
        print(f"[drafthead] {what} kernels not used (building {', '.join(sources)} failed: {reason})",
              file=sys.stderr)
        return False
    return True


@functools.cache
def kernels_available() -> bool:
    """True once the kernels are built and loaded; builds them on the first call where the CPU has AVX512-BF16."""
    if "avx512_bf16" not in cpu_flags():  # (every CPU with AVX512-BF16 also has AVX512-VNNI, used for int8)
        return False
    flags = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni"]
    if not _build("drafthead_cpu_kernels", SOURCES, flags, "AVX512-BF16"):
        return False

    @torch.library.register_fake("drafthead_kernels::small_linear")
    def _(x, packed, bias, live=None):
        return x.new_empty(*x.shape[:-1], packed.shape[0] * BLOCK)

    @torch.library.register_fake("drafthead_kernels::small_linear_int8")
    def _(x, packed, columns, bias, live=None):
        return x.new_empty(*x.shape[:-1], packed.shape[0] * BLOCK)

    @torch.library.register_fake("drafthead_kernels::prefix_attention")
    def _(query, key, value, mask, scaling, length, rows):
        b, heads, n, d = query.shape
        return query.new_empty(b, n, heads, d)

    return True


@functools.cache
def avx2_kernels_available() -> bool:
    """True once the float32 AVX2 kernels are built and loaded; builds them on the first call where the CPU has
    AVX2 and FMA."""
    if "avx2" not in cpu_flags():  # (every x86 CPU with AVX2 has FMA too: Haswell, Zen)
        return False
    if not _build("drafthead_avx2_kernels", AVX2_SOURCES, ["-mavx2", "-mfma"], "AVX2"):
        return False

    @torch.library.register_fake("drafthead_avx2::small_linear")
    def _(x, packed, bias, live=None):
        return x.new_empty(*x.shape[:-1], packed.shape[0] * FLOAT_BLOCK)

    @torch.library.register_fake("drafthead_avx2::small_linear_int8")
    def _(x, packed, columns, bias, live=None):
        return x.new_empty(*x.shape[:-1], packed.shape[0] * FLOAT_BLOCK)

    @torch.library.register_fake("drafthead_avx2::prefix_attention")
    def _(query, key, value, mask, scaling, length, rows):
        b, heads, n, d = query.shape
        return query.new_empty(b, n, heads, d)

    return True
