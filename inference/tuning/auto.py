"""tree="auto" in the library: the tree tuned for this target, head, machine and dtype (budget.py, QUICK budget),
cached on disk in the asset cache folder (drafthead.paths.cache_dir()/tuning) so that it is paid once per machine;
a second process reads the choice back without tuning."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import transformers

import drafthead
from drafthead import DraftHead
from drafthead.hardware import cpu_flags
from drafthead.paths import cache_dir
from drafthead.utils import atomic_write_json, dtype_name

from ..cpu.kernels import digest_files
from ..tree import TreeOptions
from .budget import FULL, QUICK, TuningBudget, auto_tree, median_ms

# generic chat requests (no asset needed); the correction's answer copies its context nearly word for word, so that
# the prompt-lookup branch has something to gain in the tuning too (docs/history.md)
CALIBRATION_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in simple terms how a hash table works, with a small Python example.",
    "Correct the spelling and grammar in this text and return it: Yesterday me and my freind goes to the market to "
    "buy some vegetable. We was looking for tomatos, but they was all sold out, so we buyed potatos and carrots "
    "instead. After that we eat lunch in a small cafe near the river and talk about our plan for the weekend.",
)
CALIBRATION_TOKENS = 64
# the estimate printed before tuning: TUNING_FORWARDS target forwards over a 64-token chunk (measured with
# SmolLM2-135M, fp32, AVX2 CPU, QUICK budget), plus, compiled, TUNING_COMPILES step shapes (verify graphs, shared
# by a row's buckets, and drafting steps) at COMPILE_S_PER_LAYER seconds a decoder layer each (~3x apart between CPUs)
TUNING_FORWARDS = 300
TUNING_COMPILES = 4
COMPILE_S_PER_LAYER = 2.0
FORMAT = 3  # bumped when the cached file's meaning changes (1: other calibration prompts; 2: no tree meant no lookup)


@dataclasses.dataclass
class TunedTree:
    """What the tuning chose: the tree (None: plain decoding measured faster), the lookup branch's tokens (0: without
    it; with no tree, prompt lookup alone), the tokens/s it measured (the engine's slowdown warning's reference),
    and the KV buffer slots its steps were compiled for: a later process's runner starts that large, so that its
    first steps are the graphs inductor cached then."""

    tree: TreeOptions | None
    lookup_tokens: int
    plain_tokens_per_s: float
    tokens_per_s: float
    capacity: int = 0


def machine(device: torch.device) -> str:
    """The machine kind that decides the costs: the GPU's name, else the CPU's model, features and threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), name)
    return f"{name} [{' '.join(cpu_flags())}] x{torch.get_num_threads()} threads"


def fingerprint(module: nn.Module, config: Any) -> str:
    """A short digest of a model: its config and a sample of its weights (the first and last parameters), so that
    two checkpoints of one architecture, or a retrained head, are tuned apart."""
    params = list(module.parameters())
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for p in (params[0], params[-1]):
        digest.update(p.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


@functools.cache
def code_digest() -> str:
    """A digest of the code decoding runs: this package's Python and C++ kernels, drafthead's Python, transformers'
    version. A tuning, and the compiled steps it stores (runner.step_store), belong to one version of it."""
    digest = hashlib.sha256(transformers.__version__.encode())
    for folder in (Path(__file__).parents[1], Path(drafthead.__file__).parent):
        digest_files(digest, sorted(p for p in folder.rglob("*") if p.suffix in (".py", ".cpp", ".h")))
    return digest.hexdigest()[:16]


def cache_key(model: nn.Module, head: DraftHead, runner: Any, compiled: bool, lookup_tokens: int,
              budget: TuningBudget, draft_weights: str = "auto") -> dict:
    """The identity of a tuning: (target, head, machine, dtype) and the settings that change the costs (the
    runner, compile, the code, torch, the head's drafting weights)."""
    ref = next(model.parameters())
    target_config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}
    return {"format": FORMAT, "target": fingerprint(model, target_config),
            "head": fingerprint(head, dataclasses.asdict(head.config)), "machine": machine(ref.device),
            "dtype": dtype_name(ref.dtype), "runner": type(runner).__name__, "compile": compiled,
            "lookup_tokens": lookup_tokens, "torch": torch.__version__, "code": code_digest(),
            "budget": repr(budget), "draft_weights": draft_weights}


def read_cached(path: Path, key: dict) -> TunedTree | None:
    """The cached choice for `key`, or None (no file, an unreadable one, or another key)."""
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            return None
        tree = None if data["tree"] == "none" else TreeOptions(**data["tree"])
        return TunedTree(tree, int(data["lookup_tokens"]), float(data["plain_tokens_per_s"]),
                         float(data["tokens_per_s"]), int(data.get("capacity", 0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def calibration_inputs(tokenizer: Any, device: torch.device) -> list[torch.Tensor]:
    """The calibration prompts as the target reads them: in its chat template where it has one."""
    if not getattr(tokenizer, "chat_template", None):
        return [tokenizer(prompt, return_tensors="pt")["input_ids"].to(device) for prompt in CALIBRATION_PROMPTS]
    return [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"].to(device)
            for prompt in CALIBRATION_PROMPTS]


def estimate_s(model: nn.Module, inputs: list[torch.Tensor], compiled: bool = False) -> float:
    """Seconds the tuning should take here: TUNING_FORWARDS times one timed target forward over a prompt, plus
    the compiles when `compiled` (on a CPU; CUDA graphs capture in seconds)."""
    ids = inputs[0][:, :64]
    with torch.inference_mode():
        model(ids)  # the first call pays one-time setup
        forwards = TUNING_FORWARDS * median_ms(lambda: model(ids), 1, ids.device) / 1000
    if not compiled or ids.device.type == "cuda":
        return forwards
    layers = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", 30)
    return forwards + TUNING_COMPILES * COMPILE_S_PER_LAYER * layers


def tuned_tree(model: nn.Module, head: DraftHead, tokenizer: Any, runner: Any, compiled: bool,
               lookup_tokens: int, generator: Any, draft_weights: str = "auto") -> TunedTree:
    """The tree tuned for this target, head, machine and dtype on `runner`: read from the cache, else tuned
    (QUICK budget on CPU, after a notice with an estimate) and cached. lookup_tokens > 0: the tuning also decides
    whether the prompt-lookup branch of that many tokens pays. `generator`: the SpeculativeGenerator class."""
    device = next(model.parameters()).device
    budget = QUICK if device.type != "cuda" else dataclasses.replace(FULL, trial_trees=2, rounds=1)
    key = cache_key(model, head, runner, compiled, lookup_tokens, budget, draft_weights)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = cache_dir() / "tuning" / f"tree-{digest}.json"
    cached = read_cached(path, key)
    if hasattr(runner, "step_store"):  # its compiled steps, and those of the trial trees' generators, kept there too
        runner.step_store = path.with_suffix("")
    if cached is None:
        inputs = calibration_inputs(tokenizer, device)
        estimate = estimate_s(model, inputs, compiled)
        print(f"[drafthead] tree='auto': tuning the draft tree for this machine once (about "
              f"{max(1, round(estimate / 60))} min{', compiling its steps' if compiled else ''}; cached in "
              f"{path.parent})", file=sys.stderr, flush=True)
        start = time.perf_counter()
        options, report = auto_tree(model, head, inputs, max_new_tokens=CALIBRATION_TOKENS, runner=runner,
                                    lookup_tokens=lookup_tokens, budget=budget, verbose=False, generator=generator,
                                    draft_weights=draft_weights)
        branch = report["lookup_branch"]
        lookup = branch["tokens"] if branch and branch["chosen"] else 0
        # the chosen tree's trial rate; without a tree, prompt lookup alone's (plain decoding: none)
        chosen = report["predicted"]["tokens_per_s"] if options is not None else \
            (branch["tokens_per_s"]["with_lookup"] if lookup else 0.0)
        cached = TunedTree(options, lookup, report["predicted_plain"]["tokens_per_s"], chosen,
                           getattr(runner, "capacity", 0))
        tree = dataclasses.asdict(options) if options else "none"
        atomic_write_json(path, {"key": key, **dataclasses.asdict(cached), "tree": tree,
                                "tuning_s": time.perf_counter() - start, "estimate_s": estimate, "report": report})
    if cached.tree is None:
        then = (f"drafting by prompt lookup alone (up to {cached.lookup_tokens} tokens copied from the context), "
                "which measured faster than plain decoding") if cached.lookup_tokens else "decoding without speculation"
        print("[drafthead] tree='auto': plain decoding measured faster than every draft tree on this machine; " + then,
              file=sys.stderr)
    return cached
