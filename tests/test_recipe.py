"""Recipes: typed sections, defaults in one place (== the default YAML), misspelt keys refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
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


# ------------------------------------------------------------------------------ --help, --print-config, device
def _run_main(argv: list[str], capsys) -> tuple[int, str, list]:
    from train.recipe_help import recipe_main

    ran = []
    with pytest.raises(SystemExit) as exit_:
        recipe_main(ran.append, "`python -m train.collect RECIPE`: collect features.", argv)
    return exit_.value.code, capsys.readouterr().out, ran


def test_help_lists_every_recipe_key_with_its_type_and_default(capsys):
    """`--help` is generated from the typed sections: every dotted key, what it accepts and its default."""
    from train.recipe_help import recipe_keys

    code, out, ran = _run_main(["--help"], capsys)
    assert code == 0 and not ran
    assert "usage: python -m train.collect RECIPE" in out and "--print-config" in out
    keys = [row[0] for row in recipe_keys()]
    assert len(keys) == len(set(keys)) > 50
    for key in keys:
        assert f"\n  {key}: " in out, key
    assert "\n  train.lr: a number (> 0) = 0.0001\n" in out
    assert "\n  device: auto or a device: cpu, cuda, cuda:1, ... = auto\n" in out
    assert "\n  head.kind: one of 'eagle3', 'eagle1' = eagle3\n" in out
    assert "peak learning rate" in out  # the field's own comment
    # every leaf of the defaults appears once
    flat = []

    def walk(node, where=""):
        for k, v in node.items():
            walk(v, f"{where}{k}.") if isinstance(v, dict) else flat.append(f"{where}{k}")
    walk(dataclasses.asdict(Recipe()))
    assert sorted(flat) == sorted(keys)


def test_print_config_prints_the_resolved_recipe_and_runs_nothing(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run_dir: runs/mine\ntrain:\n  epochs: 2\n")
    code, out, ran = _run_main([str(recipe), "train.lr=3e-4", "target=/models/x", "--print-config"], capsys)
    assert code == 0 and not ran
    printed = yaml.safe_load(out)
    assert printed["target"] == "/models/x" and printed["train"]["lr"] == 3e-4
    assert printed["train"]["epochs"] == 2 and printed["train"]["max_steps"] is None
    assert printed["data"]["prepared_dir"] == "runs/mine/prepared"  # ${run_dir} filled in
    assert printed["device"] == "auto"


def test_device_auto_is_cuda_when_present_and_a_missing_gpu_is_one_clear_error():
    from drafthead.errors import DeviceError
    from drafthead.hardware import resolve_device

    expected = torch.device("cuda", 1) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto", local_rank=1) == expected
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="CUDA is not available"):
            resolve_device("cuda")
