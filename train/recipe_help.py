"""The command line of every recipe job (recipe_main) and its `--help`: the command's own description, then
every recipe key with its type, allowed values, default and comment, read from the typed sections of
train/recipe.py (so the list cannot drift from the code)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from typing import Any

import yaml

from drafthead.errors import RecipeError, run_main
from train.recipe import Recipe, allowed_values, load_recipe

USAGE = ("usage: python -m {module} RECIPE [key=value ...] [--print-config] [--debug]\n"
         "  RECIPE          a YAML recipe (configs/your-model-eagle3.yaml is a commented template)\n"
         "  key=value       override any key below by its dotted path, e.g. target=/models/my-model train.lr=3e-4\n"
         "  --print-config  print the resolved recipe (overrides applied, ${{...}} filled in) and exit\n"
         "  --debug         show the traceback of an error")
_FIELD = re.compile(r"^\s+([a-z_][a-z0-9_]*)\s*:")


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the class source: the comment lines just above it and the one at its line's end."""
    comments: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        match = _FIELD.match(line)
        if match and "  # " in line:
            above.append(line.split("  # ", 1)[1].strip())
        if match:
            comments[match.group(1)] = "; ".join(above)
        above = []
    return comments


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()  # type: ignore[misc]


def _format(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def recipe_keys(cls: type = Recipe, where: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, allowed values, default, comment) of every key of `cls`, sections recursed into."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    rows = []
    for field in dataclasses.fields(cls):
        dotted = f"{where}.{field.name}" if where else field.name
        if dataclasses.is_dataclass(hints[field.name]):
            rows += recipe_keys(hints[field.name], dotted)
        else:
            rows.append((dotted, allowed_values(hints[field.name], dict(field.metadata)),
                         _format(_default(field)), comments.get(field.name, "")))
    return rows


def command_help(doc: str, module: str | None = None) -> str:
    """A recipe command's help: its docstring, the usage line, and the recipe keys."""
    module = module or (doc.split("-m ", 1)[1].split()[0] if "-m " in doc else "train")
    lines = [doc.strip(), "", USAGE.format(module=module), "",
             "recipe keys (key: allowed values = default; what it does). Keys a recipe leaves out take these defaults:"]
    for key, allowed, default, comment in recipe_keys():
        lines.append(f"  {key}: {allowed} = {default}")
        if comment:
            lines.append(f"      {comment}")
    return "\n".join(lines)


def recipe_main(job, doc: str, argv: list[str] | None = None) -> None:
    """Command-line entry of every recipe job: `python -m train.<job> RECIPE [key=value ...] [--print-config]
    [--debug]`. `--help` lists every recipe key with its type and default (command_help); `--print-config`
    prints the resolved recipe (overrides applied, `${...}` filled in) and exits. A user error (bad recipe, path or
    data) is printed as one line (drafthead.errors.run_main)."""

    def main(args: list[str]) -> int:
        if not args or "-h" in args or "--help" in args:
            print(command_help(doc))
            return 0 if args else 2
        show = "--print-config" in args
        args = [a for a in args if a != "--print-config"]
        if not args:
            raise RecipeError("give a recipe file: python -m train.<job> RECIPE [key=value ...]")
        recipe = load_recipe(args[0], args[1:])
        if show:
            print(yaml.safe_dump(dataclasses.asdict(recipe), sort_keys=False, width=120), end="")
            return 0
        job(recipe)
        return 0

    raise SystemExit(run_main(main, argv))
