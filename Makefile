# Two commands do everything: `make demo` and `make test`. Both create .venv and install on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RUN_DIR ?= runs/demo
export DRAFTHEAD_CACHE ?= $(HOME)/.cache/drafthead
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

# tcmalloc makes CPU steps faster and far less noisy; preload it when the machine has it.
TCMALLOC := $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4))
ifneq ($(TCMALLOC),)
export LD_PRELOAD := $(TCMALLOC)
endif

.PHONY: install demo test test-fast assets clean-demo

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

assets: install
	$(PY) scripts/fetch_assets.py

demo: install
	RUN_DIR=$(RUN_DIR) $(PY) scripts/demo.py

# one worker per core (pytest-xdist), each module on one worker (--dist loadscope: a module's fixtures, such as
# the trained head, are built once), the longest modules first (tests/conftest.py); the 25 slowest tests printed
test: assets
	$(PY) -m pytest -q -n auto --dist loadscope --no-loadscope-reorder --durations=25 tests

test-fast: install
	$(PY) -m pytest -q -n auto --dist loadscope --no-loadscope-reorder -m "not real and not slow" tests
