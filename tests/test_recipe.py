"""Recipes: typed sections, defaults in one place (== the default YAML), misspelt keys refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from conftest import REPO
from train.recipe import Recipe, defaults, load_recipe, parse_recipe

DEFAULT_YAML = REPO / "configs" / "smollm2-135m-eagle3.yaml"


def test_default_yaml_is_the_dataclass_defaults():
    """configs/smollm2-135m-eagle3.yaml (the default recipe) lists every key with the dataclasses' default."""
    assert yaml.safe_load(DEFAULT_YAML.read_text()) == defaults()


def test_every_section_is_a_dataclass():
    recipe = load_recipe(DEFAULT_YAML)
    for section in ("data", "features", "head", "train"):
        assert dataclasses.is_dataclass(getattr(recipe, section)), section
    assert dataclasses.is_dataclass(recipe.data.regenerate)
    assert recipe.train.batch_tokens == 2048 and recipe.train.max_length == 1024  # one set of defaults
    assert recipe.features.split_dir("validation") == f"{recipe.run_dir}/features/validation"  # ${...} resolved


@pytest.mark.parametrize("misspelt,expected,section", [
    ({"trian": {}}, "train", "the top level"),
    ({"data": {"max_lenght": 64}}, "max_length", "data"),
    ({"data": {"regenerate": {"temprature": 0.7}}}, "temperature", "data.regenerate"),
    ({"features": {"shard_sequence": 8}}, "shard_sequences", "features"),
    ({"head": {"draft_vocab": 256}}, "draft_vocab_size", "head"),
    ({"train": {"warmup_step": 3}}, "warmup_steps", "train"),
])
def test_misspelt_key_refused_with_valid_keys(misspelt, expected, section):
    with pytest.raises(ValueError) as err:
        parse_recipe(misspelt)
    message = str(err.value)
    assert f"did you mean {expected!r}" in message
    node = Recipe()
    for part in section.split(".") if section != "the top level" else []:
        node = getattr(node, part)
    valid = ", ".join(f.name for f in dataclasses.fields(node))  # the section's own valid keys, all listed
    assert f"valid keys of {section}: {valid}" in message, message


def test_override_of_unknown_key_refused(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  max_steps: 3\n")
    assert load_recipe(path, ["train.lr=0.01"]).train.lr == 0.01
    with pytest.raises(ValueError, match="did you mean 'lr'"):
        load_recipe(path, ["train.lrr=0.01"])


def test_either_or_keys():
    assert parse_recipe({"train": {"epochs": 2}}).train.max_steps is None  # epochs alone replaces max_steps
    with pytest.raises(ValueError, match="exactly one of train.max_steps and train.epochs"):
        parse_recipe({"train": {"epochs": 2, "max_steps": 5}})
    assert parse_recipe({"train": {"batch_size": 4}}).train.batch_tokens is None  # batch_size wins
    assert parse_recipe({"train": {"lr": 1}}).train.lr == 1.0 and isinstance(parse_recipe({}).train.lr, float)
    with pytest.raises(ValueError, match="mixed_precision"):
        parse_recipe({"train": {"mixed_precision": "fp8"}})
