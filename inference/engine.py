"""The decoding engine (library): SpeculativeGenerator, a drafter proposes trees, the target verifies them in one
forward, repeat, for every row of a batch at once (batch 1 is B = 1). The command line around it is generate.py.

    gen = SpeculativeGenerator.from_pretrained(target_path, head_path)  # tree="auto": tuned once per machine
    out = gen.generate(input_ids, max_new_tokens=128, temperature=0.0)
    out.sequences  # (B, prompt + new) ; out.stats.mean_accepted, out.stats.tokens_per_s, ...

The drafters live in drafters/, the target's runners in runners/, the loop that verifies, commits and stops for all
of them in decode.py. Greedy output equals the target's own greedy decoding; sampled tokens follow the target's
processed distribution exactly (verify.py), and a stop inside an accepted path cuts it where plain decoding would.
"""

from __future__ import annotations

import json
import numbers
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence

from drafthead import DraftHead, check_compatible, load_head
from drafthead.format import CONFIG_NAME, is_head_config
from drafthead.hardware import auto_dtype, synchronizer
from drafthead.utils import dtype_name, parse_dtype, place_module

from .decode import decode, left_pad, prefilled_requests
from .tuning.budget import median_ms
from .tuning.draft_vocab import assistant_token_counts, default_corpus, frequent_tokens
from .drafter import Drafter, PlainDrafter
from .drafters.draft_model import DraftModelDrafter, load_draft_model
from .drafters.eagle import HeadDrafter
from .drafters.lookup import LookupBranch, prompt_lookup
from .drafters.self_draft import StreamingSelfDrafter
from .loading import load_causal_lm, resolve_source
from .runners import StaticRunner, make_runner
from .runners.compile import compile_setting
from .runners.static import bucket_for
from .sampling import SamplingParams
from .stats import GenerationStats
from .stopping import Stopper
from .switch import SpeculationSwitch
from .tree import DraftTree, TreeOptions, tree_options

# a one-row generation of at least this many tokens that decodes below SLOW_MARGIN x the tuning's plain rate warns
# (one that used a new step shape is not judged: it compiled or loaded the step)
SLOW_CHECK_TOKENS = 32
SLOW_MARGIN = 0.95


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # (B, prompt + new) long; a batch's shorter rows are right-padded
    stats: GenerationStats


@dataclass
class QueueOutput:
    new_tokens: list[list[int]]  # each prompt's new tokens, in the prompts' order
    stats: GenerationStats


class SpeculativeGenerator:
    """A frozen target plus a drafter; from_pretrained documents the arguments they share.

    draft: a DraftHead (EAGLE-2 dynamic trees shaped by `tree` and the depth / top_k / total_tokens overrides), a
    StreamingSelfDrafter, any drafter.Drafter (prompt_lookup(), DraftModelDrafter, ...) or None with tree="none".
    tree="auto" needs the tokenizer (without one: the "cpu" preset). speculate may also be a SpeculationSwitch of
    one's own. runner: "static" (preallocated KV buffers, fixed-shape verify buckets; runners/static.py), "eager" (any
    HF causal LM, one row, DynamicCache; runners/eager.py), "auto" (static where the architecture allows, else eager
    with a one-line message) or a runner object to share (the benchmark shares one among its methods). The runner,
    its buffers and its compiled graphs live as long as the generator.
    """

    def __init__(self, target: nn.Module, draft: DraftHead | Drafter | None, tokenizer: Any = None,
                 tree: str | TreeOptions | None = "cpu", runner: Any = "auto", compile: bool | str = "auto",
                 hybrid: bool | None = None, lookup_tokens: int = 10, lookup_nodes: int | None = None,
                 draft_kv: str = "full", sink: int = 4, window: int = 512,
                 speculate: str | SpeculationSwitch = "always", draft_weights: str = "auto", profile: bool = False,
                 **tree_overrides: int | None):
        self.target = target.eval()
        self.tokenizer = tokenizer
        self.device = next(target.parameters()).device
        if isinstance(runner, str) and runner not in ("auto", "static", "eager"):
            raise ValueError(f"runner must be 'auto', 'static', 'eager' or a runner object, got {runner!r}")
        tuned = tree == "auto" and isinstance(draft, DraftHead) and tokenizer is not None
        self.runner_kind, self.compile = runner, compile_setting(compile, self.device, tuned)
        self._runner = None if isinstance(runner, str) else runner  # a runner object is shared, e.g. by the bench
        self._prefill_runner: StaticRunner | None = None  # generate_many: prefills the waiting prompts
        self._owned: list = []  # the runners this generator made (a runner passed in stays its owner's)
        self.profile = profile
        self.head: DraftHead | None = None
        self.options: TreeOptions | None = None
        self.tuned = None  # tree="auto": the tuning's choice and measured rates (tuning/auto.py)
        self._warned_slow = False
        if draft_kv not in ("full", "streaming"):
            raise ValueError(f"draft_kv must be 'full' or 'streaming', got {draft_kv!r}")
        if tree == "auto" and isinstance(draft, DraftHead):
            tree, hybrid, lookup_tokens = self._tune(draft, hybrid, lookup_tokens, draft_weights)
        if tree == "none":  # plain decoding, whatever the draft (with hybrid=True: prompt lookup alone)
            self.drafter = PlainDrafter()
        elif isinstance(draft, DraftHead):
            check_compatible(draft.config, target.config)
            self.head = draft.eval()
            self.options = tree_options(tree, **tree_overrides)
            streaming = dict(sink=sink, window=window) if draft_kv == "streaming" else {}
            self.drafter = HeadDrafter(self.head, self.options, compile=self.compile, weights=draft_weights,
                                       **streaming)
        elif draft is None:
            raise ValueError("a drafter is needed unless tree='none' (plain decoding)")
        elif isinstance(draft, Drafter):
            self.drafter = draft
            if draft_weights not in ("auto", "same"):
                raise ValueError("draft_weights applies to a DraftHead; a drafter object takes its own (e.g. "
                                 "StreamingSelfDrafter(weights='int8'))")
            if draft_kv == "streaming" and not isinstance(draft, StreamingSelfDrafter):
                raise ValueError(f"draft_kv='streaming' applies to a head or to 'self', not to {draft.name}")
        else:
            raise TypeError(f"draft must be a DraftHead, a Drafter or None, got {type(draft).__name__}")
        if hybrid:  # (None: off, unless tree="auto" chose the branch)
            if not isinstance(self.drafter, (HeadDrafter, StreamingSelfDrafter, PlainDrafter)):
                raise ValueError("hybrid=True adds prompt lookup to a draft head, to 'self' or to tree='none'; this "
                                 "draft is none of them")
            self.drafter = LookupBranch(self.drafter, lookup_tokens, lookup_nodes)
        self.plain = isinstance(self.drafter, PlainDrafter)
        if self._runner is not None:
            self._check_runner(self._runner)
        if speculate in ("always", "auto"):
            speculate = SpeculationSwitch() if speculate == "auto" else None
        elif not isinstance(speculate, SpeculationSwitch):
            raise ValueError(f"speculate must be 'always', 'auto' or a SpeculationSwitch, got {speculate!r}")
        self.switch = speculate

    def _tune(self, head: DraftHead, hybrid: bool | None, lookup_tokens: int, draft_weights: str) -> tuple:
        """tree="auto": (tree or "none", hybrid, lookup_tokens) as tuned (or cached) for this machine on the runner
        this generator then keeps; without a tokenizer (no prompts to tune on), the "cpu" preset."""
        from .tuning.auto import tuned_tree  # (the tuner builds generators itself)

        if self.tokenizer is None:
            print("[drafthead] tree='auto' tunes on a few chat prompts and needs the target's tokenizer "
                  "(pass tokenizer=): using the 'cpu' preset", file=sys.stderr)
            return "cpu", bool(hybrid), lookup_tokens
        if self._runner is None:
            self._runner = self._make_runner(head.config.aux_layer_ids)
        self.tuned = tuned_tree(self.target, head, self.tokenizer, self._runner, self.compile,
                                lookup_tokens if hybrid is None else 0, type(self), draft_weights)
        if isinstance(self._runner, StaticRunner):
            self._runner.min_capacity = self.tuned.capacity
        if hybrid is None and self.tuned.lookup_tokens:
            hybrid, lookup_tokens = True, self.tuned.lookup_tokens
        return self.tuned.tree or "none", bool(hybrid), lookup_tokens

    def _make_runner(self, feature_layers: list[int], **options: Any):
        """A runner this generator owns, announced by one line when it compiles (minutes on a CPU)."""
        runner = make_runner(self.target, feature_layers, self.runner_kind, self.compile, **options)
        self._owned.append(runner)
        if self.compile:
            where = "several minutes on a CPU" if self.device.type == "cpu" else "about a minute"
            print(f"[drafthead] compile on: each decoding step shape compiles on its first use ({where}; "
                  "compile=False skips it)", file=sys.stderr, flush=True)
        return runner

    @property
    def runner(self):
        """The target runner (built on first use, then reused across generate calls; or the one passed in)."""
        if self._runner is None:
            self._runner = self._make_runner(self.drafter.feature_layers, largest_tree=self.drafter.tree_size)
            self._check_runner(self._runner)
        return self._runner

    def close(self) -> None:
        """Free the buffers and compiled steps, and give the models back as they were handed over (hooks, linear
        classes); dropping the generator does the same once it is collected."""
        for runner in self._owned:
            runner.close()
        self._owned.clear()
        getattr(self.drafter, "close", lambda: None)()

    def __enter__(self) -> "SpeculativeGenerator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_runner(self, runner) -> None:
        """Refuse, before decoding starts, a runner this drafter cannot use."""
        buckets = getattr(runner, "buckets", None)
        if buckets and self.drafter.tree_size > buckets[-1]:
            raise ValueError(f"the {self.drafter.name} drafter's trees reach {self.drafter.tree_size} tokens (root "
                             f"included) but the runner's largest verify bucket is {buckets[-1]}: draft a smaller "
                             "tree (or fewer lookup_tokens) or use a runner with a larger bucket")
        if not isinstance(runner, StaticRunner) and isinstance(getattr(self.drafter, "drafter", self.drafter),
                                                               StreamingSelfDrafter):
            raise NotImplementedError("self-speculation copies its KV from the static runner's buffers; this "
                                      "target runs on the eager runner")

    def warmup(self, max_length: int) -> dict[int, float]:
        """Size the KV buffers for one row of up to `max_length` tokens and run one verify step of every bucket this
        generator's drafter may use (compiling it when compile is on), then a short generation (the drafter's own
        steps). Returns {bucket: seconds of its first verify step} (empty on the eager runner)."""
        runner = self.runner
        buckets = getattr(runner, "buckets", None)
        ids = torch.zeros(1, 4, dtype=torch.long, device=self.device)
        seconds = {}
        if buckets:
            runner.reset(1, max_length + self.drafter.tree_size)  # before the session, which depends on the rows
            with runner.session(), torch.inference_mode():
                runner.prefill(ids)
                # a drafter's trees never go below its smallest; plain steps (speculate="auto") verify the root alone;
                # the largest first, whose compiled graph the smaller may share (static.py)
                sizes = range(getattr(self.drafter, "smallest_tree", 1), self.drafter.tree_size + 1)
                for n in sorted({bucket_for(n, buckets) for n in sizes} | ({1} if self.switch else set()))[::-1]:
                    tree = DraftTree.chain(ids[0, :1], ids[:, :1].repeat(1, n - 1))
                    seconds[n] = median_ms(lambda: runner.verify(tree.tokens, tree.depths, tree.ancestors), 1,
                                            self.device) / 1000
        if not self.plain:
            self.generate(ids, max_new_tokens=8, eos_token_id=[])
        return seconds

    @classmethod
    def from_pretrained(cls, target: str | Path | nn.Module, draft: str | Path | DraftHead | Drafter | None,
                        device: str | torch.device | None = "auto", dtype: str | torch.dtype | None = None,
                        tokenizer: Any = None, tree: str | TreeOptions | None = "auto", depth: int | None = None,
                        branching: int | None = None, total_tokens: int | None = None, runner: str = "auto",
                        compile: bool | str = "auto", hybrid: bool | None = None, gamma: int = 4,
                        lookup_tokens: int = 10, lookup_nodes: int | None = None, draft_kv: str = "full",
                        sink: int = 4, window: int = 512, draft_vocab: int | None = None,
                        speculate: str | SpeculationSwitch = "always", draft_weights: str = "auto",
                        profile: bool = False, top_k: int | None = None) -> "SpeculativeGenerator":
        """target: HF folder/name, a GGUF file (its Q8_0 / Q6_K / Q5_0 / Q4_0 / Q4_1 / Q4_K blocks kept for the decoding
        steps on a CPU, in float32 or bf16: cpu/gguf_weights.py) or a loaded causal LM. device: "auto" (CUDA when present,
        else CPU; a loaded model stays where it is) or a device. dtype: a name or torch dtype; "fast" (bf16 on CUDA and
        on CPUs with native bf16, else fp32); "auto" (the checkpoint's, as in transformers); None (the default): "fast"
        for a checkpoint, a loaded model keeps its own.
        draft: a head folder (native or exported) or DraftHead; a smaller causal LM's folder (or model) sharing the
        target's tokenizer, drafting chains of `gamma` tokens; "prompt-lookup" (chains of up to `lookup_tokens`
        tokens copied from the context); "self" (the target drafts chains of `gamma` tokens for itself with a
        StreamingLLM KV of `sink` + `window` positions: MagicDec, self_draft.py); a Drafter; or None with tree="none".
        Raises drafthead.HeadMismatchError for a head made for another target, TokenizerMismatchError for a draft
        model with another tokenizer.
        tree: "auto" (the default: the tree tuned once for this target, head, machine and dtype, then cached on disk,
        tuning/auto.py; with hybrid=None it also decides whether the prompt-lookup branch pays), a preset ("cpu",
        "gpu", "chain"), "depth,branching,total_tokens", a TreeOptions, or "none": plain decoding on the same runner
        (the baseline that separates what the runner buys from what speculation buys; with hybrid=True, prompt
        lookup alone). depth / branching (children per node; top_k= is its deprecated name) / total_tokens override it.
        hybrid=True adds the prompt-lookup branch to a head's tree or to the self-draft's chains (at most
        `lookup_nodes` of its `lookup_tokens` join each row's tree: drafters/lookup.py). draft_kv="streaming" gives a
        head the same sink + window KV (the draft for long contexts). draft_vocab=N: a head or the self-draft
        proposes only the N tokens ShareGPT's assistant turns use most (tuning/draft_vocab.py); still lossless.
        draft_weights: "int8": a head (or the self-draft) drafts with an int8 copy of its weights (of the target's for
        'self'), still lossless (the target verifies); "auto" (the default): a float32 head does so on a CPU (its
        activations stay float32, a quarter of the bytes a drafting depth); "same": its own weights.
        speculate="auto": speculate only on the steps where its measured cost pays, plain steps on the others
        (switch.py); "always" speculates on every step; the output is the same either way.
        compile: torch.compile the runner's verify steps (CUDA graphs on CUDA); "auto" compiles on CUDA, and on a CPU
        with tree="auto" (every step shape then compiles for minutes, after a notice). profile=True waits for the
        device between drafting and verification, so that stats split their times on CUDA."""
        if top_k is not None:
            warnings.warn("from_pretrained(top_k=) is now branching= (top_k is sampling's, in generate); "
                          "top_k= goes in the next release", DeprecationWarning, stacklevel=2)
            branching = top_k if branching is None else branching
        if isinstance(draft, (str, Path)) and str(draft) not in ("prompt-lookup", "self"):
            # a local folder (head or model), else a Hub id where allowed; checked before the target loads
            draft = resolve_source(draft, "draft")
        loaded = isinstance(target, nn.Module)
        if device == "auto":
            device = None if loaded else ("cuda" if torch.cuda.is_available() else "cpu")
        if dtype == "fast" or (dtype is None and not loaded):  # bf16 on CUDA or native-bf16 CPUs, else fp32
            dtype = auto_dtype(device or (next(target.parameters()).device if loaded else "cpu"))
        elif dtype == "auto":  # the checkpoint's (transformers' meaning); a loaded model keeps its own
            dtype = None
        dtype = parse_dtype(dtype)
        model, tokenizer = load_causal_lm(target, dtype, tokenizer, what="target")
        model = place_module(model, device, dtype).eval()
        ref = next(model.parameters())
        fastest = auto_dtype(ref.device)
        if dtype is None and not loaded and ref.dtype != fastest:  # the meaning that changed
            warnings.warn(f"dtype='auto' keeps the checkpoint's {dtype_name(ref.dtype)} (as in transformers); the "
                          f"hardware's fastest ({dtype_name(fastest)} here), which 'auto' meant "
                          "before, is dtype='fast' (the default)", FutureWarning, stacklevel=2)
        if draft_vocab is not None and tokenizer is None:
            raise ValueError("draft_vocab counts tokens with the target's tokenizer: pass tokenizer=")
        if isinstance(draft, str) and draft == "prompt-lookup":
            draft = prompt_lookup(lookup_tokens)
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
        if draft_weights not in ("auto", "same") and not isinstance(draft, (DraftHead, StreamingSelfDrafter)):
            raise ValueError(f"draft_weights={draft_weights!r} applies to a head or to the self-draft (draft='self'), "
                             f"not to {getattr(draft, 'name', type(draft).__name__)}")
        return cls(model, draft, tokenizer, tree, runner=runner, compile=compile, hybrid=hybrid,
                   lookup_tokens=lookup_tokens, lookup_nodes=lookup_nodes, draft_kv=draft_kv, sink=sink,
                   window=window, speculate=speculate, profile=profile, depth=depth, top_k=branching,
                   # the self-draft took its weights above; the others were refused there
                   draft_weights=draft_weights if isinstance(draft, DraftHead) else "auto", total_tokens=total_tokens)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor | Mapping[str, torch.Tensor], max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 do_sample: bool | None = None, eos_token_id: int | list[int] | None = None,
                 stop_strings: list[str] | str | None = None, streamer: Any = None, generation_config: Any = None,
                 seed: int | None = None, generator: torch.Generator | None = None, tokenizer: Any = None,
                 attention_mask: torch.Tensor | None = None, stop: list[str] | str | None = None) -> GenerationOutput:
        """Speculative generation for prompts (B, T), left-padded with their `attention_mask` when B > 1 (as
        transformers' generate takes a batch), or a tokenizer's output holding both. Arguments as in transformers'
        generate; explicit arguments win over `generation_config`. Greedy unless sampling is asked for (temperature > 0
        or do_sample). eos defaults to the target's generation_config.eos_token_id. Row i of `.sequences` is row i of
        input_ids followed by its new tokens (right-padded with the pad token to the longest row). A streamer
        follows one row. `stop=` is the deprecated name of stop_strings."""
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
        b, t = input_ids.shape
        if streamer is not None and b > 1:
            raise ValueError("a streamer follows one sequence: pass input_ids of batch size 1")
        mask = torch.ones_like(input_ids) if attention_mask is None else torch.as_tensor(attention_mask)
        new, stats = self._run(input_ids, mask.view(b, t).to(self.device), streamer=streamer,
                               max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                               do_sample=do_sample, eos_token_id=eos_token_id, stop_strings=stop_strings,
                               generation_config=generation_config, seed=seed, generator=generator,
                               tokenizer=tokenizer, stop=stop)
        out = pad_sequence([torch.tensor(row, dtype=torch.long) for row in new], batch_first=True,
                           padding_value=self._pad_token(generation_config))
        return GenerationOutput(torch.cat([input_ids, out.to(self.device)], dim=1), stats)

    @torch.inference_mode()
    def generate_many(self, prompts: list[torch.Tensor] | list[list[int]], max_new_tokens: int | None = None,
                      batch_size: int = 8, prefill_group: int = 8, **settings: Any) -> QueueOutput:
        """Generate for a queue of prompts (each 1-D token ids, any lengths) with continuous batching: `batch_size`
        rows decode at once and a finished row takes the next prompt, prefilled `prefill_group` at a time
        (decode.prefilled_requests). Same outputs as generate() on each prompt alone (greedy: token for token in
        fp32); the other settings (temperature, top_p, top_k, do_sample, eos_token_id, stop_strings,
        generation_config, seed, generator, tokenizer) as in generate(). Returns each prompt's new tokens in the
        prompts' order."""
        if batch_size < 1 or prefill_group < 1:
            raise ValueError(f"batch_size and prefill_group must be >= 1, got {batch_size} and {prefill_group}")
        prompts = [torch.as_tensor(p, dtype=torch.long).view(-1).to(self.device) for p in prompts]
        if not prompts:
            return QueueOutput([], GenerationStats())
        if min(len(p) for p in prompts) == 0:
            raise ValueError("every prompt needs at least one token")
        ids, mask = left_pad(prompts[:batch_size])
        new, stats = self._run(ids, mask, prompts[batch_size:], prefill_group, max_new_tokens=max_new_tokens,
                               **settings)
        return QueueOutput(new, stats)

    def _run(self, ids: torch.Tensor, mask: torch.Tensor, queue: list[torch.Tensor] = (), prefill_group: int = 8,
             streamer: Any = None, **settings: Any) -> tuple[list[list[int]], GenerationStats]:
        """Decode the left-padded rows `ids` (B, T), then the `queue` of waiting prompts in the rows that free up;
        `settings`: generate()'s sampling and stopping arguments. Returns each row's (then each queued prompt's) new
        tokens and the stats."""
        t_start = time.perf_counter()
        params, max_new_tokens, generator, stopper = self._settings(**settings)
        stats = GenerationStats()
        waiting = None
        if queue:
            if self._prefill_runner is None:
                self._prefill_runner = StaticRunner(self.target, self.drafter.feature_layers)
                self._owned.append(self._prefill_runner)
            waiting = prefilled_requests(self._prefill_runner, queue, prefill_group, stopper, stats)
        runner = self.runner
        longest = max([ids.shape[1]] + [len(p) for p in queue])
        runner.reset(ids.shape[0], longest + max_new_tokens + self.drafter.tree_size)
        steps_used = len(getattr(runner, "shapes", ()))  # a generation that adds a step shape is not judged below
        sync = synchronizer(self.device) if self.profile else (lambda: None)
        with runner.session(), self.drafter.session():
            new = decode(runner, self.drafter, ids, mask, params, [stopper() for _ in range(ids.shape[0])],
                         generator, stats, sync, waiting=waiting, switch=self.switch, streamer=streamer)
        stats.rows_new_tokens = [len(row) for row in new]
        stats.new_tokens = sum(stats.rows_new_tokens)
        stats.total_time_s = time.perf_counter() - t_start
        if ids.shape[0] == 1 and not queue and len(getattr(runner, "shapes", ())) == steps_used:
            self._warn_if_slow(stats)
        return new, stats

    def _warn_if_slow(self, stats: GenerationStats) -> None:
        """Warn once when a one-row generation (not too short to tell) decoded slower than the tuning's plain rate."""
        if self.tuned is None or self.plain or self._warned_slow or stats.new_tokens < SLOW_CHECK_TOKENS:
            return
        rate = stats.new_tokens / max(stats.total_time_s - stats.prefill_time_s, 1e-9)
        if rate < SLOW_MARGIN * self.tuned.plain_tokens_per_s:
            self._warned_slow = True
            warnings.warn(f"speculative decoding ran at {rate:.1f} tokens/s, below the "
                          f"{self.tuned.plain_tokens_per_s:.1f} tokens/s that plain decoding measured on this machine "
                          "(tree='none' decodes without speculation)",
                          RuntimeWarning, stacklevel=5)  # the caller of generate

    def _settings(self, max_new_tokens: int | None = None, temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None, do_sample: bool | None = None,
                  eos_token_id: int | list[int] | None = None, stop_strings: list[str] | str | None = None,
                  generation_config: Any = None, seed: int | None = None, generator: torch.Generator | None = None,
                  tokenizer: Any = None,
                  stop: list[str] | str | None = None) -> tuple[SamplingParams, int, torch.Generator | None, Any]:
        """(sampling parameters, max_new_tokens (20 by default), generator, a maker of one row's Stopper) from
        generate()'s arguments, which win over the generation config (then the target's own for eos)."""
        if stop is not None:  # stop_strings' deprecated name, kept for one release
            warnings.warn("generate(stop=) is now stop_strings= (as in transformers); stop= goes in the next release",
                          DeprecationWarning, stacklevel=5)  # user, torch's inference_mode wrapper, generate, _run
            if stop_strings is not None:
                raise ValueError("pass stop_strings= only (stop= is its deprecated name)")
            stop_strings = stop
        gc = generation_config
        params = SamplingParams.make(temperature, top_k, top_p, do_sample, gc)
        if max_new_tokens is None:
            max_new_tokens = getattr(gc, "max_new_tokens", None) or 20
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if generator is None and seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        if eos_token_id is None:
            eos_token_id = getattr(gc, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(getattr(self.target, "generation_config", None), "eos_token_id", None)
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
        stop = getattr(gc, "stop_strings", None) if stop_strings is None else stop_strings
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        return params, max_new_tokens, generator, lambda: Stopper(eos, stop, tokenizer or self.tokenizer,
                                                                  max_new_tokens)

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


def is_head_folder(path: str | Path) -> bool:
    """True for a draft-head folder (native or EAGLE serving format), False for a plain causal LM's folder."""
    config = Path(path) / CONFIG_NAME
    return config.exists() and is_head_config(json.loads(config.read_text()))

