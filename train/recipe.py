"""Recipes: one YAML file per job, typed sections with their defaults, `${VAR}` interpolation, and `key.sub=value`
command-line overrides.

Every section is a dataclass below; its field defaults are THE defaults (configs/smollm2-135m-eagle3.yaml, the
default recipe, lists the same values, and a test holds them equal). A recipe file needs only the keys it
changes. A key no section knows is refused with the valid keys and the closest match; a value is checked against
its field's type and allowed values (choices, ranges) when the recipe is read, before any job starts. Defaults may
refer to other keys (`${run_dir}/features`); they are interpolated together with the file's own values.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from drafthead.errors import PathNotFound, RecipeError
from drafthead.paths import cache_dir
from drafthead.utils import DTYPES

_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_.]*)\}")


def rule(default: Any = dataclasses.MISSING, *, choices: tuple = (), low: float | None = None,
         high: float | None = None, above: float | None = None, pattern: str | None = None, means: str = "",
         factory: Any = dataclasses.MISSING) -> Any:
    """A field with allowed values: `choices`, a range (low <= v <= high, v > above; for a list, each item), or a
    regular expression a string must match (`means` says it in words). None stays allowed where the field's type
    allows it."""
    checks = {"choices": choices, "low": low, "high": high, "above": above, "pattern": pattern, "means": means}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=checks)
    return field(default=default, metadata=checks)


DTYPE_CHOICES = ("auto", *DTYPES)


# ------------------------------------------------------------------------------------------------ sections
@dataclass
class RegenerateSection:
    """data.regenerate: `python -m train.regenerate RECIPE` rewrites the assistant turns with the target."""

    output: str = "${run_dir}/regenerated.jsonl"  # then prepare with data.conversations=<this file>
    max_new_tokens: int = rule(256, low=1)  # tokens generated per assistant turn
    temperature: float = rule(0.0, low=0)  # 0 = greedy
    top_p: float = rule(1.0, above=0, high=1)
    batch_size: int = rule(32, low=1)  # conversations decoded together (rows of one forward)
    chunk_conversations: int = rule(256, low=1)  # resumable unit
    seed: int = 0  # sampling seed


@dataclass
class DataSection:
    """data: conversations -> prepared token ids + loss mask (`python -m train.prepare RECIPE`)."""

    conversations: str = "${DRAFTHEAD_CACHE}/data/sharegpt.jsonl"  # JSONL (ShareGPT / OpenAI) or a datasets folder
    prepared_dir: str = "${run_dir}/prepared"
    max_length: int = rule(1024, low=2)  # tokens kept per conversation (longer ones are cut)
    max_conversations: int | None = rule(None, low=1)  # None = all
    # cut each conversation after its N-th assistant turn (None = keep all)
    max_assistant_turns: int | None = rule(None, low=1)
    validation_fraction: float = rule(0.02, low=0, high=0.5)  # by conversation id root
    skip_bad: bool = False  # skip (and count) malformed records instead of stopping at file:line
    seed: int = 0  # seed of the train/validation split
    num_proc: int | None = rule(None, low=1)  # tokenizing worker processes; None = min(4, CPU count)
    regenerate: RegenerateSection = field(default_factory=RegenerateSection)


@dataclass
class FeaturesSection:
    """features: target hidden states written as shards (`python -m train.collect RECIPE`)."""

    dir: str = "${run_dir}/features"  # feature shards of the train split (bf16 safetensors + manifest.json)
    shard_sequences: int = rule(256, low=1)  # sequences per shard
    batch_tokens: int = rule(4096, low=1)  # padded tokens per target forward
    validation_dir: str | None = "${features.dir}/validation"  # features of the "validation" split
    splits: list[str] = field(default_factory=lambda: ["train", "validation"])  # prepared splits to collect
    # target dtype while collecting (None = the recipe's dtype)
    target_dtype: str | None = rule(None, choices=DTYPE_CHOICES)

    def split_dir(self, split: str) -> str:
        """The features folder of a prepared split: dir (train), validation_dir, else dir/<split>."""
        if split == "train":
            return self.dir
        if split == "validation" and self.validation_dir:
            return self.validation_dir
        return os.path.join(self.dir, split)


@dataclass
class HeadSection:
    """head: the draft head trained on the target."""

    kind: str = rule("eagle3", choices=("eagle3", "eagle1"))  # eagle1: EAGLE-1/2 head on the last hidden state
    draft_vocab_size: int | None = rule(32000, low=2)  # capped at the target's vocabulary; None = the whole vocabulary
    aux_layer_ids: list[int] | None = rule(None, low=0)  # None = serving engines' default (outputs of layers 1, N/2-1, N-4)
    init_from: str | None = None  # a head folder (native or exported) to fine-tune; its aux layers and vocab are kept


@dataclass
class TrainSection:
    """train: the training loop (`accelerate launch ... -m train RECIPE`)."""

    output_dir: str = "${run_dir}/train"  # checkpoint-<step>/, final/, log.jsonl, tensorboard/
    online: bool = False  # True = target in the loop (features from data.prepared_dir, nothing on disk)
    # optimizer steps, or train.epochs (exactly one; setting only epochs clears it); 0 = evaluate without training
    max_steps: int | None = rule(2000, low=0)
    epochs: int | None = rule(None, low=1)  # passes over the training data
    batch_size: int | None = rule(None, low=1)  # sequences per micro-batch (when set, batch_tokens is ignored)
    batch_tokens: int | None = rule(2048, low=1)  # padded tokens per micro-batch and rank (length-bucketed)
    grad_accum: int = rule(4, low=1)  # micro-batches per optimizer step
    max_length: int | None = rule(1024, low=2)  # tokens per sequence (longer ones are cut)
    lr: float = rule(1e-4, above=0)  # peak learning rate (AdamW, betas 0.9 / 0.95)
    warmup_steps: int = rule(100, low=0)  # linear warmup, then cosine to min_lr_ratio * lr
    min_lr_ratio: float = rule(0.0, low=0, high=1)
    weight_decay: float = rule(0.0, low=0)
    max_grad_norm: float = rule(0.5, above=0)  # gradient clipping
    ttt_steps: int = rule(7, low=1)  # EAGLE-3 training-time-test unroll depth (eagle1: always 1)
    ttt_decay: float = rule(0.8, above=0)  # weight of unroll step i: ttt_decay ** i
    feature_noise: float = rule(0.0, low=0)  # eagle1 only: uniform +-noise on the input features
    compile_loss: bool = True  # the loss's elementwise part through torch.compile (train/soft_ce.py; ~2x on it)
    mixed_precision: str = rule("bf16", choices=("bf16", "fp32", "fp16", "no"))  # fp16 on GPUs only
    seed: int = 0  # head initialisation and data order
    save_every: int = rule(500, low=1)  # steps between checkpoints (re-running the command resumes)
    keep_checkpoints: int | None = rule(2, low=1)  # None = keep every checkpoint
    eval_every: int = rule(250, low=1)  # steps between validation runs
    eval_batches: int | None = rule(50, low=1)  # validation micro-batches per rank and evaluation (None = all)
    log_every: int = rule(10, low=1)  # steps per log.jsonl record (host syncs of loss/accuracy only then; also at eval/save steps)
    num_workers: int = rule(1, low=0)  # DataLoader worker processes reading and collating batches (0 = in the main process)
    debug_report: bool = False  # write ranks/rank-<r>.json (sequences seen, parameter sums, peak RSS): tests, benches

    def __post_init__(self) -> None:
        if (self.max_steps is None) == (self.epochs is None):
            raise RecipeError("set exactly one of train.max_steps and train.epochs")
        if self.batch_size is not None:
            self.batch_tokens = None
        elif self.batch_tokens is None:
            raise RecipeError("set one of train.batch_size and train.batch_tokens")


@dataclass
class Recipe:
    """A whole recipe: the target, where the run lives, and one section per job."""

    target: str = "${DRAFTHEAD_CACHE}/models/SmolLM2-135M-Instruct"  # a local Hugging Face model folder
    run_dir: str = "runs/smollm2-135m-eagle3"  # where prepared data, features and checkpoints go by default
    # regeneration and collection (training runs on the device accelerate gives each process)
    device: str = rule("auto", pattern=r"auto|(cpu|cuda|xpu|mps)(:[0-9]+)?",
                       means="auto or a device: cpu, cuda, cuda:1, ...")  # auto = CUDA when present, else the CPU
    dtype: str = rule("auto", choices=DTYPE_CHOICES)  # target dtype (collection, online features, regeneration): auto = bf16 where native
    data: DataSection = field(default_factory=DataSection)
    features: FeaturesSection = field(default_factory=FeaturesSection)
    head: HeadSection = field(default_factory=HeadSection)
    train: TrainSection = field(default_factory=TrainSection)


# Keys that clear their alternative's default when only they are given: {section: {key: alternative}}.
_EITHER_OR = {"train": {"epochs": "max_steps"}}


def defaults() -> dict:
    """The default recipe as a plain dict (uninterpolated): what configs/smollm2-135m-eagle3.yaml says."""
    return dataclasses.asdict(Recipe())


# ------------------------------------------------------------------------------------------ checking keys
def _check_keys(values: dict, cls: type, where: str) -> None:
    """Refuse keys `cls` does not have, naming the valid ones and the closest match; recurse into sections."""
    if not isinstance(values, dict):
        raise RecipeError(f"recipe section {where or 'top level'} must be a mapping, got {values!r}")
    types = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    for key, value in values.items():
        dotted = f"{where}.{key}" if where else str(key)
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise RecipeError(f"unknown recipe key {dotted!r}{hint} (valid keys of {where or 'the top level'}: "
                             f"{', '.join(valid)})")
        if dataclasses.is_dataclass(types[key]) and value is not None:
            _check_keys(value, types[key], dotted)


def _merge(base: dict, over: dict) -> dict:
    """`over` laid onto `base`, section by section."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(base[key], value) if isinstance(base.get(key), dict) and isinstance(value, dict) else value
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fits(value: Any, hint: Any) -> bool:
    """Whether `value` (as YAML gives it) is of the field type `hint`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return isinstance(value, list) and all(_fits(v, typing.get_args(hint)[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return _is_int(value)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    """A field type in words: 'an integer', 'a list of integers or null', ..."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return "a list of " + _describe(typing.get_args(hint)[0]).split(" ", 1)[1] + "s"
    return {type(None): "null", float: "a number", int: "an integer", bool: "true or false", str: "a string"}.get(
        hint, hint.__name__)


def allowed_values(hint: Any, checks: dict) -> str:
    """What a field accepts, in words: its type with its range, its choices, or what its pattern means."""
    low, high, above = checks.get("low"), checks.get("high"), checks.get("above")
    bounds = " and ".join(b for b in (f">= {low}" if low is not None else "", f"> {above}" if above is not None
                                      else "", f"<= {high}" if high is not None else "") if b)
    if checks.get("choices"):
        return "one of " + ", ".join(map(repr, checks["choices"])) + (" or null" if _fits(None, hint) else "")
    if checks.get("pattern"):
        return checks["means"]
    return _describe(hint) + (f" ({'each ' if typing.get_origin(hint) is list or _fits([], hint) else ''}"
                              f"{bounds})" if bounds else "")


def _check_value(value: Any, hint: Any, checks: dict, dotted: str) -> Any:
    """`value` of field `dotted`, checked against its type and allowed values; a number written as a string
    (YAML 1.1 reads `1e-4` so) becomes a float where the field takes one."""
    if isinstance(value, str) and _fits(1.0, hint) and not _fits(value, hint):
        try:
            value = float(value)
        except ValueError:
            pass
    if _is_int(value) and _fits(1.0, hint) and not _fits(1, hint):
        value = float(value)  # `lr: 1` in YAML fills a float field
    low, high, above = checks.get("low"), checks.get("high"), checks.get("above")
    choices, pattern = checks.get("choices"), checks.get("pattern")
    allowed = allowed_values(hint, checks)
    wrong = not _fits(value, hint)
    if not wrong and value is not None:
        wrong = (choices and value not in choices) or (pattern and not re.fullmatch(pattern, value)) or any(
            (low is not None and item < low) or (high is not None and item > high) or
            (above is not None and item <= above) for item in (value if isinstance(value, list) else [value]))
    if wrong:
        raise RecipeError(f"recipe key {dotted} = {value!r}: expected {allowed}")
    return value


def _build(cls: type, values: dict, where: str = "") -> Any:
    """The dataclass `cls` of a complete, interpolated dict (sections built recursively), every value checked."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        dotted = f"{where}.{key}" if where else key
        if dataclasses.is_dataclass(hints[key]):
            value = _build(hints[key], value or {}, dotted)
        else:
            value = _check_value(value, hints[key], dict(fields[key].metadata), dotted)
        kwargs[key] = value
    return cls(**kwargs)


# ---------------------------------------------------------------------------------- interpolation, parsing
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
            raise RecipeError(f"override {dotted!r}: {part!r} is not a section")
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
            return str(cache_dir())
        if name in os.environ:
            return os.environ[name]
        try:
            return str(_interpolate(_lookup(recipe, name), recipe, depth + 1))
        except KeyError:
            raise RecipeError(f"recipe refers to ${{{name}}}, which is neither a recipe key nor an environment variable")

    return _REF.sub(replace, value)


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r} is not key=value")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else None
        if isinstance(value, str) and any(c.isdigit() for c in value):  # YAML 1.1 reads "1e-3" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        parsed.append((key.strip(), value))
    return parsed


def parse_recipe(values: dict | Recipe) -> Recipe:
    """A Recipe from a recipe dict: keys checked, defaults filled in, `${...}` resolved, sections typed."""
    if isinstance(values, Recipe):
        return values
    values = values or {}
    _check_keys(values, Recipe, "")
    full = _merge(defaults(), values)
    for section, pairs in _EITHER_OR.items():
        given = values.get(section) or {}
        for key, alternative in pairs.items():
            if given.get(key) is not None and alternative not in given:
                full[section][alternative] = None
    return _build(Recipe, _interpolate(full, full))


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Load a YAML recipe, apply `a.b=value` overrides (values parsed as YAML), then parse_recipe."""
    path = Path(path)
    if not path.exists():
        raise PathNotFound(f"recipe {path} not found")
    try:
        recipe = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise RecipeError(f"recipe {path} is not valid YAML: {' '.join(str(error).split())}")
    for key, value in parse_overrides(overrides or []):
        set_dotted(recipe, key, value)
    return parse_recipe(recipe)
