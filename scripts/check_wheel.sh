#!/usr/bin/env bash
# The package as a user installs it: a clean copy of the committed tree (git archive HEAD), `pip install .` into a
# fresh venv outside the repository, then the CPU-kernel tests run against the installed copy, its kernels built
# from the wheel's own sources and header in a fresh extension folder.
#   scripts/check_wheel.sh            (a few minutes: venv, install, one kernel build, the tests)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/src"
git -C "$repo" archive HEAD | tar -x -C "$work/src"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q torch==2.13.0
(cd "$work/src" && "$work/venv/bin/pip" install -q ".[dev]")
rm -rf "$work/src/drafthead" "$work/src/inference" "$work/src/train"  # only the installed copy is left to import
cd "$work"
export TORCH_EXTENSIONS_DIR="$work/extensions" HF_HUB_OFFLINE=1 DRAFTHEAD_CACHE="${DRAFTHEAD_CACHE:-$HOME/.cache/drafthead}"
"$work/venv/bin/python" - <<'PY'
import inference, inference.cpu.kernels as k
from pathlib import Path
print("installed:", Path(inference.__file__).parent)
assert "site-packages" in inference.__file__, inference.__file__
assert {p.name for p in Path(k.__file__).parent.glob("*.h")} >= {"small_linear.h", "spans.h"}, "the kernels' headers are missing from the wheel"
print("AVX512-BF16 kernels:", k.kernels_available(), "| AVX2 kernels:", k.avx2_kernels_available())
PY
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider "$work/src/tests/test_small_gemm_avx2.py" \
    "$work/src/tests/test_prefix_attention.py" "$work/src/tests/test_small_gemm.py" "$work/src/tests/test_gguf_weights.py"
