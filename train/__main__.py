"""`accelerate launch [--config_file configs/accelerate/<x>.yaml] -m train RECIPE [key=value ...]`
(or `python -m train RECIPE ...` for one process): train a draft head as the recipe's `train:` section says."""

from __future__ import annotations

from train.recipe_help import recipe_main


def train(recipe):
    from train.trainer import train as run  # (imported once the recipe is read: a bad recipe fails at once)

    return run(recipe)


if __name__ == "__main__":
    recipe_main(train, __doc__)
