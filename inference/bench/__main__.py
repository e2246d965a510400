"""`python -m inference.bench`: the benchmark's command line (inference/bench/__init__.py)."""

from drafthead.errors import run_main

from . import main

raise SystemExit(run_main(main))
