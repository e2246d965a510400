"""torch.compile for decoding steps, scoped: each runner compiles its own copy of a step's code, and the compiler
settings the steps need hold only inside a runner's decoding session (scoped_settings, entered once a generation),
so a user's own torch.compile calls behave as if this package had never run."""

from __future__ import annotations

import contextlib
import types

import torch

from ..cpu.small_gemm import FuseSiblingLinears


def own_code(method, name: str = ""):
    """A bound method re-made around its own copy of the code object (`name` is appended to its name). Dynamo
    keeps compiled graphs per code object, and with frozen weights a graph bakes in one model's weights (and skips
    guards on its modules), so two runners of different models must never share a cache: each compiles its own
    copy."""
    func = method.__func__
    code = func.__code__.replace(co_name=f"{func.__name__}_{id(method.__self__):x}{'_' + name if name else ''}")
    clone = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    return types.MethodType(clone, method.__self__)


def compile_setting(compile: bool | str, device: torch.device, tuned: bool = False) -> bool:
    """Whether to compile: True/False (or the CLI's "on"/"off") as given; "auto" compiles on CUDA, and on a CPU
    for a tuned tree (`tuned`: tree="auto"), the fast path a user keeps a generator for: there a step's minutes of
    compile pay over long runs only (docs/results/HISTORY.md), and uncompiled steps decode at about 0.7x."""
    compile = {"on": True, "off": False}.get(compile, compile)
    if compile == "auto":
        return device.type == "cuda" or tuned
    if compile not in (True, False):
        raise ValueError(f"compile must be 'auto', 'on', 'off', True or False, got {compile!r}")
    return bool(compile)


def compile_step(fn, device: torch.device, small_gemm: bool = False, name: str = "", cpp_wrapper: bool = False,
                 unguarded: tuple[str, ...] = (), dynamic: bool = False):
    """torch.compile for a fixed-shape decoding step: CUDA graphs on CUDA; on CPU inductor with frozen (oneDNN
    prepacked) weights, linears sharing an input concatenated (docs/results/HISTORY.md has the measurements).
    `small_gemm` (CPU, a step of a few rows whose linears do not run small_gemm.py's kernel): the matmuls are
    inductor's own C++ GEMM templates, which stream a few rows' weights faster than oneDNN.
    `cpp_wrapper` (CPU): the graph's calls are made from generated C++, which pays for steps made of many small
    kernels (a drafting step); it about doubles the compile time.
    `name` tells the compiled copies apart in profiles.
    `dynamic`: one graph for every length of the step's inputs (a prompt chunk; no CUDA graph on CUDA).
    `unguarded`: attribute paths of `fn`'s self (e.g. "self.cache") whose guards are skipped: objects the caller
    never swaps while the step lives, or whose step it releases (release_step) when it does.
    The compiler settings the step needs (recompile limits, freezing, concatenated linears) are scoped_settings,
    which a runner's decoding session holds (StaticRunner.session): run the step inside one."""

    # the model is frozen: skip re-checking its parameters on every call; safe because every runner compiles its
    # own copy of the code (own_code), so a graph only ever sees one model
    def guard_filter(entries):
        keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
        return [k and not any(e.name == p or e.name.startswith((p + ".", p + "[")) for p in unguarded)
                for e, k in zip(entries, keep)]

    options = {"guard_filter_fn": guard_filter}
    fn = own_code(fn, name)
    cpu = device.type != "cuda"
    if not cpu and not dynamic:  # mode="reduce-overhead": CUDA graphs
        graphed = torch.compile(fn, dynamic=False, options={**options, "triton.cudagraphs": True})

        def run(*args):  # a graph's outputs are overwritten by the next replay: keep copies
            return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in graphed(*args))

        run.drafthead_code = fn.__func__.__code__
        return run
    if cpu:
        if cpp_wrapper:
            options["cpp_wrapper"] = True
        # small_linear calls sharing an input (q/k/v, gate/up) become one call over their packed weights
        options["post_grad_custom_post_pass"] = FuseSiblingLinears()
        if small_gemm:
            options.update(max_autotune=True, max_autotune_gemm_backends="CPP", autotune_fallback_to_aten=True)
    step = torch.compile(fn, dynamic=dynamic, options=options)
    step.drafthead_code = fn.__func__.__code__
    return step


@contextlib.contextmanager
def scoped_settings(cpu: bool):
    """The compiler settings decoding steps compile and run under, restored afterwards (~80 us to enter: once a
    generation, not once a step): room for one graph per
    verify bucket and buffer size without falling back to eager; on CPU, weights prepacked for oneDNN (read from the
    global config: an `options` entry is not honoured) and one GEMM for linears that share an input."""
    import torch._dynamo
    import torch._inductor.config

    dynamo = torch._dynamo.config
    limits = dict(recompile_limit=max(dynamo.recompile_limit, 64),
                  accumulated_recompile_limit=max(dynamo.accumulated_recompile_limit, 256))
    inductor = {"freezing": True, "cpp.enable_concat_linear": True} if cpu else {}
    with dynamo.patch(limits), torch._inductor.config.patch(inductor):
        yield


def release_step(step) -> None:
    """Free the graphs of a compile_step() step (and the buffers and prepacked weights they hold): dynamo keeps a
    code object's graphs alive beyond the compiled callable, so dropping the callable alone frees nothing
    (measured: ~500 MB kept per batch shape, SmolLM2 bf16, 4 rows × 4k slots). No-op for an eager step."""
    code = getattr(step, "drafthead_code", None)
    if code is not None:
        torch._C._dynamo.eval_frame.reset_code(code)

