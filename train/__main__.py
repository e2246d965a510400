"""`accelerate launch [--config_file configs/accelerate/<x>.yaml] -m train RECIPE [key=value ...]`
(or `python -m train RECIPE ...` for one process): train a draft head as the recipe's `train:` section says."""

from __future__ import annotations

import sys

from train.recipe import load_recipe
from train.trainer import train


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    train(load_recipe(argv[0], argv[1:]))


if __name__ == "__main__":
    main()
