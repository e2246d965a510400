"""Builds and loads this project's CPU kernels: the AVX512-BF16 library `drafthead_kernels` (small_gemm.cpp,
prefix_attention.cpp, gguf_linear_bf16.cpp: bf16) and the AVX2 library `drafthead_avx2` (small_gemm_avx2.cpp,
prefix_attention_avx2.cpp: float32). Each is compiled on first use (cached in torch's extension folder, one folder
per digest of its sources, headers and flags) only where the CPU has its instructions, under an OS file lock: a
process that waits longer than DRAFTHEAD_KERNEL_BUILD_TIMEOUT seconds (default 600) for another's build goes on
without the kernels, saying so.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import sys
import time
from pathlib import Path

import torch

from drafthead.hardware import cpu_flags

HERE = Path(__file__).parent
SOURCES = [HERE / "small_gemm.cpp", HERE / "prefix_attention.cpp", HERE / "gguf_linear_bf16.cpp"]
BLOCK = 32  # output columns per packed weight block (small_gemm.cpp)
AVX2_SOURCES = [HERE / "small_gemm_avx2.cpp", HERE / "prefix_attention_avx2.cpp"]
FLOAT_BLOCK = 16  # output columns per packed float32 weight block (small_gemm_avx2.cpp)


@contextlib.contextmanager
def build_lock(folder: Path, timeout: float):
    """An exclusive OS lock on `folder` (released by the kernel when its holder dies, however it dies); raises
    TimeoutError after `timeout` seconds of waiting."""
    with open(folder / "build.flock", "w") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building in {folder} for over {timeout:.0f} s")
                time.sleep(0.2)
        yield  # closing the file releases the lock


def _cflags(flags: list[str]) -> list[str]:
    # -fopenmp: at::parallel_for runs serially unless the extension itself is built with OpenMP
    return ["-O3", *flags, "-fopenmp"]


def build_folder(name: str, paths: list[Path], flags: list[str]) -> Path:
    """The build folder of extension `name` in torch's extension folder: one per digest of these sources, the headers
    beside them, these flags, torch's version and the sources' folder (torch's build file names sources by path)."""
    from torch.utils.cpp_extension import _get_build_directory

    digest = hashlib.sha256(repr((_cflags(flags), torch.__version__, str(paths[0].parent.resolve()))).encode())
    digest_files(digest, sorted(paths) + sorted(paths[0].parent.glob("*.h")))
    return Path(_get_build_directory(f"{name}-{digest.hexdigest()[:12]}", verbose=False))


def digest_files(digest, paths: list[Path]) -> None:  # each file's name and bytes
    for path in paths:
        digest.update(path.name.encode() + path.read_bytes())


def _build(name: str, paths: list[Path], flags: list[str], what: str, timeout: float | None = None) -> bool:
    """Compile and load one extension of C++ sources (headers beside them included); False (with a note) where
    that fails or waits past `timeout` seconds (default: DRAFTHEAD_KERNEL_BUILD_TIMEOUT)."""
    from torch.utils.cpp_extension import load

    folder = build_folder(name, paths, flags)
    built = folder / "built"  # written after a finished build: the folder's digest names its sources and flags
    try:
        timeout = float(os.environ.get("DRAFTHEAD_KERNEL_BUILD_TIMEOUT", 600)) if timeout is None else timeout
        with build_lock(folder, timeout):
            if built.exists():  # not through torch's ninja, which rebuilds when another ninja (a venv's) ran last
                try:
                    torch.ops.load_library(str(folder / f"{name}.so"))
                    return True
                except OSError:  # the library was removed or damaged since: build it again
                    built.unlink()
            if not (folder / f"{name}.so").exists():  # this process builds them (another's build is waited for)
                print(f"[drafthead] building the {what} C++ kernels for this CPU (once; a minute or two)",
                      file=sys.stderr, flush=True)
            # torch's own lock file, left behind only by a build that was killed: under our lock nobody else builds
            (folder / "lock").unlink(missing_ok=True)
            load(name=name, sources=[str(p) for p in paths], extra_cflags=_cflags(flags), extra_ldflags=["-fopenmp"],
                 build_directory=str(folder), is_python_module=False, verbose=False)
            built.touch()
    except Exception as error:  # no compiler, one without these instructions, or a build that never ends
        reason = str(error).strip().splitlines()[-1][:200]
        print(f"[drafthead] {what} kernels not used (building {', '.join(p.name for p in paths)} failed: {reason})",
              file=sys.stderr)
        return False
    return True


def _load(name: str, paths: list[Path], flags: list[str], what: str, namespace: str, block: int) -> bool:
    """_build, then register the output shapes of library `namespace`'s ops for torch.compile's tracing."""
    if not _build(name, paths, flags, what):
        return False

    def linear(x, packed, *args, columns: int, **kwargs):  # `columns` outputs a packed weight row
        return x.new_empty(*x.shape[:-1], packed.shape[0] * columns)

    # (a GGUF target's blocks are 16 columns wide in both libraries: gguf_weights.py)
    for op, columns in (("small_linear", block), ("small_linear_int8", block), ("small_linear_q", FLOAT_BLOCK)):
        torch.library.register_fake(f"{namespace}::{op}", functools.partial(linear, columns=columns))

    @torch.library.register_fake(f"{namespace}::prefix_attention")
    def _(query, key, value, mask, scaling, length, rows):
        return query.new_empty(query.transpose(1, 2).shape)  # (B, n, heads, D)

    return True


@functools.cache
def kernels_available() -> bool:
    """True once the bf16 kernels are built and loaded (on the first call, where the CPU has AVX512-BF16)."""
    if "avx512_bf16" not in cpu_flags():  # (every CPU with AVX512-BF16 also has AVX512-VNNI, used for int8)
        return False
    flags = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni"]
    if "amx_bf16" in cpu_flags():  # small_linear multiplies with AMX tiles (small_gemm.cpp)
        flags += ["-mamx-tile", "-mamx-bf16"]
    return _load("drafthead_cpu_kernels", SOURCES, flags, "AVX512-BF16", "drafthead_kernels", BLOCK)


@functools.cache
def avx2_kernels_available() -> bool:
    """True once the float32 kernels are built and loaded (on the first call, where the CPU has AVX2 and FMA)."""
    if "avx2" not in cpu_flags():  # (every x86 CPU with AVX2 has FMA too: Haswell, Zen)
        return False
    flags = ["-mavx2", "-mfma"] + (["-mavx512f"] if "avx512f" in cpu_flags() else [])  # 16 rows a pass, not 4
    return _load("drafthead_avx2_kernels", AVX2_SOURCES, flags, "AVX2", "drafthead_avx2", FLOAT_BLOCK)
