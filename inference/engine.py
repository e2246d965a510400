"""The decoding engine (library): SpeculativeGenerator — a drafter proposes a tree, the target verifies it in one
forward, repeat. The command line around it is inference/generate.py.

    gen = SpeculativeGenerator.from_pretrained(target_path, head_path, device="cpu", dtype="bfloat16")
    out = gen.generate(input_ids, max_new_tokens=128, temperature=0.0)
    out.sequences  # (1, prompt + new) ; out.stats.mean_accepted, out.stats.tokens_per_s, ...

The drafter (drafter.py) is an EAGLE head's dynamic tree, a smaller draft model, prompt lookup, or the head plus
prompt lookup (hybrid); the verification, the KV compaction and the stop handling here are shared by all.
Lossless: greedy output equals the target's own greedy decoding; sampled tokens follow the target's processed
distribution exactly (see verify.py). Stops (eos, stop strings, max_new_tokens) may land inside an accepted path;
the path is then cut where plain decoding would have stopped.
"""

from __future__ import annotations

import json
import numbers
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from drafthead import DraftHead, check_compatible, load_head
from drafthead.format import CONFIG_NAME, is_head_config
from drafthead.hardware import resolve_dtype, synchronizer
from drafthead.utils import parse_dtype, place_module
from drafthead.masks import causal_allowed

from .batch import decode_batch
from .batch_head import BatchHeadDrafter
from .batch_lookup import BatchLookupBranch
from .batch_runner import BatchRunner
from .batch_queue import left_pad, prefilled_requests
from .batch_switch import SpeculationSwitch
from .batch_tree import PlainBatchDrafter
from .draft_model import DraftModelDrafter, load_draft_model
from .draft_vocab import assistant_token_counts, default_corpus, frequent_tokens
from .drafter import Drafter, PlainDrafter
from .head_runner import head_runner_for
from .hybrid import HybridDrafter
from .loading import load_causal_lm, resolve_source
from .prompt_lookup import PromptLookupDrafter
from .runner import make_runner
from .self_draft import StreamingSelfDrafter
from .sampling import SamplingParams, pick_next, target_probs
from .static_runner import bucket_for, check_tree_fits, compile_setting
from .tree import DraftTree, TreeDrafter, TreeOptions, tree_options
from .verify import verify_greedy, verify_sampling


def accept_histogram(lengths: list[int]) -> dict[int, int]:
    """Accepted length (bonus included) -> number of verification steps with that length, sorted."""
    return dict(sorted(Counter(lengths).items()))


@dataclass
class GenerationStats:
    """tau = mean_accepted: tokens emitted per verification forward (accepted drafts + the bonus token)."""

    new_tokens: int = 0
    target_forwards: int = 0  # prefill + verifications
    accept_lengths: list[int] = field(default_factory=list)  # per verification, bonus included, before stops
    # per drafter of a hybrid (DraftTree.origin): drafted nodes proposed, and accepted, by each
    drafted_by: dict[str, int] = field(default_factory=dict)
    accepted_by: dict[str, int] = field(default_factory=dict)
    rows_new_tokens: list[int] = field(default_factory=list)  # batch: new tokens of each row
    rows_steps: list[int] = field(default_factory=list)  # batch: verifications each row took until it stopped
    # batch: the leading steps with every row of the batch decoding (continuous batching: until its queue runs dry
    # and rows start leaving): how many, the new tokens kept by then, and the seconds they took from the first step
    busy_steps: int = 0
    busy_tokens: int = 0
    busy_time_s: float = 0.0
    prefill_time_s: float = 0.0  # prompt forward + the drafter's begin (one row: also inside verify_time_s)
    admit_time_s: float = 0.0  # continuous batching: waiting requests loaded into freed rows
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0  # target forwards (prefill included) + verification + cache compaction
    plain_steps: int = 0  # batch with speculate="auto": steps that verified every row's root alone
    total_time_s: float = 0.0

    def count(self, tree: DraftTree, path: torch.Tensor, origin_names: tuple[str, ...]) -> None:
        """Record one verification: its accepted length and, when the tree names its drafters, who proposed what."""
        self.target_forwards += 1
        self.accept_lengths.append(path.shape[0])
        if tree.origin is None:
            return
        origin = tree.origin.tolist()  # a few dozen ints: count on the host, two transfers per step
        accepted = [origin[i] for i in path[1:].tolist()]
        for bit, name in enumerate(origin_names):
            self.drafted_by[name] = self.drafted_by.get(name, 0) + sum(o >> bit & 1 for o in origin[1:])
            self.accepted_by[name] = self.accepted_by.get(name, 0) + sum(o >> bit & 1 for o in accepted)

    @property
    def mean_accepted(self) -> float:
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def histogram(self) -> dict[int, int]:
        """accepted length -> number of verification steps."""
        return accept_histogram(self.accept_lengths)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(mean_accepted=self.mean_accepted, histogram=self.histogram, tokens_per_s=self.tokens_per_s)
        return d


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # (B, prompt + new) long; a batch's shorter rows are right-padded
    stats: GenerationStats


@dataclass
class QueueOutput:
    new_tokens: list[list[int]]  # each prompt's new tokens, in the prompts' order
    stats: GenerationStats


class Stopper:
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
    """A frozen target plus a drafter (drafter.py); see the module docstring.

    draft: a DraftHead (EAGLE-2 dynamic tree with the `tree` options; hybrid=True adds the prompt-lookup branch,
    also to a StreamingSelfDrafter's chains; in a batch at most `lookup_nodes` lookup tokens a row) or any
    drafter.Drafter (PromptLookupDrafter, DraftModelDrafter, ...). tree="none" (draft ignored, may be None):
    plain greedy/sampled decoding on the same runner (the baseline that separates what the runner buys from what
    speculation buys).

    speculate: "always", or "auto": batched decoding (B > 1, self-speculation, a streaming draft KV) speculates only
    on the steps where its measured cost pays and takes plain steps on the others (batch_switch.py); or a
    SpeculationSwitch of one's own. The output is the same either way.

    runner: "static" (preallocated KV buffers, fixed-shape verify buckets; static_runner.py), "eager" (any HF
    causal LM, DynamicCache; runner.py) or "auto" (static where the architecture allows, else eager with a one-line
    message), or a runner object to share (the benchmark shares one among its methods). compile: torch.compile
    the static runner's verify steps and the head's drafting steps (CUDA graphs on CUDA); "auto" compiles on CUDA
    only, because on a 2-core CPU each step shape costs ~30-45 s to compile and pays only over long runs (the
    benchmark compiles). The runner, its buffers and its compiled graphs live as long as the generator.
    """

    def __init__(self, target: nn.Module, draft: DraftHead | Drafter | None, tokenizer: Any = None,
                 tree: str | TreeOptions | None = "cpu", runner: Any = "auto", compile: bool | str = "auto",
                 hybrid: bool = False, lookup_tokens: int = 10, lookup_nodes: int = 1, draft_kv: str = "full",
                 sink: int = 4, window: int = 512, speculate: str | SpeculationSwitch = "always",
                 **tree_overrides: int | None):
        self.target = target.eval()
        self.tokenizer = tokenizer
        self.device = next(target.parameters()).device
        if isinstance(runner, str) and runner not in ("auto", "static", "eager"):
            raise ValueError(f"runner must be 'auto', 'static', 'eager' or a runner object, got {runner!r}")
        self.runner_kind, self.compile = runner, compile_setting(compile, self.device)
        self._runner = None if isinstance(runner, str) else runner  # a runner object is shared, e.g. by the bench
        self.head: DraftHead | None = None
        self.options: TreeOptions | None = None
        if draft_kv not in ("full", "streaming"):
            raise ValueError(f"draft_kv must be 'full' or 'streaming', got {draft_kv!r}")
        if isinstance(draft, DraftHead):
            check_compatible(draft.config, target.config)
            self.head = draft.eval()
        self._batch_runner: BatchRunner | None = None
        self._prefill_runner: BatchRunner | None = None  # generate_many: prefills the waiting prompts
        self.batch_drafter = None  # drafts for a batch (batch_tree.py); None where only one row is supported
        # always the batched path: self-speculation and windowed draft KV exist only there (B = 1 is a batch)
        self.batch_only = draft_kv == "streaming" or isinstance(draft, StreamingSelfDrafter)
        if tree == "none":  # plain decoding, whatever the draft
            self.drafter = PlainDrafter()
            self.batch_drafter = PlainBatchDrafter()
            self.batch_only = False
        elif isinstance(draft, StreamingSelfDrafter):
            self.drafter = draft
            self.batch_drafter = draft
        elif self.head is not None:
            self.options = tree_options(tree, **tree_overrides)
            self.drafter = TreeDrafter(self.head, self.options, head_runner_for(self.head, self.compile))
            streaming = dict(sink=sink, window=window) if draft_kv == "streaming" else {}
            self.batch_drafter = BatchHeadDrafter(self.head, self.options, **streaming)
            if hybrid:
                self.drafter = HybridDrafter(self.drafter, PromptLookupDrafter(lookup_tokens, min_ngram=2))
        elif draft is None:
            raise ValueError("a drafter is needed unless tree='none' (plain decoding)")
        elif isinstance(draft, Drafter):
            self.drafter = draft
            if draft_kv == "streaming":
                raise ValueError(f"draft_kv='streaming' applies to a head or to 'self', not to {draft.name}")
        else:
            raise TypeError(f"draft must be a DraftHead, a Drafter or None, got {type(draft).__name__}")
        if hybrid and not (isinstance(self.drafter, HybridDrafter) or isinstance(draft, StreamingSelfDrafter)):
            raise ValueError("hybrid=True adds prompt lookup to a draft head or to 'self'; this draft is neither")
        if hybrid and self.batch_drafter is not None:  # batches: each row's tree grows by `lookup_nodes` nodes
            self.batch_drafter = BatchLookupBranch(self.batch_drafter, lookup_tokens, lookup_nodes)
        self.plain = isinstance(self.drafter, PlainDrafter)
        if self._runner is not None and not self.batch_only:
            check_tree_fits(self.drafter, self._runner)
        # batched decoding: speculate on every step, or only where it pays (batch_switch.py)
        if isinstance(speculate, SpeculationSwitch):
            self.switch = speculate
        elif speculate in ("always", "auto"):
            self.switch = SpeculationSwitch() if speculate == "auto" else None
        else:
            raise ValueError(f"speculate must be 'always', 'auto' or a SpeculationSwitch, got {speculate!r}")

    @property
    def batch_runner(self) -> BatchRunner:
        """The target runner of batched generation (built on first use, then reused)."""
        if self._batch_runner is None:
            self._batch_runner = BatchRunner(self.target, self.batch_drafter.feature_layers, compile=self.compile)
        return self._batch_runner

    @property
    def runner(self):
        """The target runner (built on first use, then reused across generate calls; or the one passed in)."""
        if self._runner is None:
            self._runner = make_runner(self.target, self.drafter.feature_layers, self.runner_kind, self.compile,
                                       largest_tree=max(self.drafter.tree_sizes()))
        return self._runner

    def warmup(self, max_length: int) -> dict[int, float]:
        """Size the KV buffers for sequences of up to `max_length` tokens and run one verify step of every shape
        this generator's drafter uses (compiling it when compile is on), then the drafter's own steps. Returns the
        runner's {verify size: seconds of its first call} (empty for the eager runner, and for a batch-only
        drafter, whose batched steps run eagerly)."""
        if self.batch_only:
            return {}
        runner = self.runner
        runner.reserve(max_length)
        buckets = getattr(runner, "buckets", None)
        sizes = sorted({bucket_for(n, buckets) if buckets else n for n in self.drafter.tree_sizes()})
        # a prompt as long as the largest bucket: the compiled runner's prefill shape
        ids = torch.zeros(1, max(buckets[-1] if buckets else 4, 4), dtype=torch.long, device=self.device)
        with runner.session(), torch.inference_mode():
            runner.reset(ids.shape[1])
            runner.prefill(ids)
            for n in sizes:
                runner.verify(ids[:, :1].repeat(1, n), torch.arange(n, device=self.device),
                              causal_allowed(n, 0, self.device))
                runner.commit(torch.zeros(0, dtype=torch.long, device=self.device), n)
        self.drafter.warmup(max_length)
        if not self.plain:  # the drafter's steps in place (the head's: one graph per tree shape)
            depth = self.options.depth if self.options else max(self.drafter.tree_sizes())
            self.generate(ids, max_new_tokens=2 * depth + 2, eos_token_id=[])
        return dict(getattr(runner, "compile_s", {}))

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | nn.Module,
        draft: str | Path | DraftHead | Drafter | None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        tokenizer: Any = None,
        tree: str | TreeOptions | None = "cpu",
        depth: int | None = None,
        top_k: int | None = None,
        total_tokens: int | None = None,
        runner: str = "auto",
        compile: bool | str = "auto",
        hybrid: bool = False,
        gamma: int = 4,
        lookup_tokens: int = 10,
        lookup_nodes: int = 1,
        draft_kv: str = "full",
        sink: int = 4,
        window: int = 512,
        draft_vocab: int | None = None,
        speculate: str | SpeculationSwitch = "always",
        draft_weights: str = "same",
    ) -> "SpeculativeGenerator":
        """target: HF folder/name or a loaded causal LM; dtype: a name, a torch dtype, "auto" (bf16 on CUDA and on CPUs
        with native bf16, else fp32) or None (the checkpoint's). draft: a head folder (native or exported) or DraftHead;
        a smaller causal LM's folder (or model) sharing the target's tokenizer, drafting chains of `gamma` tokens;
        "prompt-lookup" (chains of up to `lookup_tokens` tokens copied from the context); "self" (the target drafts
        chains of `gamma` tokens for itself with a StreamingLLM KV of `sink` + `window` positions: MagicDec,
        self_draft.py); a Drafter; or None with tree="none". hybrid=True adds the prompt-lookup branch to a head's tree
        or to the self-draft's chains (in a batch, at most `lookup_nodes` of its `lookup_tokens` join each row's tree,
        where the chain leaves the drafter's nodes: batch_lookup.py). draft_kv="streaming" gives a head the same sink +
        window KV (the draft for long contexts). Raises drafthead.HeadMismatchError when a head was made for another
        target, TokenizerMismatchError when a draft model uses another tokenizer. draft_vocab=N: a head or the
        self-draft proposes only the N tokens that ShareGPT's assistant turns (the asset cache, draft_vocab.py) use most
        (a head's lm_head rows are pruned; the self-draft computes only those rows of the target's lm_head); output
        stays lossless. speculate="auto": batched decoding (B > 1, self-speculation, a streaming draft KV) speculates
        only on the steps where its measured cost pays, taking plain steps on the others (batch_switch.py); "always"
        speculates on every step. draft_weights="int8" (self-speculation): the draft multiplies with an int8 copy of the
        target's weights (half the bytes a draft step reads; the target verifies with its own: still lossless)."""
        if isinstance(draft, (str, Path)) and str(draft) not in ("prompt-lookup", "self"):
            # a local folder (head or model), else a Hub id where allowed; checked before the target loads
            draft = resolve_source(draft, "draft")
        if dtype == "auto":  # bf16 on CUDA and on CPUs with native bf16, else fp32 (drafthead.hardware)
            on = device or (next(target.parameters()).device if isinstance(target, nn.Module) else "cpu")
            dtype = resolve_dtype("auto", on)
        dtype = parse_dtype(dtype)
        model, tokenizer = load_causal_lm(target, dtype, tokenizer, what="target")
        model = place_module(model, device, dtype).eval()
        ref = next(model.parameters())
        if draft_vocab is not None and tokenizer is None:
            raise ValueError("draft_vocab counts tokens with the target's tokenizer: pass tokenizer=")
        if draft_weights != "same" and not (isinstance(draft, str) and draft == "self"):
            raise ValueError(f"draft_weights={draft_weights!r} applies to the self-draft (draft='self') only")
        if isinstance(draft, str) and draft == "prompt-lookup":
            draft = PromptLookupDrafter(lookup_tokens)
        elif isinstance(draft, str) and draft == "self":
            if draft_kv != "streaming":
                raise ValueError("self-speculation drafts with draft_kv='streaming' (a full-KV self draft is the "
                                 "target itself)")
            vocab = None if draft_vocab is None else frequent_tokens(
                tokenizer, model.get_output_embeddings().weight.shape[0], draft_vocab)
            draft = StreamingSelfDrafter(model, sink=sink, window=window, gamma=gamma,
                                         compile=compile_setting(compile, ref.device), vocab=vocab,
                                         weights=draft_weights)
        elif isinstance(draft, DraftHead):
            check_compatible(draft.config, model.config)
            draft = place_module(draft, ref.device, ref.dtype).attach_target(model)
        elif isinstance(draft, nn.Module) or (isinstance(draft, (str, Path)) and not is_head_folder(draft)):
            vocab = model.config.get_text_config(decoder=True).vocab_size
            draft = DraftModelDrafter(load_draft_model(draft, model, tokenizer), vocab, gamma=gamma, runner=runner,
                                      compile=compile_setting(compile, ref.device))
        elif isinstance(draft, (str, Path)):
            draft = load_head(draft, target=model, device=ref.device, dtype=ref.dtype)
        if draft_vocab is not None and isinstance(draft, DraftHead):
            draft = draft.pruned(assistant_token_counts(tokenizer, default_corpus(), draft.config.vocab_size),
                                 draft_vocab)
        elif draft_vocab is not None and not (isinstance(draft, StreamingSelfDrafter) and draft.vocab is not None):
            raise ValueError("draft_vocab applies to a head or to 'self', not to "
                             f"{getattr(draft, 'name', type(draft).__name__)}")
        return cls(model, draft, tokenizer, tree, runner=runner, compile=compile, hybrid=hybrid,
                   lookup_tokens=lookup_tokens, lookup_nodes=lookup_nodes, draft_kv=draft_kv, sink=sink,
                   window=window, speculate=speculate, depth=depth, top_k=top_k, total_tokens=total_tokens)

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor | Mapping[str, torch.Tensor],
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
        attention_mask: torch.Tensor | None = None,
    ) -> GenerationOutput:
        """Speculative generation for prompts (B, T), left-padded with their `attention_mask` when B > 1 (as
        transformers' generate takes a batch), or a tokenizer's output holding both. Arguments as in transformers'
        generate; explicit arguments win over `generation_config`. Greedy unless sampling is asked for (temperature > 0
        or do_sample). eos defaults to the target's generation_config.eos_token_id. Row i of `.sequences` is row i of
        input_ids followed by its new tokens (right-padded with the pad token to the longest row)."""
        t_start = time.perf_counter()
        gc = generation_config
        params, max_new_tokens, generator = self._settings(gc, temperature, top_k, top_p, do_sample, max_new_tokens,
                                                           seed, generator)
        stopper = self._stopper(gc, eos_token_id, stop, tokenizer, max_new_tokens)
        if isinstance(input_ids, Mapping):  # a tokenizer's output (BatchEncoding), e.g. apply_chat_template(...)
            attention_mask = input_ids.get("attention_mask") if attention_mask is None else attention_mask
            input_ids = input_ids["input_ids"]
        input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() > 2:
            raise ValueError(f"input_ids must be (B, T) or (T,), got {tuple(input_ids.shape)}")
        if input_ids.numel() == 0:
            raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): give at least one prompt token")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
        input_ids = input_ids.view(-1 if input_ids.dim() == 2 else 1, input_ids.shape[-1]).to(self.device)
        padded = attention_mask is not None and not bool(torch.as_tensor(attention_mask).all())
        if input_ids.shape[0] > 1 or padded or self.batch_only:
            return self._generate_batch(input_ids, attention_mask, params, gc, eos_token_id, stop, tokenizer,
                                        max_new_tokens, generator, streamer, t_start)
        runner = self.runner
        runner.reset(input_ids.shape[1] + max_new_tokens)
        with runner.session(), self.drafter.session():
            new, stats = self._decode(runner, input_ids, params, stopper, generator, streamer)
        stats.new_tokens = len(new)
        stats.total_time_s = time.perf_counter() - t_start
        out = torch.tensor(new, dtype=torch.long, device=self.device).view(1, -1)
        return GenerationOutput(torch.cat([input_ids, out], dim=1), stats)

    def _generate_batch(self, input_ids, attention_mask, params, gc, eos_token_id, stop, tokenizer,
                        max_new_tokens, generator, streamer, t_start) -> GenerationOutput:
        """Every row at once (batch.py): one target forward verifies all rows' trees."""
        self._require_batch_drafter()
        if streamer is not None:
            raise ValueError("a streamer follows one sequence: pass input_ids of batch size 1")
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        stoppers = [self._stopper(gc, eos_token_id, stop, tokenizer, max_new_tokens) for _ in range(b)]
        runner = self.batch_runner
        runner.reset(b, t + max_new_tokens + self.batch_drafter.tree_size)
        stats = GenerationStats()
        with runner.session():
            new = decode_batch(runner, self.batch_drafter, input_ids, attention_mask, params, stoppers, generator,
                               stats, synchronizer(self.device), switch=self.switch)
        stats.rows_new_tokens = [len(row) for row in new]
        stats.new_tokens = sum(stats.rows_new_tokens)
        stats.total_time_s = time.perf_counter() - t_start
        pad = self._pad_token(gc)
        width = max(stats.rows_new_tokens)
        out = torch.full((b, width), pad, dtype=torch.long, device=self.device)
        for i, row in enumerate(new):
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long, device=self.device)
        return GenerationOutput(torch.cat([input_ids, out], dim=1), stats)

    @torch.inference_mode()
    def generate_many(
        self,
        prompts: list[torch.Tensor] | list[list[int]],
        max_new_tokens: int | None = None,
        batch_size: int = 8,
        prefill_group: int = 8,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        do_sample: bool | None = None,
        eos_token_id: int | list[int] | None = None,
        stop: list[str] | str | None = None,
        generation_config: Any = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        tokenizer: Any = None,
    ) -> QueueOutput:
        """Generate for a queue of prompts (each 1-D token ids, any lengths) with continuous batching
        (batch_queue.py): `batch_size` rows decode at once and a finished row takes the next prompt, prefilled
        `prefill_group` at a time. Same outputs as generate() on each prompt alone (greedy: token for token in
        fp32); other arguments as in generate(). Returns each prompt's new tokens in the prompts' order."""
        t_start = time.perf_counter()
        self._require_batch_drafter()
        if batch_size < 1 or prefill_group < 1:
            raise ValueError(f"batch_size and prefill_group must be >= 1, got {batch_size} and {prefill_group}")
        gc = generation_config
        params, max_new_tokens, generator = self._settings(gc, temperature, top_k, top_p, do_sample, max_new_tokens,
                                                           seed, generator)
        prompts = [torch.as_tensor(p, dtype=torch.long).view(-1).to(self.device) for p in prompts]
        stats = GenerationStats()
        if not prompts:
            return QueueOutput([], stats)
        if min(len(p) for p in prompts) == 0:
            raise ValueError("every prompt needs at least one token")

        def stopper() -> Stopper:
            return self._stopper(gc, eos_token_id, stop, tokenizer, max_new_tokens)

        b = min(batch_size, len(prompts))
        ids, mask = left_pad(prompts[:b])
        waiting = None
        if len(prompts) > b:
            if self._prefill_runner is None:
                self._prefill_runner = BatchRunner(self.target, self.batch_drafter.feature_layers)
            waiting = prefilled_requests(self._prefill_runner, prompts[b:], prefill_group, stopper, stats)
        runner = self.batch_runner
        runner.reset(b, max(len(p) for p in prompts) + max_new_tokens + self.batch_drafter.tree_size)
        with runner.session():
            new = decode_batch(runner, self.batch_drafter, ids, mask, params, [stopper() for _ in range(b)],
                               generator, stats, synchronizer(self.device), waiting=waiting, switch=self.switch)
        stats.rows_new_tokens = [len(row) for row in new]
        stats.new_tokens = sum(stats.rows_new_tokens)
        stats.total_time_s = time.perf_counter() - t_start
        return QueueOutput(new, stats)

    def _settings(self, gc: Any, temperature, top_k, top_p, do_sample, max_new_tokens, seed, generator):
        """(sampling parameters, max_new_tokens, generator) from generate()'s arguments and the generation config:
        explicit arguments win; 20 new tokens by default; a generator seeded with `seed` where none is given."""
        params = SamplingParams.make(temperature, top_k, top_p, do_sample, gc)
        if max_new_tokens is None:
            max_new_tokens = getattr(gc, "max_new_tokens", None) or 20
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if generator is None and seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        return params, max_new_tokens, generator

    def _require_batch_drafter(self) -> None:
        if self.batch_drafter is None:
            raise NotImplementedError(f"batched generation supports plain decoding, an EAGLE head and "
                                      f"self-speculation; the {self.drafter.name} drafter takes one row at a time")

    def _pad_token(self, gc: Any) -> int:
        """The id that right-pads a batch's shorter rows: pad token, else eos, else 0 (as generate does)."""
        for name in ("pad_token_id", "eos_token_id"):
            for config in (gc, getattr(self.target, "generation_config", None), self.target.config):
                value = getattr(config, name, None)
                if isinstance(value, list):
                    value = value[0] if value else None
                if value is not None:
                    return int(value)
        return 0

    def _stopper(self, gc: Any, eos_token_id, stop, tokenizer, max_new_tokens: int) -> "Stopper":
        """Stop conditions from the arguments, else the generation config, else the target's eos."""
        if eos_token_id is None:
            eos_token_id = getattr(gc, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(getattr(self.target, "generation_config", None), "eos_token_id", None)
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
        if stop is None:
            stop = getattr(gc, "stop_strings", None)
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        return Stopper(eos, stop, tokenizer or self.tokenizer, max_new_tokens)

    def _decode(self, runner, input_ids, params, stopper, generator, streamer):
        """The decoding loop. Host syncs per step, each needed: the accepted tokens (`.tolist()`: stop checks and
        the streamer), the accepted path (`nonzero` in verify_greedy; sampling walks the tree on the host) and the
        "is the path already in place" test in the runner's commit; on CUDA the timers also synchronise. The head
        drafts on the device (top-k frontier, tree selection, ancestor masks); prompt lookup and the hybrid merge
        work on host lists of at most a few dozen tokens; origin statistics read the path's origins."""
        stats = GenerationStats()
        sync = synchronizer(self.device)
        drafter = self.drafter
        if streamer is not None:
            streamer.put(input_ids.cpu())
        t0 = time.perf_counter()
        logits, features = runner.prefill(input_ids)
        first = pick_next(logits, params, generator)
        stats.target_forwards += 1
        drafter.begin(input_ids, features, input_ids.shape[1] + stopper.max_new)
        sync()
        stats.prefill_time_s = time.perf_counter() - t0
        stats.verify_time_s += stats.prefill_time_s
        new: list[int] = []
        batch, root = first.tolist(), first.view(1)  # root: the last emitted token, on the device
        while True:
            keep = stopper.cut(new, batch)
            emitted = batch if keep is None else batch[:keep]
            new += emitted
            if streamer is not None and emitted:
                streamer.put(torch.tensor(emitted))
            if keep is not None:
                break
            t0 = time.perf_counter()
            tree = drafter.propose(root, params, generator)
            sync()
            t1 = time.perf_counter()
            logits, features, greedy = runner.verify(tree.tokens, tree.depths, tree.ancestors)
            if params.do_sample:
                path, new_tokens = verify_sampling(target_probs(logits[0], params), tree, generator)
            else:
                path, new_tokens = verify_greedy(None, tree, greedy[0])
            runner.commit(path, tree.size)
            drafter.accept(path, new_tokens, features)
            batch, root = new_tokens.tolist(), new_tokens[-1:]
            stats.count(tree, path, drafter.origin_names)
            stats.draft_time_s += t1 - t0
            stats.verify_time_s += time.perf_counter() - t1
        if streamer is not None:
            streamer.end()
        return new, stats


def is_head_folder(path: str | Path) -> bool:
    """True for a draft-head folder (native or EAGLE serving format), False for a plain causal LM's folder."""
    config = Path(path) / CONFIG_NAME
    if not config.exists():
        return False
    return is_head_config(json.loads(config.read_text()))

