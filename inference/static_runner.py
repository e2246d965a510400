"""Fast target runner: preallocated KV buffers written in place, fixed-shape verify steps, optional torch.compile.

Same contract as the eager runner (runner.py): prefill(), verify() of a tree with an ancestor mask and explicit
positions returning logits + the head's features, commit() of the accepted nodes. Differences:

- KV lives in transformers' `StaticCache` (one buffer per layer, `capacity` slots). A step writes its n tokens at
  slots past..past+n-1 (StaticLayer.update advances its `cumulative_length`); commit() gathers the accepted slots
  down to past..past+k-1 with index_copy_ and sets the length back. Nothing is concatenated or reallocated per step,
  and the buffers keep their addresses (what CUDA graphs need).
- A tree is padded to the next size in `buckets`, so each bucket is one shape: one compiled graph (one CUDA graph)
  per bucket, never a recompile while generating. Padded nodes attend only to themselves and are never kept. On
  CPU the linears of buckets up to small_gemm.KERNEL_ROWS tokens run small_gemm's kernel (bf16 on AVX512-BF16);
  elsewhere buckets of up to SMALL_GEMM_ROWS tokens compile inductor's own C++ GEMMs, larger ones oneDNN's
  (compile_step).
- The attention mask spans the whole buffer, (1, 1, n, capacity): 0 on the cached prefix and on each node's
  ancestors, dtype-min elsewhere (transformers passes a 4D mask through unchanged).
- Feature hooks stay registered for the runner's lifetime (compile traces them once).

The runner lives as long as its generator: reset() starts a new sequence in the same buffers; a sequence that
does not fit grows the buffers (which costs one recompile per bucket): size them up front with reserve().
"""

from __future__ import annotations

import contextlib
import time
import types
from typing import Callable

import torch
import torch.nn as nn
from transformers import StaticCache

from drafthead.capture import HiddenStateCapture
from drafthead.masks import buffer_mask, causal_allowed
from drafthead.utils import cache_argument

from .attention import attention_implementation, decoding_attention, kv_length_kwargs
from .small_gemm import KERNEL_ROWS, FuseSiblingLinears, small_row_kernel, use_small_row_kernel

DEFAULT_BUCKETS = (1, 4, 8, 12, 16, 32, 64)
# CPU without the small-row kernel: verify buckets up to this many tokens are compiled with inductor's C++ GEMM
# templates (see compile_step)
SMALL_GEMM_ROWS = 4
# a compiled prefill runs the prompt in near-equal chunks of at most this many rows, each of at least
# PREFILL_MIN_ROWS (more rows than small_gemm's kernel takes: every chunk goes through oneDNN in the same graph)
PREFILL_CHUNK = 128
PREFILL_MIN_ROWS = KERNEL_ROWS + 1
MIN_CAPACITY = 256
CAPACITY_STEP = 128


def static_cache_supported(model: nn.Module) -> str | None:
    """None if the model can run on static buffers, else the reason (sliding-window or non-attention layers)."""
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"sliding-window attention (window {config.sliding_window})"
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"layer types {sorted(kinds)}"
    return None


def buffer_capacity(need: int) -> int:
    """Slots of a preallocated KV buffer holding `need` tokens. Attention reads the whole buffer every step, so
    keep it tight: the next multiple of 128, at least MIN_CAPACITY."""
    return max(MIN_CAPACITY, -(-need // CAPACITY_STEP) * CAPACITY_STEP)


def static_cache(model: nn.Module, batch: int, capacity: int) -> StaticCache:
    """transformers' StaticCache for `batch` rows of `capacity` slots, allocated now in the model's dtype and
    device (so a compiled step sees fixed buffer addresses from its first call). Every layer's keys and values
    are views of ONE tensor, `cache.drafthead_kv` (2, layers, batch, kv_heads, capacity, head_dim), and every
    layer's write position a view of `cache.drafthead_lengths` (layers,): moving the accepted slots of all layers
    (compact_slots) and setting the write slot (set_write_slot) are one op each instead of one per layer (SmolLM2:
    120 -> 2 and 30 -> 1 ops a step, ~0.15 ms on a 2-core EPYC)."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    ref = next(model.parameters())
    cache = StaticCache(config=config, max_cache_len=capacity)
    cache.early_initialization(batch, heads, head_dim, ref.dtype, ref.device)
    kv = torch.zeros(2, len(cache.layers), batch, heads, capacity, head_dim, dtype=ref.dtype, device=ref.device)
    lengths = torch.zeros(len(cache.layers), dtype=cache.layers[0].cumulative_length.dtype, device=ref.device)
    for i, layer in enumerate(cache.layers):
        layer.keys, layer.values, layer.cumulative_length = kv[0, i], kv[1, i], lengths[i]
        for t in (layer.keys, layer.values, layer.cumulative_length):  # as StaticLayer does (CUDA graphs)
            torch._dynamo.mark_static_address(t)
    cache.drafthead_kv, cache.drafthead_lengths = kv, lengths
    return cache


def set_write_slot(cache: StaticCache, slot: int) -> None:
    """The next tokens a forward writes into `cache` land at slots slot, slot+1, ... of every layer (transformers'
    StaticLayer writes at its cumulative length, a tensor updated in place)."""
    cache.drafthead_lengths.fill_(slot)


def compact_slots(cache: StaticCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Every layer's keys and values at buffer slots `src` move to slots `dst` (all rows; a gather, then the
    write)."""
    kv = cache.drafthead_kv
    kv.index_copy_(4, dst, kv.index_select(4, src))


def attach_target(runner, model: nn.Module, feature_layers: list[int], refusal: str, compile: bool = False,
                  float32_kernel: bool = False) -> None:
    """The part of a static-buffer runner's set-up every runner shares: refuse a model the buffers cannot serve
    (NotImplementedError starting with `refusal`), then set runner.model, .feature_layers, .capture (hooks on those
    decoder layers, or None), .dtype, .device, .attention (the kernel switched in per session, which depends on
    whether the runner's steps are `compile`d; attention.py) and .small_rows (bf16 on a CPU with AVX512-BF16, and
    with `float32_kernel` float32 on one with AVX2: the model's linears multiply a step's few rows with small_gemm's
    kernel inside a session; eager or compiled)."""
    reason = static_cache_supported(model)
    if reason is not None:
        raise NotImplementedError(f"{refusal} {reason}")
    runner.model = model
    runner.cache_argument = cache_argument(model)
    runner.feature_layers = list(feature_layers)
    runner.capture = HiddenStateCapture(model, runner.feature_layers).attach() if runner.feature_layers else None
    runner.dtype = next(model.parameters()).dtype
    runner.device = next(model.parameters()).device
    runner.attention = decoding_attention(runner.device, runner.dtype, compile)
    runner.small_rows = use_small_row_kernel(model, float32=float32_kernel) > 0


def decoding_session(runner, max_rows: int = KERNEL_ROWS) -> contextlib.AbstractContextManager:
    """A runner's decoding session: the model dispatches attention to the runner's kernel and (where the runner
    uses it) multiplies steps of up to `max_rows` rows with the small-row GEMM kernel."""
    stack = contextlib.ExitStack()
    stack.enter_context(attention_implementation(runner.model, runner.attention))
    if runner.small_rows:
        stack.enter_context(small_row_kernel(max_rows))
    return stack


def forward_with_features(runner, forward) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, the head's features or None) of `forward()`, a forward of the runner's model with its feature hooks
    (attach_target) recording."""
    if runner.capture is not None:
        runner.capture.recording = True
    out = forward()
    features = None
    if runner.capture is not None:
        features = runner.capture.stacked(runner.feature_layers)
        runner.capture.recording = False
        # left empty, so a compiled step finds the same (empty) dict at every call: one graph, not a second one
        # compiled for the dict's state after the first call
        runner.capture.outputs.clear()
    return out.logits, features


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds n tokens."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"a tree of {n} tokens exceeds the largest verify bucket {buckets[-1]}")


def check_tree_fits(drafter, runner) -> None:
    """Refuse, before decoding starts, a drafter whose trees (drafter.tree_sizes(), root included) outgrow the
    runner's largest verify bucket; a runner without buckets (eager) takes any size."""
    buckets = getattr(runner, "buckets", None)
    largest = max(drafter.tree_sizes())
    name = getattr(drafter, "name", type(drafter).__name__)
    if buckets and largest > buckets[-1]:
        raise ValueError(f"the {name} drafter's trees reach {largest} tokens (root included) but the "
                         f"runner's largest verify bucket is {buckets[-1]}: draft a smaller tree (or fewer "
                         f"lookup_tokens) or use a runner with a larger bucket")


class StaticRunner:
    """Target runner over preallocated KV buffers; see the module docstring."""

    def __init__(self, model: nn.Module, feature_layers: list[int], compile: bool = False,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, capacity: int = MIN_CAPACITY):
        attach_target(self, model, feature_layers, "static KV buffers do not support", compile)
        self.buckets = tuple(sorted(buckets))
        self.compiled = compile
        self.compile_s: dict[int | str, float] = {}  # bucket (or "prefill") -> seconds of its first call
        self.cache: StaticCache | None = None
        self.capacity = 0
        self._length = 0
        self._steps: dict[int | str, Callable] = {}  # bucket (or "prefill") -> its compiled step (own code object)
        self.reserve(capacity)

    # --------------------------------------------------------------------------------------------- buffers
    def reserve(self, length: int) -> None:
        """Make room for `length` tokens plus the largest bucket (contents are lost; compiled steps recompile)."""
        need = length + self.buckets[-1]
        if need <= self.capacity:
            return
        capacity = buffer_capacity(need)
        for step in self._steps.values():  # they skip the guards on the buffers (compile_step's `unguarded`)
            release_step(step)
        self._steps.clear()
        self.cache = static_cache(self.model, 1, capacity)
        self.capacity = capacity
        self.compile_s.clear()
        self._length = 0

    def reset(self, length: int = 0) -> None:
        """Start a new sequence (room for `length` tokens)."""
        self.reserve(length)
        self._set_length(0)

    def session(self) -> contextlib.AbstractContextManager:
        """Context for a decoding session (decoding_session)."""
        return decoding_session(self)

    @property
    def length(self) -> int:
        """Number of committed tokens in the buffers."""
        return self._length

    def _set_length(self, n: int) -> None:
        self._length = n
        set_write_slot(self.cache, n)

    # --------------------------------------------------------------------------------------------- forward
    def _model_forward(self, input_ids, position_ids, attention_mask, kv_length, logits_to_keep=0):
        """(logits, features) of the model over the buffers: `logits_to_keep` as transformers takes it."""
        return forward_with_features(self, lambda: self.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
            **{self.cache_argument: self.cache}, use_cache=True, logits_to_keep=logits_to_keep,
            **kv_length_kwargs(self.model, kv_length)))

    def _forward(self, input_ids, position_ids, attention_mask, kv_length):
        logits, features = self._model_forward(input_ids, position_ids, attention_mask, kv_length)
        # the greedy choice inside the graph: a fused argmax beats eager bf16 argmax over 49k logits (~0.7 ms)
        return logits, features, logits.argmax(dim=-1)

    def _prefill_forward(self, input_ids, position_ids, attention_mask, kv_length, last):
        """A prompt chunk's forward: the features of every row, the logits of row `last` (a (1,) index tensor)
        only. The lm_head over a 64-row chunk is ~a fifth of its cost, and a prompt needs one row of logits."""
        return self._model_forward(input_ids, position_ids, attention_mask, kv_length, logits_to_keep=last)

    def _step(self, size: int) -> Callable:
        """The forward for a `size`-token bucket: eager, or its own compiled step (built on first use; small
        buckets with inductor's C++ GEMMs on CPU)."""
        if not self.compiled:
            return self._forward
        if size not in self._steps:
            small = size <= SMALL_GEMM_ROWS and not self.small_rows
            self._steps[size] = compile_step(self._forward, self.device, small_gemm=small,
                                             name=f"bucket{size}", unguarded=("self.cache",))
        return self._steps[size]

    def _prefill_step(self) -> Callable:
        """The prompt-chunk forward: eager, or one compiled step for every chunk length (built on first use)."""
        if not self.compiled:
            return self._prefill_forward
        if "prefill" not in self._steps:
            self._steps["prefill"] = compile_step(self._prefill_forward, self.device, name="prefill",
                                                  unguarded=("self.cache",), dynamic=True)
        return self._steps["prefill"]

    def _mask(self, ancestors: torch.Tensor) -> torch.Tensor:
        """(1, 1, n, capacity) additive mask: the prefix, then the tree's ancestor pattern, nothing after."""
        return buffer_mask(ancestors, self._length, self.capacity, self.dtype)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the prompt (1, T) from an empty sequence. Returns (last logits (1, V), features (1, T, F)).
        Compiled: one graph for every chunk length (`compile_step(dynamic=True)`), in near-equal chunks of at most
        PREFILL_CHUNK rows, with the logits of the last row only; a prompt shorter than PREFILL_MIN_ROWS is padded to
        it (padded rows attend only to themselves and are overwritten later), so every chunk multiplies its linears
        the same way and no prompt length costs a compile. Measured on SmolLM2 bf16, 2-core Zen 4 EPYC, the 80
        MT-bench first turns (~100 tokens): 131.5 ms a prompt (median 124) through the 64-row verify graph (the
        last chunk padded, logits of every row), 89.7 ms (median 63) this way. Eager: the same chunks, unpadded."""
        t = input_ids.shape[1]
        if max(t, PREFILL_MIN_ROWS) + self.buckets[-1] > self.capacity:
            self.reserve(max(t, PREFILL_MIN_ROWS))
        self._set_length(0)
        step = self._prefill_step()
        first = "prefill" not in self.compile_s and self.compiled
        begin = time.perf_counter()
        pieces = -(-t // PREFILL_CHUNK)
        features, start = [], 0
        for i in range(pieces):
            m = t // pieces + (i < t % pieces)
            rows = max(m, PREFILL_MIN_ROWS) if self.compiled else m
            tokens = torch.zeros(1, rows, dtype=torch.long, device=self.device)  # fresh, contiguous
            tokens[:, :m] = input_ids[:, start: start + m]
            allowed = torch.eye(rows, dtype=torch.bool, device=self.device)  # padded rows: only themselves
            allowed[:m, :m] = causal_allowed(m, 0, self.device)
            positions = (torch.arange(rows, device=self.device) + start).unsqueeze(0)
            logits, feats = step(tokens, positions, self._mask(allowed), torch.tensor(start + rows),
                                 torch.tensor([m - 1], device=self.device))
            start += m
            self._set_length(start)  # the chunk is its own accepted path, already in place
            features.append(feats[:, :m] if feats is not None else None)
        if first:
            self.compile_s["prefill"] = time.perf_counter() - begin
        return logits[:, -1], (torch.cat(features, dim=1) if features[0] is not None else None)

    @torch.inference_mode()
    def verify(
        self,
        tokens: torch.Tensor,  # (1, n) tree tokens, root first, parents before children
        depths: torch.Tensor,  # (n,) depth of each node (root 0)
        ancestors: torch.Tensor,  # (n, n) bool: node i attends node j (ancestors and itself)
        size: int | None = None,  # the bucket to pad to (default: the smallest that holds the tree)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward over the tree after the committed prefix, padded to its bucket. Returns (logits (1, n, V),
        features (1, n, F), argmax of the logits (1, n))."""
        n = tokens.shape[1]
        size = bucket_for(n, self.buckets) if size is None else size
        past = self._length
        if past + size > self.capacity:
            raise RuntimeError(f"sequence of {past} tokens + a {size}-token tree exceeds the KV buffers "
                               f"({self.capacity}); call reset(length) with the full length first")
        if n < size:  # padded nodes: token 0 at the root's position, attending only to themselves
            padded = torch.zeros(1, size, dtype=torch.long, device=self.device)
            padded[:, :n] = tokens
            pad_depths = torch.zeros(size, dtype=torch.long, device=self.device)
            pad_depths[:n] = depths
            grown = torch.eye(size, dtype=torch.bool, device=self.device)
            grown[:n, :n] = ancestors
            tokens, depths, ancestors = padded, pad_depths, grown
        else:  # a fresh tensor of the bucket's standard strides (a compiled graph guards on strides and on
            # inference-mode tensors; a prompt's chunk is a strided slice of the user's tensor)
            tokens = tokens.clone(memory_format=torch.contiguous_format)
        positions = (depths + past).unsqueeze(0)
        first = size not in self.compile_s
        start = time.perf_counter()
        kv_length = torch.tensor(past + size)  # buffer slots in use after this step (a host tensor)
        logits, features, greedy = self._step(size)(tokens, positions, self._mask(ancestors), kv_length)
        if first:
            self.compile_s[size] = time.perf_counter() - start
        return logits[:, :n], (features[:, :n] if features is not None else None), greedy[:, :n]

    def truncate(self, length: int) -> None:
        """Forget every committed token from position `length` on (a drafter rolling back its rejected drafts)."""
        self._set_length(min(length, self._length))

    @torch.inference_mode()
    def commit(self, keep: torch.Tensor, tree_size: int) -> None:
        """Keep the tree positions `keep` (indices into the last verified tree, in order); drop the rest."""
        past = self._length
        m = keep.shape[0]
        if m and not torch.equal(keep, torch.arange(m, device=keep.device)):  # a prefix of the tree is in place
            compact_slots(self.cache, keep.to(self.device) + past, torch.arange(past, past + m, device=self.device))
        self._set_length(past + m)

    def close(self) -> None:
        """Remove the feature hooks from the model."""
        if self.capture is not None:
            self.capture.detach()


def own_code(method, name: str = ""):
    """A bound method re-made around its own copy of the code object (`name` is appended to its name). Dynamo
    keeps compiled graphs per code object, and with frozen weights a graph bakes in one model's weights (and skips
    guards on its modules), so two runners of different models must never share a cache: each compiles its own
    copy."""
    func = method.__func__
    code = func.__code__.replace(co_name=f"{func.__name__}_{id(method.__self__):x}{'_' + name if name else ''}")
    clone = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    return types.MethodType(clone, method.__self__)


def compile_setting(compile: bool | str, device: torch.device) -> bool:
    """Whether to compile: True/False (or the CLI's "on"/"off") as given; "auto" compiles on CUDA only (on a
    2-core CPU each step shape costs ~30-45 s to compile and pays only over long runs)."""
    compile = {"on": True, "off": False}.get(compile, compile)
    if compile == "auto":
        return device.type == "cuda"
    if compile not in (True, False):
        raise ValueError(f"compile must be 'auto', 'on', 'off', True or False, got {compile!r}")
    return bool(compile)


def compile_step(fn, device: torch.device, small_gemm: bool = False, name: str = "", cpp_wrapper: bool = False,
                 unguarded: tuple[str, ...] = (), dynamic: bool = False):
    """torch.compile for a fixed-shape decoding step: CUDA graphs on CUDA; on CPU inductor with frozen (oneDNN
    prepacked) weights, linears sharing an input concatenated. Measured on a 2-core AVX512-BF16 EPYC, SmolLM2-135M
    bf16, one token: eager 39 ms, compiled 20 ms; with cpp_wrapper no faster and twice the compile time (~85 s), so
    it is left off.
    `small_gemm` (CPU, a step of a few rows, where the linears do not already run small_gemm.py's bf16 kernel,
    e.g. fp32 or no AVX512-BF16): the matmuls are inductor's own C++ GEMM templates (oneDNN where a template does
    not apply). At a few rows they stream the weights faster than oneDNN: SmolLM2-135M bf16, verify
    over a 640-slot buffer, 2-core Zen 4 EPYC (AVX512-BF16): 1 token 16.2 -> 11.3 ms, 4 tokens 18.0 -> 13.6 ms;
    at 8 tokens 45 ms against oneDNN's 19 (the templates convert bf16 to fp32 and lose once the step is no longer
    bound by the weights); choosing per GEMM by timing both (max-autotune with both backends) picks by warm
    single-kernel timings and did no better inside decoding (9.8-11.5 and 14.9-16.3 ms over three processes). It
    costs ~1-2 min of compiling per shape on 2 cores (cached on disk for the next process).
    `cpp_wrapper` (CPU): the graph's calls are made from generated C++ instead of Python, which pays for steps
    made of many small kernels, e.g. a drafting step (SmolLM2's head, 2/6/3 tree, bf16, 2-core Zen 4 EPYC, inside
    decoding, two processes each: 1.56-1.62 against 1.68-1.85 ms a step); it about doubles the compile time.
    `name` tells the compiled copies apart in profiles.
    `dynamic`: one graph for every length of the step's inputs (a prompt chunk; no CUDA graph on CUDA).
    `unguarded`: attribute paths of `fn`'s self (e.g. "self.cache") whose guards are skipped: objects the caller
    never swaps while the step lives, or whose step it releases (release_step) when it does. A static runner's KV
    buffers are ~330 of a verify step's ~720 guards (SmolLM2-135M), checked at every call otherwise."""
    import torch._dynamo

    # one graph per verify bucket (and per buffer size): allow them all without falling back to eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 256)
    # the model is frozen: skip re-checking its ~300 parameters on every call (~0.8 ms of guards per step); safe
    # because every runner compiles its own copy of the code (own_code), so a graph only ever sees one model
    def guard_filter(entries):
        keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
        return [k and not any(e.name == p or e.name.startswith((p + ".", p + "[")) for p in unguarded)
                for e, k in zip(entries, keep)]

    options = {"guard_filter_fn": guard_filter}
    fn = own_code(fn, name)
    if device.type == "cuda" and not dynamic:  # mode="reduce-overhead": CUDA graphs
        graphed = torch.compile(fn, dynamic=False, options={**options, "triton.cudagraphs": True})

        def run(*args):  # a graph's outputs are overwritten by the next replay: keep copies
            return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in graphed(*args))

        run.drafthead_code = fn.__func__.__code__
        return run
    # CUDA and dynamic (a prompt chunk: long kernels, no CUDA graph, which would be one per length): plain inductor
    if device.type != "cuda":
        import torch._inductor.config

        # weight prepacking for oneDNN linear; read from the global config (an `options` entry is not honoured)
        torch._inductor.config.freezing = True
        # one GEMM for the linears that share an input (q/k/v, gate/up): at a few tokens a step each oneDNN call
        # costs a fixed ~15-20 us beyond streaming its weights (SmolLM2 bf16, 1 token, 2-core EPYC with
        # AVX512-BF16: 211 calls a step -> 121, 12.5 -> 10.4 ms a token)
        torch._inductor.config.cpp.enable_concat_linear = True
        if cpp_wrapper:
            options["cpp_wrapper"] = True
        # small_linear calls sharing an input (q/k/v, gate/up) become one call over their back-to-back packed
        # weights: SmolLM2-135M 211 -> 121 calls a step; 2-core Zen 4 EPYC, bf16, 8 MT-bench prompts × 128
        # tokens, both variants in one process taking turns, 4 rounds: engine plain +3.5 to +11.5 %, a 2/3/3
        # tree +1.8 to +8.9 %
        options["post_grad_custom_post_pass"] = FuseSiblingLinears()
        if small_gemm:
            options.update(max_autotune=True, max_autotune_gemm_backends="CPP", autotune_fallback_to_aten=True)
    step = torch.compile(fn, dynamic=dynamic, options=options)
    step.drafthead_code = fn.__func__.__code__
    return step


def release_step(step) -> None:
    """Free the graphs of a compile_step() step (and the buffers and prepacked weights they hold): dynamo keeps a
    code object's graphs alive beyond the compiled callable, so dropping the callable alone frees nothing
    (measured: ~500 MB kept per batch shape, SmolLM2 bf16, 4 rows × 4k slots). No-op for an eager step."""
    code = getattr(step, "drafthead_code", None)
    if code is not None:
        torch._C._dynamo.eval_frame.reset_code(code)

