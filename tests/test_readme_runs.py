"""The README's runnable code blocks run as written, and a user's own target goes through the whole pipeline.

A fenced block whose line before is `<!-- runnable -->` (an HTML comment, invisible on GitHub) is run by this test:
`bash` blocks with `bash -e -o pipefail`, `python` blocks with the project's Python, all of them in README order in
one scratch folder that links `configs/` to the repository's, so that a block sees what earlier blocks made. Blocks
that need GPUs, a network or long runs stay unmarked. The only edits are the placeholders a user replaces with
their own paths, given stand-ins made here: `/models/my-model` and `/path/to/your-target-model` -> a tiny random
Qwen2 target folder with a ChatML chat template (tests/tiny.py), `/data/chats.jsonl` -> 48 short conversations.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, save_tiny_target

README = REPO / "README.md"
MARKER = "<!-- runnable -->"
RUNNABLE = re.compile(r"^" + re.escape(MARKER) + r"[ \t]*\n```(\w+)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
RUNNERS = {"bash": ["bash", "-e", "-o", "pipefail", "-c"], "python": [sys.executable, "-c"]}
WORDS = "hello world the quick brown fox jumps over the lazy dog".split()


def runnable_blocks() -> list[tuple[str, str]]:
    """(language, body) of every block marked runnable, in README order."""
    return RUNNABLE.findall(README.read_text(encoding="utf-8"))


def write_conversations(path: Path, count: int = 48) -> Path:
    """`count` one-turn conversations in the OpenAI form, in words the tiny tokenizer knows."""
    rng = random.Random(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    rows = [{"id": f"chat-{i}", "messages": [{"role": "user", "content": text(8)},
                                              {"role": "assistant", "content": text(24)}]} for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_every_runnable_marker_is_followed_by_a_block_this_test_runs():
    text = README.read_text(encoding="utf-8")
    blocks = runnable_blocks()
    markers = re.findall(r"^" + re.escape(MARKER), text, re.M)
    assert len(blocks) == len(markers) >= 1, f"a {MARKER} line not right before a fenced block"
    assert all(lang in RUNNERS for lang, _ in blocks), [lang for lang, _ in blocks]


def test_the_runnable_blocks_take_a_users_own_target_through_the_whole_pipeline():
    """Acceptance: prepare -> collect -> train -> export -> generate on one's own target and data, from the
    README's commands with `target=` and `data.conversations=` overrides."""
    shell = "\n".join(body for lang, body in runnable_blocks() if lang == "bash")
    for step in ("-m train.prepare", "-m train.collect", "-m train ", "-m drafthead.export", "-m inference.generate",
                 "target=/models/my-model", "data.conversations=/data/chats.jsonl"):
        assert step in shell, f"no runnable README block has {step!r}"


@pytest.mark.slow
def test_runnable_blocks_of_the_readme_run_as_written(tmp_path):
    target = save_tiny_target(tmp_path / "my-model", "qwen2")
    stand_ins = {"/models/my-model": str(target), "/path/to/your-target-model": str(target),
                 "/data/chats.jsonl": str(write_conversations(tmp_path / "chats.jsonl"))}
    work = tmp_path / "clone"
    work.mkdir()
    (work / "configs").symlink_to(REPO / "configs")
    # a cache of its own: generate's tree tuning of the tiny model is cached there, not in the user's cache
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "DRAFTHEAD_CACHE": str(tmp_path / "cache"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    outputs = []
    for lang, body in runnable_blocks():
        for placeholder, path in stand_ins.items():
            body = body.replace(placeholder, path)
        proc = subprocess.run([*RUNNERS[lang], body], cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"README block failed:\n{body}\n--- stdout\n{proc.stdout[-3000:]}\n" \
                                     f"--- stderr\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout + proc.stderr)
    log = "\n".join(outputs)
    export = work / "runs" / "your-model-eagle3" / "export"
    assert json.loads((export / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert f"target: {target}" in log  # --print-config showed the override
    assert re.search(r"\[collect\] device=cpu dtype=\w+ target=", log)  # device auto, printed
    assert "tau" in log.lower()  # generate decoded with the new head and said how well it drafted
