"""Recipes: one YAML file per job, `${VAR}` interpolation, and `key.sub=value` command-line overrides."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_.]*)\}")


def default_cache() -> str:
    return os.environ.get("DRAFTHEAD_CACHE", str(Path.home() / ".cache" / "drafthead"))


def _lookup(recipe: dict, dotted: str) -> Any:
    node: Any = recipe
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def set_dotted(recipe: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = recipe
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {part!r} is not a section")
    node[parts[-1]] = value


def _interpolate(value: Any, recipe: dict, depth: int = 0) -> Any:
    if isinstance(value, dict):
        return {k: _interpolate(v, recipe, depth) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, recipe, depth) for v in value]
    if not isinstance(value, str) or depth > 10:
        return value

    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name == "DRAFTHEAD_CACHE":
            return default_cache()
        if name in os.environ:
            return os.environ[name]
        try:
            return str(_interpolate(_lookup(recipe, name), recipe, depth + 1))
        except KeyError:
            raise ValueError(f"recipe refers to ${{{name}}}, which is neither a recipe key nor an environment variable")

    return _REF.sub(replace, value)


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else None
        if isinstance(value, str) and any(c.isdigit() for c in value):  # YAML 1.1 reads "1e-3" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        parsed.append((key.strip(), value))
    return parsed


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> dict:
    """Load a YAML recipe, apply `a.b=value` overrides (values parsed as YAML), then resolve `${...}`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"recipe {path} not found")
    recipe = yaml.safe_load(path.read_text()) or {}
    for key, value in parse_overrides(overrides or []):
        set_dotted(recipe, key, value)
    return _interpolate(recipe, recipe)


def recipe_main(job, doc: str, argv: list[str] | None = None) -> None:
    """Command-line entry of every recipe job: `python -m train.<job> RECIPE [key=value ...]`."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(doc)
        raise SystemExit(0 if argv else 2)
    job(load_recipe(argv[0], argv[1:]))
