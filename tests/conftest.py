"""Shared fixtures: tiny random HF models (unit tests) and the real SmolLM2 target (integration, @pytest.mark.real)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))  # for `import tiny`
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# inductor's compiled kernels in a folder the test run owns (shared by the xdist workers and kept for the next run),
# not the machine-wide /tmp/torchinductor_$USER
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".pytest_cache" / "torchinductor"))

from tiny import ARCHS, tiny_model, tiny_tokenizer  # noqa: E402

from drafthead.paths import cache_dir  # noqa: E402



def pytest_configure(config):
    """Under xdist, each worker takes its share of the cores, and so do the processes its tests start
    (OMP_NUM_THREADS): the tiny models gain nothing from more threads, and two workers' OpenMP pools on the same
    cores only contend. The xdist controller first builds this CPU's C++ kernels (inference/cpu_kernels.py) with
    every core, once, so that no worker builds them inside a test while the other waits for its lock."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        share = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
    elif getattr(config.option, "numprocesses", None):
        from inference.cpu.kernels import avx2_kernels_available, kernels_available

        kernels_available()
        avx2_kernels_available()


# The modules that take longest (.pytest_cache/durations.json of a full run), run first: xdist hands each worker
# whole modules (--dist loadscope --no-loadscope-reorder) in this order, so no long module is left for the end while
# the other worker idles.
LONGEST_FIRST = ("test_distributed", "test_inference_real", "test_inference_trained", "test_static_runner",
                 "test_trainer", "test_batch", "test_drafters", "test_inference_greedy", "test_finetune",
                 "test_readme_runs", "test_bad_input", "test_gguf_weights")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration  # setup + call + teardown


def pytest_sessionfinish(session):
    """Every test's seconds, slowest first, in .pytest_cache/durations.json (in the controller under xdist): the
    whole table behind --durations=25."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not _durations:
        return
    import json

    path = REPO / ".pytest_cache" / "durations.json"
    path.parent.mkdir(exist_ok=True)
    table = sorted(_durations.items(), key=lambda item: -item[1])
    path.write_text(json.dumps([{"test": name, "s": round(s, 2)} for name, s in table], indent=1) + "\n")


RUNNERS = ("static", "eager")  # every losslessness test runs against both target runners


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(params=RUNNERS)
def runner(request) -> str:
    """The engine's target runner: preallocated static KV buffers, or the eager DynamicCache reference."""
    return request.param


@pytest.fixture
def tiny_target(arch):
    return tiny_model(arch)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


def asset(relative: str, marker: str = "") -> Path:
    """A fetched asset in the cache (`marker`: a file inside it that proves it complete); fails the test if absent."""
    path = cache_dir() / relative
    if not (path / marker if marker else path).exists():
        pytest.fail(f"{path} missing: run `python scripts/fetch_assets.py` (make test does it)")
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return asset("models/SmolLM2-135M-Instruct", "config.json")


@pytest.fixture(scope="session")
def mt_bench_path() -> Path:
    return asset("data/mt_bench.jsonl")


@pytest.fixture(scope="session")
def sharegpt_path() -> Path:
    return asset("data/sharegpt.jsonl")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def save_tiny_target(folder: Path, arch: str = "llama", seed: int = 0) -> Path:
    """A tiny random target + the tiny ChatML tokenizer saved as a local HF folder (loadable by a subprocess)."""
    tiny_model(arch, seed=seed).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def stub_tree_search(monkeypatch, options, calls: list) -> None:
    """tree="auto" without its search (slow to compile; tuning/auto.py and its own tests cover it): every tuning
    chooses `options`, predicted at 12 tokens/s against 10 for plain decoding, and appends its keyword arguments to
    `calls`."""
    from inference.tuning import auto

    report = {"lookup_branch": None, "predicted": {"tokens_per_s": 12.0}, "predicted_plain": {"tokens_per_s": 10.0}}
    monkeypatch.setattr(auto, "auto_tree", lambda *a, **k: calls.append(k) or (options, report))


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """Session-wide tiny Llama target folder (model + ChatML tokenizer)."""
    return save_tiny_target(tmp_path_factory.mktemp("tiny_target"))
