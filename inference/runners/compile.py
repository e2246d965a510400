"""torch.compile for decoding steps, scoped: each runner compiles its own copy of a step's code; the compiler settings
hold only inside a runner's decoding session (scoped_settings), so a user's own torch.compile calls are unaffected."""

from __future__ import annotations

import contextlib
import types
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch.fx.experimental import _config as fx_config

from drafthead.utils import atomic_write_bytes

from ..cpu.small_gemm import FuseSiblingLinears


def own_code(method, name: str = ""):
    """A bound method re-made around its own copy of the code object (`name` appended to its name): dynamo keeps
    graphs per code object, and a frozen graph bakes in one model's weights, so two runners must never share one."""
    func = method.__func__
    code = func.__code__.replace(co_name=f"{func.__name__}_{id(method.__self__):x}{'_' + name if name else ''}")
    clone = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    return types.MethodType(clone, method.__self__)


def compile_setting(compile: bool | str, device: torch.device, tuned: bool = False) -> bool:
    """Whether to compile: True/False (CLI: "on"/"off") as given; "auto" compiles on CUDA, and on a CPU for a tuned tree
    (`tuned`: tree="auto"), its generator kept long enough to repay minutes of compile (docs/results/HISTORY.md)."""
    compile = {"on": True, "off": False}.get(compile, compile)
    if compile == "auto":
        return device.type == "cuda" or tuned
    if compile not in (True, False):
        raise ValueError(f"compile must be 'auto', 'on', 'off', True or False, got {compile!r}")
    return bool(compile)


def compile_step(fn, device: torch.device, small_gemm: bool = False, name: str = "", cpp_wrapper: bool = False,
                 unguarded: tuple[str, ...] = (), dynamic: dict[int, int] | None = None, frozen: bool = True,
                 store: Path | None = None):
    """torch.compile for a fixed-shape decoding step: CUDA graphs on CUDA; on CPU inductor, the small-row kernels'
    calls that share an input fused into one. Run the step inside scoped_settings (a runner's session).
    `small_gemm` (CPU, a few rows not on small_gemm.py's kernel): inductor's own C++ GEMMs, faster than oneDNN there.
    `cpp_wrapper` (CPU): calls made from generated C++, which pays for steps of many small kernels (drafting;
    docs/results/HISTORY_LONG_CONTEXT.md). `name` tells the compiled copies apart in profiles.
    `unguarded`: attribute paths of `fn`'s self (e.g. "self.cache") whose guards are skipped: objects the caller
    never swaps while the step lives, or whose step it releases (release_steps) when it does.
    `dynamic` (CPU): {argument index: dimension} kept symbolic (marked at every call): one graph for all sizes.
    `frozen` (CPU): weights as constants, prepacked for oneDNN; useless where all linears run small_gemm.py's
    kernels, and unfrozen a graph is cached whole (docs/results/compile_cache_unfrozen_zen3.json).
    `store` (CPU, unfrozen): the file, named by what the step reads besides its arguments, that keeps the step
    compiled whole for later processes (stored())."""

    # the model is frozen and each runner compiles its own code (own_code): skip its parameters' guards
    def guard_filter(entries):
        keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
        return [k and not any(e.name == p or e.name.startswith((p + ".", p + "[")) for p in unguarded)
                for e, k in zip(entries, keep)]

    options = {"guard_filter_fn": guard_filter}
    fn = own_code(fn, name)
    if device.type == "cuda":  # mode="reduce-overhead": CUDA graphs
        graphed = torch.compile(fn, dynamic=False, options={**options, "triton.cudagraphs": True})

        def step(*args):  # a graph's outputs are overwritten by the next replay: keep copies
            return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in graphed(*args))
    else:
        # small_linear calls sharing an input (q/k/v, gate/up) become one call over their packed weights
        options["post_grad_custom_post_pass"] = FuseSiblingLinears()
        if cpp_wrapper:
            options["cpp_wrapper"] = True
        if small_gemm:
            options.update(max_autotune=True, max_autotune_gemm_backends="CPP", autotune_fallback_to_aten=True)
        step = compiled = torch.compile(fn, dynamic=None if dynamic else False, options=options)
        marks = tuple((dynamic or {}).items())
        if store is not None and not frozen:
            step = stored(fn, compiled, store, marks, options)
        elif marks or frozen:  # (a step with neither is the compiled function itself: no wrapper at each call)
            def step(*args):  # freezing is read when a graph compiles, not from `options`: a frozen step sets it
                marked(args, marks)  # around its call (patch() costs 5x more); scoped_settings turns it off
                if not frozen:
                    return compiled(*args)
                previous, torch._inductor.config.freezing = torch._inductor.config.freezing, True
                try:
                    return compiled(*args)
                finally:
                    torch._inductor.config.freezing = previous
    step.drafthead_code = fn.__func__.__code__  # (release_steps)
    return step


def marked(args, marks: tuple[tuple[int, int], ...]):  # args, compile_step's dynamic (index, dimension) marked
    for i, dim in marks:
        torch._dynamo.mark_dynamic(args[i], dim)
    return args


def stored(fn, compiled, store: Path, marks: tuple[tuple[int, int], ...], options: dict) -> Callable:
    """`compiled` (torch.compile of method `fn`) compiled whole and kept in the file `store`, which later processes
    load instead of tracing it (docs/results/stored_steps_zen4.json): guards on its arguments only, checked once per
    layout (what it reads from `self`, and its code, are in the path); `marks` set only for tracing (its guards reject
    marked tensors). A bad file is compiled again; a step not compilable whole, or failing its guards, runs compiled."""
    owner, names = fn.__self__, fn.__code__.co_varnames[1: fn.__code__.co_argcount]
    # (portable guards only, on the arguments' tensors, shapes and global state: then none refers to `self`)
    keep = lambda entries: [portable and (e.guard_type != "TENSOR_MATCH" or e.name.split("[")[0] in names)  # noqa: E731
                            for e, portable in zip(entries, torch.compiler.keep_portable_guards_unsafe(entries))]
    aot, checked = None, set()  # aot: None before the first call, False where `compiled` runs the step

    def whole(args) -> object | None:
        if store.exists():
            try:
                with open(store, "rb") as f:
                    return torch.compiler.load_compiled_function(f, f_globals=fn.__globals__,
                                                                 external_data={"self": owner})
            except Exception as error:  # noqa: BLE001 (a damaged or foreign file: compiled again below)
                warnings.warn(f"drafthead: stored step {store.name} unreadable, compiled again ({error!r:.200})",
                              stacklevel=4)
        try:  # traced from views of the arguments, so that only the views carry the marks
            example = marked([a.view_as(a) if isinstance(a, torch.Tensor) else a for a in args], marks)
            result = torch.compile(fn, fullgraph=True, dynamic=None if marks else False,
                                   options={**options, "guard_filter_fn": keep}).aot_compile((tuple(example), {}))
            atomic_write_bytes(store, lambda tmp: result.save_compiled_function(tmp, external_data={"self": owner}))
            return result
        except Exception as error:  # noqa: BLE001 (any failure leaves the ordinary compiled step)
            warnings.warn(f"drafthead: compiled step {store.name} not stored ({error!r:.200})", stacklevel=4)
            return None

    def step(*args):
        nonlocal aot
        if aot is None:
            aot = whole(args) or False
            if aot:
                aot.disable_guard_check()  # checked here, once per argument layout
        if aot:
            layout = tuple((a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
            if layout in checked or aot.guard_check(owner, *args):
                checked.add(layout)
                return aot(owner, *args)
        return compiled(*marked(args, marks))
    return step


@contextlib.contextmanager
def scoped_settings(cpu: bool):
    """The compiler settings decoding steps compile and run under, restored afterwards: room for one graph per
    verify bucket and buffer size; on CPU unfrozen weights (compile_step's `frozen` steps freeze theirs), one GEMM
    for linears that share an input (a frozen step's) and symbolic sizes not specialised at 1 (a one-token step
    runs the shared verify graph as fast as its own: docs/results/shared_verify_graph_one_token_zen3.json)."""
    dynamo = torch._dynamo.config
    limits = dict(recompile_limit=max(dynamo.recompile_limit, 64),
                  accumulated_recompile_limit=max(dynamo.accumulated_recompile_limit, 256))
    inductor = {"freezing": False, "cpp.enable_concat_linear": True} if cpu else {}
    with dynamo.patch(limits), torch._inductor.config.patch(inductor), \
            fx_config.patch({"backed_size_oblivious": True} if cpu else {}):
        yield


def release_steps(steps) -> None:
    """Free the graphs of compile_step() steps and what they hold (dynamo keeps them alive beyond the callables);
    a step listed twice (one graph shared by several buckets) is freed once."""
    for code in {step.drafthead_code for step in steps}:
        torch._C._dynamo.eval_frame.reset_code(code)

