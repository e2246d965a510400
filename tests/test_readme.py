"""The README is a manual that stays true: short, no internal paths, links that resolve, commands that exist,
recipe overrides that the recipe schema knows. Fast (one subprocess for every CLI's --help), no model loaded."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_LINES = 400
PACKAGES = ("drafthead", "train", "inference")  # the repository's own top-level packages
EXTERNAL_MODULES = {"pytest", "venv", "pip", "sglang.launch_server", "vllm",
                    "vllm.entrypoints.openai.api_server"}  # other tools' modules the README names

FENCE = re.compile(r"^```[^\n]*\n.*?^```[ \t]*$", re.S | re.M)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MODULE = re.compile(r"(?:\bpython3?|\.venv/bin/python|\baccelerate launch\b[^\n]*?)\s+-m\s+([A-Za-z_][\w.]*)")
OVERRIDE = re.compile(r"^([a-z][a-z0-9_]*(?:\.[a-z][a-z0-9_]*)*)=(?!=)")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _code_blocks(text: str, languages: tuple[str, ...] = ()) -> list[str]:
    """Bodies of the fenced code blocks (of the given languages when some are named)."""
    blocks = []
    for match in FENCE.finditer(text):
        first, _, body = match.group(0).partition("\n")
        lang = first.strip("`").strip().lower()
        if not languages or lang in languages:
            blocks.append(body.rsplit("```", 1)[0])
    return blocks


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _), spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    body = FENCE.sub("", _text(path))
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", body, re.M)}


# ------------------------------------------------------------------------------------------- (a) size, wording
def test_readme_is_short_and_has_no_internal_references():
    text = _text(README)
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES}): move detail to docs/"
    assert "../shared" not in text, "README.md points outside the repository (../shared)"
    issues = re.findall(r"\bissues? #?\d+", text, re.I)
    assert not issues, f"README.md names internal issue numbers: {issues}"
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 200]
    assert not long, f"README.md lines longer than 200 characters: {long}"


def test_docs_have_no_paths_outside_the_repository():
    for path in DOCS:
        assert "../shared" not in _text(path), f"{path.name} points outside the repository (../shared)"


# ------------------------------------------------------------------------------------------------ (b) links
@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_point_to_files_that_exist(path):
    body = FENCE.sub("", _text(path))
    broken = []
    for target in LINK.findall(body):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
        elif not dest.is_relative_to(REPO):
            broken.append(f"{target} (outside the repository)")
    assert not broken, f"{path.name}: broken relative links: {broken}"


# ------------------------------------------------------------------------------------------- (c) python -m
def _readme_modules() -> list[str]:
    return sorted(set(MODULE.findall(_text(README))))


def _module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for candidate in (base / "__main__.py", base.with_suffix(".py")):
        if candidate.exists():
            return candidate
    return None


def test_every_python_m_names_a_module_of_the_repository():
    modules = _readme_modules()
    assert "inference.generate" in modules and "train" in modules, modules
    unknown = [m for m in modules if m not in EXTERNAL_MODULES and
               (m.split(".")[0] not in PACKAGES or _module_file(m) is None)]
    assert not unknown, f"README.md runs modules that do not exist in the repository: {unknown}"


_HELP_SCRIPT = """
import contextlib, io, json, runpy, sys
codes = {}
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        codes[module] = 0
    except SystemExit as e:
        codes[module] = 0 if e.code in (0, None) else e.code
    except BaseException as e:
        codes[module] = repr(e)
    if not out.getvalue().strip():
        codes[module] = f"{codes[module]} (printed no help)"
sys.__stdout__.write("\\nHELP_CODES " + json.dumps(codes) + "\\n")
"""


def test_every_cli_of_the_readme_answers_help():
    """`--help` of every repository module the README runs exits 0 (one subprocess for all of them)."""
    modules = [m for m in _readme_modules() if m.split(".")[0] in PACKAGES]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, "-c", _HELP_SCRIPT, *modules], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    marker = [line for line in result.stdout.splitlines() if line.startswith("HELP_CODES ")]
    assert result.returncode == 0 and marker, f"help run failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    codes = json.loads(marker[-1].split(" ", 1)[1])
    assert set(codes) == set(modules)
    failed = {m: c for m, c in codes.items() if c != 0}
    assert not failed, f"`python -m MODULE --help` did not exit 0: {failed}"


# ---------------------------------------------------------------------------------------- (d) recipe keys
def _recipe_key_exists(dotted: str) -> bool:
    from train.recipe import Recipe

    cls: typing.Any = Recipe
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            return False
        hint = typing.get_type_hints(cls)[part]
        if i < len(parts) - 1:
            if not dataclasses.is_dataclass(hint):
                return False
            cls = hint
        elif dataclasses.is_dataclass(hint):
            return False  # a whole section cannot be set to a value
    return True


def _readme_overrides() -> set[str]:
    """Keys of `key=value` / `section.key=value` overrides in the README: every token of a shell line that runs a
    recipe job (`-m train...`) or builds an override list (`O="..."`, `S="..."`), and inline code spans such as
    `data.conversations=...`."""
    text = _text(README)
    keys: set[str] = set()
    for block in _code_blocks(text, ("bash", "sh", "")):
        for line in block.splitlines():
            if not (re.search(r"-m train\b", line) or re.match(r"\s*[A-Z]+=", line)):
                continue
            for token in line.split():
                token = re.sub(r'^[A-Z]+="?', "", token).strip("\"'")
                match = OVERRIDE.match(token)
                if match:
                    keys.add(match.group(1))
    prose = FENCE.sub("", text)
    for span in re.findall(r"`([^`\n]+)`", prose):
        match = OVERRIDE.match(span.strip())
        if match and "." in match.group(1):
            keys.add(match.group(1))
    return keys


def test_recipe_overrides_in_the_readme_exist_in_the_schema():
    keys = _readme_overrides()
    assert {"target", "data.conversations", "train.max_steps"} <= keys, sorted(keys)
    unknown = sorted(k for k in keys if not _recipe_key_exists(k))
    assert not unknown, f"README.md overrides recipe keys the schema does not have: {unknown}"


def test_key_check_refuses_a_misspelt_key():
    assert _recipe_key_exists("data.regenerate.batch_size")
    assert not _recipe_key_exists("train.learning_rate")
    assert not _recipe_key_exists("data")
    assert not _recipe_key_exists("train.lr.x")
