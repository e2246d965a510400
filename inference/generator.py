"""SpeculativeGenerator: draft a tree with the head, verify it with the target in one forward, repeat.

    gen = SpeculativeGenerator.from_pretrained(target_path, head_path, device="cpu", dtype="bfloat16")
    out = gen.generate(input_ids, max_new_tokens=128, temperature=0.0)
    out.sequences  # (1, prompt + new) ; out.stats.mean_accepted, out.stats.tokens_per_s, ...

Lossless: greedy output equals the target's own greedy decoding; sampled tokens follow the target's processed
distribution exactly (see verify.py). Stops (eos, stop strings, max_new_tokens) may land inside an accepted path;
the path is then cut where plain decoding would have stopped.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from drafthead import DraftHead, check_compatible, load_head
from drafthead.dtypes import parse_dtype
from drafthead.masks import causal_allowed

from .runner import TargetRunner
from .sampling import SamplingParams, target_probs
from .head_runner import head_runner_for
from .tree import DraftTree, TreeDrafter, TreeOptions, tree_options
from .verify import children_lists, verify_greedy, verify_sampling


@dataclass
class GenerationStats:
    """tau = mean_accepted: tokens emitted per verification forward (accepted drafts + the bonus token)."""

    new_tokens: int = 0
    target_forwards: int = 0  # prefill + verifications
    accept_lengths: list[int] = field(default_factory=list)  # per verification, bonus included, before stops
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0  # target forwards (prefill included) + verification + cache compaction
    total_time_s: float = 0.0

    @property
    def mean_accepted(self) -> float:
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def histogram(self) -> dict[int, int]:
        """accepted length -> number of verification steps."""
        return dict(sorted(Counter(self.accept_lengths).items()))

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(mean_accepted=self.mean_accepted, histogram=self.histogram, tokens_per_s=self.tokens_per_s)
        return d


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # (1, prompt + new) long
    stats: GenerationStats


class _Stopper:
    """Where plain decoding would stop inside a batch of new tokens: eos, stop strings, max_new_tokens."""

    def __init__(self, eos: set[int], stop: list[str], tokenizer: Any, max_new_tokens: int):
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer=... to from_pretrained or generate")
        self.eos, self.stop, self.tokenizer, self.max_new = eos, stop, tokenizer, max_new_tokens
        self.longest = max((len(s) for s in stop), default=0)
        self.text_len = 0  # characters of the decoded new tokens so far

    def cut(self, done: list[int], batch: list[int]) -> int | None:
        """Number of tokens of `batch` to keep if generation ends inside it (or right after it), else None."""
        room = self.max_new - len(done)
        end = None
        for j, tok in enumerate(batch[:room]):
            if tok in self.eos:
                end = j + 1
                break
        limit = end if end is not None else min(len(batch), room)
        if self.stop:
            hit = self._stop_string(done, batch[:limit])
            if hit is not None:
                return hit
        if end is not None or len(batch) >= room:
            return limit
        return None

    def _stop_string(self, done: list[int], batch: list[int]) -> int | None:
        decode = self.tokenizer.decode
        start = max(self.text_len - self.longest, 0)
        if not any(s in decode(done + batch)[start:] for s in self.stop):
            self.text_len = len(decode(done + batch))
            return None
        for j in range(1, len(batch) + 1):  # the first token after which a stop string is present
            if any(s in decode(done + batch[:j])[start:] for s in self.stop):
                return j
        return None


class SpeculativeGenerator:
    """A frozen target plus a draft head; see the module docstring. tree="none" decodes without drafting (plain
    greedy/sampled decoding on the same runner: the baseline that separates what the runner buys from what
    speculation buys); the head may then be None.

    runner: "static" (preallocated KV buffers, fixed-shape verify buckets; static_runner.py), "eager" (any HF
    causal LM, DynamicCache; runner.py) or "auto" (static where the architecture allows, else eager with a one-line
    message), or a runner object to share (the benchmark shares one among its methods). compile: torch.compile
    the static runner's verify steps and the head's drafting steps (CUDA graphs on CUDA); "auto" compiles on CUDA
    only, because on a 2-core CPU each step shape costs ~30-45 s to compile and pays only over long runs (the
    benchmark compiles). The runner, its buffers and its compiled graphs live as long as the generator.
    """

    def __init__(self, target: nn.Module, head: DraftHead | None, tokenizer: Any = None,
                 tree: str | TreeOptions | None = "cpu", runner: Any = "auto", compile: bool | str = "auto",
                 **tree_overrides: int | None):
        self.plain = tree == "none"
        if head is None and not self.plain:
            raise ValueError("a draft head is needed unless tree='none' (plain decoding)")
        if head is not None:
            check_compatible(head.config, target.config)
            head = head.eval()
        self.target = target.eval()
        self.head = head
        self.tokenizer = tokenizer
        self.options = None if self.plain else tree_options(tree, **tree_overrides)
        self.device = next(target.parameters()).device
        if isinstance(runner, str) and runner not in ("auto", "static", "eager"):
            raise ValueError(f"runner must be 'auto', 'static', 'eager' or a runner object, got {runner!r}")
        if compile == "auto":
            compile = self.device.type == "cuda"
        if compile not in (True, False):
            raise ValueError(f"compile must be 'auto', True or False, got {compile!r}")
        self.runner_kind, self.compile = runner, bool(compile)
        self._runner = None if isinstance(runner, str) else runner  # a runner object is shared, e.g. by the bench

    @property
    def runner(self):
        """The target runner (built on first use, then reused across generate calls; or the one passed in)."""
        if self._runner is None:
            self._runner = make_runner(self.target, [] if self.plain else self.head.config.aux_layer_ids,
                                       self.runner_kind, self.compile)
        return self._runner

    def warmup(self, max_length: int) -> dict[int, float]:
        """Size the KV buffers for sequences of up to `max_length` tokens and run one verify step of the shape this
        generator uses (compiling it when compile is on). Returns the runner's {verify size: seconds of its first
        call} (empty for the eager runner)."""
        runner = self.runner
        runner.reserve(max_length)
        n = 1 if self.plain else self.options.tree_size
        # a prompt as long as the largest bucket: the compiled runner's prefill shape
        ids = torch.zeros(1, max(getattr(runner, "buckets", (4,))[-1], 4), dtype=torch.long, device=self.device)
        with runner.session(), torch.inference_mode():
            runner.reset(ids.shape[1])
            runner.prefill(ids)
            runner.verify(ids[:, :1].repeat(1, n), torch.arange(n, device=self.device),
                          causal_allowed(n, 0, self.device))
            runner.commit(torch.zeros(0, dtype=torch.long, device=self.device), n)
        if not self.plain:  # the head's drafting step (compiled once per top-k)
            self.generate(ids, max_new_tokens=2 * self.options.depth + 2, eos_token_id=[])
        return dict(getattr(runner, "compile_s", {}))

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | nn.Module,
        draft: str | Path | DraftHead | None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        tokenizer: Any = None,
        tree: str | TreeOptions | None = "cpu",
        depth: int | None = None,
        top_k: int | None = None,
        total_tokens: int | None = None,
        runner: str = "auto",
        compile: bool | str = "auto",
    ) -> "SpeculativeGenerator":
        """target: HF folder/name or a loaded causal LM; draft: head folder (native or exported) or DraftHead
        (None with tree="none"). Raises drafthead.HeadMismatchError when the head was made for another target."""
        dtype = parse_dtype(dtype)
        if isinstance(target, (str, Path)):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype if dtype is not None else "auto")
            if tokenizer is None:
                try:
                    tokenizer = AutoTokenizer.from_pretrained(target)
                except (OSError, ValueError):
                    tokenizer = None
        else:
            model = target
        model = model.to(device=device, dtype=dtype).eval()
        ref = next(model.parameters())
        if draft is None:
            head = None
        elif isinstance(draft, DraftHead):
            check_compatible(draft.config, model.config)
            head = draft.to(device=ref.device, dtype=ref.dtype).attach_target(model)
        else:
            head = load_head(draft, target=model, device=ref.device, dtype=ref.dtype)
        return cls(model, head, tokenizer, tree, runner=runner, compile=compile, depth=depth, top_k=top_k,
                   total_tokens=total_tokens)

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        do_sample: bool | None = None,
        eos_token_id: int | list[int] | None = None,
        stop: list[str] | str | None = None,
        streamer: Any = None,
        generation_config: Any = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        tokenizer: Any = None,
        on_step: Callable[[DraftTree, torch.Tensor], None] | None = None,
    ) -> GenerationOutput:
        """Speculative generation for one prompt (1, T). Arguments as in transformers' generate; explicit
        arguments win over `generation_config`. Greedy unless sampling is asked for (temperature > 0 or
        do_sample). eos defaults to the target's generation_config.eos_token_id."""
        t_start = time.perf_counter()
        gc = generation_config
        params = SamplingParams.make(temperature, top_k, top_p, do_sample, gc)
        if max_new_tokens is None:
            max_new_tokens = getattr(gc, "max_new_tokens", None) or 20
        if eos_token_id is None:
            eos_token_id = getattr(gc, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(getattr(self.target, "generation_config", None), "eos_token_id", None)
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
        if stop is None:
            stop = getattr(gc, "stop_strings", None)
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        stopper = _Stopper(eos, stop, tokenizer or self.tokenizer, max_new_tokens)
        if generator is None and seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() > 2 or (input_ids.dim() == 2 and input_ids.shape[0] != 1):
            raise ValueError(f"one prompt at a time: input_ids must be (1, T) or (T,), got {tuple(input_ids.shape)}")
        input_ids = input_ids.view(1, -1).to(self.device)
        runner = self.runner
        runner.reset(input_ids.shape[1] + max_new_tokens)
        with runner.session():
            new, stats = self._decode(runner, input_ids, params, stopper, generator, streamer, on_step)
        stats.new_tokens = len(new)
        stats.total_time_s = time.perf_counter() - t_start
        out = torch.tensor(new, dtype=torch.long, device=self.device).view(1, -1)
        return GenerationOutput(torch.cat([input_ids, out], dim=1), stats)

    def _decode(self, runner, input_ids, params, stopper, generator, streamer, on_step):
        """The decoding loop. Host syncs per step, each needed: the accepted tokens (`.tolist()`: stop checks and
        the streamer), the accepted path (`nonzero` in verify_greedy; sampling walks the tree on the host) and the
        "is the path already in place" test in the runner's commit; on CUDA the timers also synchronise. Drafting
        (top-k frontier, tree selection, ancestor masks) stays on the device."""
        stats = GenerationStats()
        sync = _synchronizer(self.device)

        def pick(logits: torch.Tensor) -> torch.Tensor:  # (1, V) -> (1,)
            if not params.do_sample:
                return logits.float().argmax(dim=-1)
            return torch.multinomial(target_probs(logits, params), 1, generator=generator)[0]

        drafter = None
        if not self.plain:
            drafter = TreeDrafter(self.head, self.options, head_runner_for(self.head, self.compile))
            drafter.reset(input_ids.shape[1] + stopper.max_new)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        t0 = time.perf_counter()
        logits, features = runner.prefill(input_ids)
        first = pick(logits)
        stats.target_forwards += 1
        sync()
        stats.verify_time_s += time.perf_counter() - t0
        new: list[int] = []
        batch = first.tolist()
        # true pairs (target feature at t, token t+1) the head has not seen yet; first: the whole prompt
        feed_features, feed_tokens = features, torch.cat([input_ids[:, 1:], first.view(1, 1)], dim=1)
        while True:
            keep = stopper.cut(new, batch)
            emitted = batch if keep is None else batch[:keep]
            new += emitted
            if streamer is not None and emitted:
                streamer.put(torch.tensor(emitted))
            if keep is not None:
                break
            t0 = time.perf_counter()
            root = torch.tensor(batch[-1:], device=self.device)
            if drafter is None:
                tree = DraftTree.root_only(root)
            else:
                drafter.feed(feed_features, feed_tokens, drafter.stable_length)
                tree = drafter.draft(root)
            sync()
            t1 = time.perf_counter()
            logits, features, greedy = runner.verify(tree.tokens, tree.depths, tree.ancestors)
            if params.do_sample:
                probs = target_probs(logits[0], params)
                path, new_tokens = verify_sampling(probs, tree, generator, children_lists(tree))
            else:
                path, new_tokens = verify_greedy(None, tree, greedy[0])
            runner.commit(path, tree.size)
            if on_step is not None:  # e.g. tree-budget calibration: the verified tree and its accepted path
                on_step(tree, path)
            batch = new_tokens.tolist()
            if drafter is not None:
                feed_features, feed_tokens = features[:, path], new_tokens.view(1, -1)
            stats.target_forwards += 1
            stats.accept_lengths.append(len(batch))
            stats.draft_time_s += t1 - t0
            stats.verify_time_s += time.perf_counter() - t1
        if streamer is not None:
            streamer.end()
        return new, stats


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits for the device's queued work (so timers measure work, not kernel launches)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def make_runner(model: nn.Module, feature_layers: list[int], kind: str = "auto", compile: bool = False):
    """The target runner: "static" (preallocated buffers), "eager" (DynamicCache) or "auto" (static where the
    architecture allows it, else eager with a one-line message)."""
    from .static_runner import StaticRunner, static_cache_supported

    if kind in ("auto", "static"):
        reason = static_cache_supported(model)
        if reason is None:
            return StaticRunner(model, feature_layers, compile=compile)
        if kind == "static":
            raise NotImplementedError(f"the static runner does not support {reason}")
        print(f"drafthead: {type(model).__name__} has {reason}; using the eager runner (DynamicCache)",
              file=sys.stderr)
    return TargetRunner(model, feature_layers)
