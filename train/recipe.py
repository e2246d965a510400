"""Recipes: one YAML file per job, typed sections with their defaults, `${VAR}` interpolation, and `key.sub=value`
command-line overrides.

Every section is a dataclass below; its field defaults are THE defaults (configs/smollm2-135m-eagle3.yaml, the
default recipe, lists the same values, and a test holds them equal). A recipe file needs only the keys it
changes. A key no section knows is refused with the valid keys and the closest match. Defaults may refer to
other keys (`${run_dir}/features`); they are interpolated together with the file's own values.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from drafthead.paths import cache_dir
from drafthead.utils import mixed_precision

_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_.]*)\}")


# ------------------------------------------------------------------------------------------------ sections
@dataclass
class RegenerateSection:
    """data.regenerate: `python -m train.regenerate RECIPE` rewrites the assistant turns with the target."""

    output: str = "${run_dir}/regenerated.jsonl"  # then prepare with data.conversations=<this file>
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    batch_size: int = 32  # conversations decoded together (rows of one forward)
    chunk_conversations: int = 256  # resumable unit
    seed: int = 0


@dataclass
class DataSection:
    """data: conversations -> prepared token ids + loss mask (`python -m train.prepare RECIPE`)."""

    conversations: str = "${DRAFTHEAD_CACHE}/data/sharegpt.jsonl"  # JSONL (ShareGPT / OpenAI) or a datasets folder
    prepared_dir: str = "${run_dir}/prepared"
    max_length: int = 1024
    max_conversations: int | None = None  # None = all
    max_assistant_turns: int | None = None  # cut each conversation after its N-th assistant turn (None = keep all)
    validation_fraction: float = 0.02  # by conversation id root
    skip_bad: bool = False
    seed: int = 0
    num_proc: int | None = None  # tokenizing worker processes; None = min(4, CPU count)
    regenerate: RegenerateSection = field(default_factory=RegenerateSection)


@dataclass
class FeaturesSection:
    """features: target hidden states written as shards (`python -m train.collect RECIPE`)."""

    dir: str = "${run_dir}/features"
    shard_sequences: int = 256  # sequences per shard
    batch_tokens: int = 4096  # padded tokens per target forward
    validation_dir: str | None = "${features.dir}/validation"  # features of the "validation" split
    splits: list[str] = field(default_factory=lambda: ["train", "validation"])  # prepared splits to collect
    target_dtype: str | None = None  # target dtype while collecting (None = the recipe's dtype)

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

    kind: str = "eagle3"  # eagle3 | eagle1
    draft_vocab_size: int | None = 32000  # capped at the target's vocabulary; None = the whole vocabulary
    aux_layer_ids: list[int] | None = None  # None = serving engines' default (outputs of layers 1, N/2-1, N-4)
    init_from: str | None = None  # a head folder (native or exported) to fine-tune; its aux layers and vocab are kept


@dataclass
class TrainSection:
    """train: the training loop (`accelerate launch ... -m train RECIPE`)."""

    output_dir: str = "${run_dir}/train"  # checkpoint-<step>/, final/, log.jsonl, tensorboard/
    online: bool = False  # True = target in the loop (features from data.prepared_dir, nothing on disk)
    max_steps: int | None = 2000  # or epochs (exactly one; setting only epochs clears max_steps)
    epochs: int | None = None
    batch_size: int | None = None  # sequences per micro-batch (when set, batch_tokens is ignored), or
    batch_tokens: int | None = 2048  # padded tokens per micro-batch and rank (length-bucketed)
    grad_accum: int = 4
    max_length: int | None = 1024  # tokens per sequence (longer ones are cut)
    lr: float = 1e-4
    warmup_steps: int = 100  # linear warmup, then cosine to min_lr_ratio * lr
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    ttt_steps: int = 7  # EAGLE-3 training-time-test unroll depth (eagle1: always 1)
    ttt_decay: float = 0.8  # weight of unroll step i: ttt_decay ** i
    feature_noise: float = 0.0  # eagle1 only: uniform +-noise on the input features
    compile_loss: bool = True  # the loss's elementwise part through torch.compile (train/soft_ce.py; ~2x on it)
    mixed_precision: str = "bf16"  # bf16 | fp32 (fp16 on GPUs only)
    seed: int = 0
    save_every: int = 500
    keep_checkpoints: int | None = 2  # None = keep every checkpoint
    eval_every: int = 250
    eval_batches: int | None = 50  # validation micro-batches per rank and evaluation (None = all)
    log_every: int = 10  # steps per log.jsonl record (host syncs of loss/accuracy only then; also at eval/save steps)
    num_workers: int = 1  # DataLoader worker processes reading and collating batches (0 = in the main process)
    debug_report: bool = False  # write ranks/rank-<r>.json (sequences seen, parameter sums, peak RSS): tests, benches

    def __post_init__(self) -> None:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of train.max_steps and train.epochs")
        if self.batch_size is not None:
            self.batch_tokens = None
        elif self.batch_tokens is None:
            raise ValueError("set one of train.batch_size and train.batch_tokens")
        if self.log_every < 1 or self.num_workers < 0:
            raise ValueError(f"train.log_every must be >= 1 and train.num_workers >= 0, got {self.log_every} and "
                             f"{self.num_workers}")
        try:
            mixed_precision(self.mixed_precision)
        except (KeyError, ValueError):
            raise ValueError(f"train.mixed_precision must be bf16, fp16 or fp32, got {self.mixed_precision!r}")


@dataclass
class Recipe:
    """A whole recipe: the target, where the run lives, and one section per job."""

    target: str = "${DRAFTHEAD_CACHE}/models/SmolLM2-135M-Instruct"
    run_dir: str = "runs/smollm2-135m-eagle3"
    device: str = "cpu"  # cpu | cuda | cuda:1 ...
    dtype: str = "auto"  # target dtype (collection, online features, regeneration): auto = bf16 where native
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
        raise ValueError(f"recipe section {where or 'top level'} must be a mapping, got {values!r}")
    types = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    for key, value in values.items():
        dotted = f"{where}.{key}" if where else str(key)
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown recipe key {dotted!r}{hint} (valid keys of {where or 'the top level'}: "
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


def _build(cls: type, values: dict) -> Any:
    """The dataclass `cls` of a complete, interpolated dict (sections built recursively)."""
    types = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if dataclasses.is_dataclass(types[key]):
            value = _build(types[key], value or {})
        elif _is_int(value) and float in (types[key], *typing.get_args(types[key])):
            value = float(value)  # `lr: 1` in YAML fills a float field
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
            return str(cache_dir())
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
        raise FileNotFoundError(f"recipe {path} not found")
    recipe = yaml.safe_load(path.read_text()) or {}
    for key, value in parse_overrides(overrides or []):
        set_dotted(recipe, key, value)
    return parse_recipe(recipe)


def recipe_main(job, doc: str, argv: list[str] | None = None) -> None:
    """Command-line entry of every recipe job: `python -m train.<job> RECIPE [key=value ...]`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(doc)
        raise SystemExit(0 if argv else 2)
    job(load_recipe(argv[0], argv[1:]))
