"""Small-row GEMM kernels for the few rows of a decoding step (small_gemm.cpp: bf16 with AVX512-BF16;
small_gemm_avx2.cpp: float32 with AVX2 + FMA), and the linear layers that use them.

Such a step is bound by reading each weight once, which PyTorch's linears do not at that size (docs/results/HISTORY.md).
Each output is summed in the same order whatever the number of rows, so a token's logits do not depend on the tree
verified beside it. `use_small_row_kernel(model)` turns linears into `SmallRowLinear` in place (same parameters and
state dict, plus packed copies): the kernel inside `small_row_kernel(max_rows)`, exactly nn.Linear elsewhere.
"""

from __future__ import annotations

import contextlib
import weakref
from operator import attrgetter

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .kernels import BLOCK, FLOAT_BLOCK, avx2_kernels_available, kernels_available

KERNEL_ROWS = 16  # the default row limit: past it a step is no longer bound by reading the weights
BATCH_KERNEL_ROWS = 64  # a batch's verify (rows x tree tokens): still beats oneDNN and MKL (docs/results/HISTORY.md)

# the switches of small_row_kernel() (row limit 0: outside) and int8_weights(): module globals, so a compiled step
# guards on them (it skips guards on nn.Module state)
_row_limit = 0
_int8_active = False
# live_entries(): the leading entries the kernels multiply; a tensor filled in place, passed to every kernel call,
# so a compiled step reads its value at each call (no new graph per value)
_live = torch.tensor(2**62)
# each converted linear's own class, and how many users of each kind ("rows", "int8") hold it (a linear may belong
# to several models): it is itself again once none does (release_kernels)
_own_class: "weakref.WeakKeyDictionary[nn.Module, type]" = weakref.WeakKeyDictionary()
_holds: "weakref.WeakKeyDictionary[nn.Module, dict[str, int]]" = weakref.WeakKeyDictionary()


def _hold(modules: list[nn.Module], kind: str) -> None:
    for module in modules:
        counts = _holds.setdefault(module, {})
        counts[kind] = counts.get(kind, 0) + 1


def eligible(module: nn.Module, float32: bool = False) -> bool:
    """A CPU nn.Linear whose shape and dtype a kernel of this CPU takes: bf16 with AVX512-BF16 (out_features a
    multiple of 32, in_features even), and with `float32` float32 with AVX2 (out_features a multiple of 16)."""
    if not isinstance(module, nn.Linear) or module.weight.device.type != "cpu":
        return False
    n, k = module.weight.shape
    if module.weight.dtype == torch.bfloat16:
        return n % BLOCK == 0 and k % 2 == 0 and kernels_available()
    return float32 and module.weight.dtype == torch.float32 and n % FLOAT_BLOCK == 0 and avx2_kernels_available()


@contextlib.contextmanager
def _module_global(name: str, value):
    """Set one of this module's switches (read by the linears' forward, guarded by compiled steps) for a block."""
    previous, globals()[name] = globals()[name], value
    try:
        yield
    finally:
        globals()[name] = previous


def small_row_kernel(max_rows: int = KERNEL_ROWS) -> contextlib.AbstractContextManager:
    """Inside this context SmallRowLinear modules multiply inputs of up to `max_rows` rows with the kernel."""
    return _module_global("_row_limit", max_rows)


@contextlib.contextmanager
def live_entries(entries: int):
    """Inside this context the kernels multiply only the first `entries` entries of their input's first dimension
    (a batch's rows still decoding) and return zeros for the rest. Yields the 0-dim tensor holding `entries`."""
    previous = int(_live)
    _live.fill_(entries)
    try:
        yield _live
    finally:
        _live.fill_(previous)


class SmallRowLinear(nn.Linear):
    """nn.Linear multiplying small inputs with its packed kernel in small_row_kernel(), int8 copy in int8_weights()."""

    packed: torch.Tensor
    int8_weight: torch.Tensor | None  # buffers (None until use_int8_weights gives the module its int8 copy)
    int8_columns: torch.Tensor | None
    qpacked: torch.Tensor | None  # a GGUF target's own quantized blocks (gguf_weights.py), else None
    qparams: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _int8_active and self.int8_weight is not None:
            return int8_linear(x, self.int8_weight, self.int8_columns, self.bias)
        if _row_limit and x.numel() <= _row_limit * x.shape[-1]:
            if self.qpacked is not None and x.dtype == self.weight.dtype:  # the exactly dequantized W (gguf_weights)
                kernels = torch.ops.drafthead_kernels if x.dtype == torch.bfloat16 else torch.ops.drafthead_avx2
                return kernels.small_linear_q(x, self.qpacked, self.qparams, self.bias, _live)
            packed = self.packed
            if packed is not None and x.dtype == packed.dtype:
                if x.dtype == torch.bfloat16:
                    return torch.ops.drafthead_kernels.small_linear(x, packed, self.bias, _live)
                return torch.ops.drafthead_avx2.small_linear(x, packed, self.bias, _live)
        return F.linear(x, self.weight, self.bias)


# ---------------------------------------------------------------------------------------------- int8 drafting
# A draft only needs to agree with the target often (the target verifies it): an int8 copy of its weights halves
# bf16's bytes, quarters float32's.


class Int8CopyLinear(nn.Linear):
    """nn.Linear holding an int8 copy of its weight, used inside int8_weights() (a linear not a SmallRowLinear)."""

    int8_weight: torch.Tensor
    int8_columns: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _int8_active and self.int8_weight is not None:
            return int8_linear(x, self.int8_weight, self.int8_columns, self.bias)
        return F.linear(x, self.weight, self.bias)


DRAFT_WEIGHTS = ("auto", "same", "int8")  # what a drafter multiplies with: its own weights or their int8 copy


def int8_drafting(model: nn.Module, weights: str, auto_int8: bool = False) -> bool:
    """A drafter's `weights` (DRAFT_WEIGHTS) on `model`: "int8" gives it its int8 copies (use_int8_weights; release
    them with release_kernels(model, "int8")); "auto" does so where `auto_int8` and the weight-only kernel takes them
    (float32 weights on an AVX2 CPU), else it is "same". Returns whether the draft multiplies with int8 copies."""
    if weights not in DRAFT_WEIGHTS:
        raise ValueError(f"draft weights must be one of {DRAFT_WEIGHTS}, got {weights!r}")
    if weights == "auto":
        w = next(model.parameters())
        weight_only = w.dtype == torch.float32 and w.device.type == "cpu" and avx2_kernels_available()
        return auto_int8 and weight_only and use_int8_weights(model) > 0
    if weights == "int8" and use_int8_weights(model) == 0:
        raise ValueError("draft weights 'int8': the model has no linear layer an int8 copy fits (out_features a "
                         "multiple of 32, in_features of 16)")
    return weights == "int8"


def int8_weights(active: bool = True) -> contextlib.AbstractContextManager:
    """Inside this context (when `active`) linears with an int8 copy (use_int8_weights) multiply with it."""
    return _module_global("_int8_active", active)


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) weight -> (int8 (N, K), columns (2, N) float32: each column's scale max|W|/127, and 128 Σ_k Wq)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    q = (w / scale[:, None]).round().clamp(-127, 127)
    return q.to(torch.int8), torch.stack([scale, q.sum(dim=1) * 128])


def pack_int8(quantized: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 -> the kernel's layout (N/32, K/4, 32, 4): element [b, q, c, j] = W[32 b + c, 4 q + j]."""
    n, k = quantized.shape
    return quantized.reshape(n // BLOCK, BLOCK, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def int8_linear(x: torch.Tensor, weight: torch.Tensor, columns: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x · Wᵀ (+ bias) from an int8 weight (quantize_weight_int8; packed by pack_int8 for the kernel), with each
    row of x quantised to int8 (scale max|x|/127), except for the AVX2 kernel's (N/16, K, 16). Returns x's dtype."""
    if weight.dim() == 4:  # packed for the AVX512-VNNI kernel (a bf16 model's: x is bf16 too)
        return torch.ops.drafthead_kernels.small_linear_int8(x, weight, columns, bias, _live)
    if weight.dim() == 3:  # packed for the AVX2 kernel (a float32 model's): weight-only, x is not quantised
        return torch.ops.drafthead_avx2.small_linear_int8(x, weight, columns, bias, _live)
    xf = x.float()
    row_scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127
    xq = (xf / row_scale).round().clamp(-127, 127)
    y = (xq @ weight.float().T) * row_scale * columns[0]
    return (y if bias is None else y + bias.float()).to(x.dtype)


def sibling_groups(model: nn.Module, linears: list[nn.Linear]) -> list[list[nn.Linear]]:
    """`linears` grouped by (parent module, input width), in module order: the siblings that may share an input
    (q/k/v, gate/up). The model itself may be the linear: a group of its own."""
    groups: dict[tuple[int, int], list[nn.Linear]] = {}
    parents = {id(child): id(parent) for parent in model.modules() for child in parent.children()}
    for module in linears:
        groups.setdefault((parents.get(id(module), id(module)), module.in_features), []).append(module)
    return list(groups.values())


@torch.inference_mode(False)  # as use_small_row_kernel's copies
@torch.no_grad()
def use_int8_weights(model: nn.Module) -> int:
    """Give every linear of `model` whose shape allows it an int8 copy of its weight, used only inside int8_weights():
    packed for the kernel where one runs (bf16 with AVX512-BF16; float32 with AVX2, weight-only), else plain int8;
    siblings back to back in one buffer (FuseSiblingLinears); parameters and state dict unchanged. Returns the count."""
    linears = [m for m in model.modules()
               if isinstance(m, nn.Linear) and not m.out_features % BLOCK and not m.in_features % 16]
    for group in sibling_groups(model, [m for m in linears if getattr(m, "int8_weight", None) is None]):
        weights, columns = zip(*(quantize_weight_int8(m.weight) for m in group))
        w = group[0].weight
        kernel = w.dtype == torch.bfloat16 and w.device.type == "cpu" and kernels_available()
        avx2 = w.dtype == torch.float32 and w.device.type == "cpu" and avx2_kernels_available()
        pack = pack_int8 if kernel else torch.ops.drafthead_avx2.pack_weight if avx2 else (lambda q: q)
        weights = back_to_back([pack(q) for q in weights])
        columns = back_to_back([c.to(w.device) for c in columns], dim=1)  # (2, N of the group): a column slice each
        for module, q, c in zip(group, weights, columns):
            if not isinstance(module, SmallRowLinear):
                _own_class.setdefault(module, nn.Linear if isinstance(module, Int8CopyLinear) else type(module))
                module.__class__ = Int8CopyLinear
            module.register_buffer("int8_weight", q, persistent=False)
            module.register_buffer("int8_columns", c, persistent=False)
    _hold(linears, "int8")
    return len(linears)


# The copies are constants of the compiled steps, and inductor's cache key records whether each was made under
# inference mode: made outside it, they key alike in every process (a tuning process builds its drafters in it).
@torch.inference_mode(False)
@torch.no_grad()
def use_small_row_kernel(model: nn.Module, float32: bool = False) -> int:
    """Turn the model's eligible linears into SmallRowLinear in place (parameters, ties and state dict
    unchanged; float32 ones only with `float32`). Returns how many use the kernel; 0 where it is not available.
    Siblings are packed back to back in one buffer, each module's `packed` a view of it (for FuseSiblingLinears)."""
    for module in model.modules():
        if isinstance(module, SmallRowLinear) and module not in _holds:
            # a deepcopy of a converted linear holds the original's copies, perhaps of another dtype: convert anew
            _unconvert(module, nn.Linear)
    linears = [m for m in model.modules() if isinstance(m, SmallRowLinear) or eligible(m, float32)]
    for group in sibling_groups(model, [m for m in linears if getattr(m, "packed", None) is None]):
        bf16 = group[0].weight.dtype == torch.bfloat16  # the op library packing its weights
        kernels = torch.ops.drafthead_kernels if bf16 else torch.ops.drafthead_avx2
        # a linear holding a GGUF target's blocks multiplies with them (gguf_weights.py): no packed copy
        dense = [m for m in group if getattr(m, "qpacked", None) is None]
        views = dict(zip(map(id, dense), back_to_back([kernels.pack_weight(m.weight.detach()) for m in dense]))
                     if dense else ())
        for module in group:
            _own_class.setdefault(module, nn.Linear if isinstance(module, (SmallRowLinear, Int8CopyLinear))
                                  else type(module))
            module.__class__ = SmallRowLinear
            for name in ("int8_weight", "int8_columns", "qpacked", "qparams"):
                if name not in module._buffers:  # no int8 copy (yet), no GGUF blocks
                    module.register_buffer(name, None, persistent=False)
            module.register_buffer("packed", views.get(id(module)), persistent=False)
    _hold(linears, "rows")
    return len(linears)


def release_kernels(model: nn.Module, kind: str = "rows") -> None:
    """One user of use_small_row_kernel ("rows") or use_int8_weights ("int8") on `model` is done; a linear no user
    holds any more is its own class again, without the copies."""
    for module in model.modules():
        counts = _holds.get(module)
        if not counts or not counts.get(kind):
            continue
        counts[kind] -= 1
        if not any(counts.values()):
            del _holds[module]
            _unconvert(module, _own_class.pop(module, nn.Linear))


def _unconvert(module: nn.Module, own_class: type) -> None:
    """`module` as its own class again, its copies emptied in place (no key removed: this may run from the garbage
    collector during someone's iteration over the module)."""
    module.__class__ = own_class
    for name in ("packed", "int8_weight", "int8_columns"):
        if name in module._buffers:
            module._buffers[name] = None


def back_to_back(tensors: list[torch.Tensor], dim: int = 0) -> tuple[torch.Tensor, ...]:
    """The tensors copied one after another along `dim` into one buffer, as views of it: siblings' weights laid out so
    that FuseSiblingLinears multiplies them in one call."""
    return torch.cat(tensors, dim).split([t.shape[dim] for t in tensors], dim)


def _continues(a: list[torch.Tensor], b: list[torch.Tensor], dims: tuple[int, ...]) -> bool:
    """True when each of call b's weight operands continues call a's along its dim of `dims` in one storage (as
    back_to_back lays them out): the same strides and other sizes, b's starting where a's ends."""
    return all(x.untyped_storage()._cdata == y.untyped_storage()._cdata and x.stride() == y.stride()
               and x.shape[:d] + x.shape[d + 1:] == y.shape[:d] + y.shape[d + 1:]
               and x.storage_offset() + x.shape[d] * x.stride(d) == y.storage_offset() for x, y, d in zip(a, b, dims))


class FuseSiblingLinears(CustomGraphPass):
    """Inductor post-grad pass: small_linear (small_linear_int8) calls that share an input and whose packed weights
    (and int8 columns) lie back to back in one buffer become ONE call over that span (a view: no copy), its output
    sliced and copied per original call; bit-identical, as the kernels sum every column alike. The weights are a
    frozen graph's constants or an unfrozen graph's inputs (their fake values share a storage as the real ones do);
    a cached graph relies on the layout use_small_row_kernel packs, which this file's digest (uuid) covers."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        module = graph.owning_module
        # op -> (the dim along which siblings' copies of each weight operand after x lie back to back, output columns
        # per packed block): packed weights and a GGUF target's params by blocks, int8 columns (2, N) by columns
        ops = {}
        for library, block in (("drafthead_kernels", BLOCK), ("drafthead_avx2", FLOAT_BLOCK)):
            for name, dims, columns in (("small_linear", (0,), block), ("small_linear_int8", (0, 1), block),
                                        ("small_linear_q", (0, 0), FLOAT_BLOCK)):
                with contextlib.suppress(AttributeError):  # a library never loaded has no call to fuse
                    ops[getattr(getattr(torch.ops, library), name).default] = (dims, columns)
        def weight(node):  # a weight operand's tensor: a frozen graph's constant (real), an input (fake), else None
            kind = node.op if isinstance(node, torch.fx.Node) else None
            return (attrgetter(node.target)(module) if kind == "get_attr" else
                    node.meta.get("val") if kind == "placeholder" else None)

        by_input: dict[tuple, list[torch.fx.Node]] = {}
        for node in graph.nodes:
            operands = len(ops[node.target][0]) if node.op == "call_function" and node.target in ops else None
            rest = node.args[1 + operands:] if operands else ()  # (bias, then small_linear's live entries)
            if (operands and not node.kwargs and len(node.args) >= 1 + operands
                    and all(isinstance(weight(a), torch.Tensor) for a in node.args[1: 1 + operands])
                    and (not rest or rest[0] is None)):
                extra = tuple(id(attrgetter(a.target)(module)) if isinstance(a, torch.fx.Node) and a.op == "get_attr"
                              else a for a in rest[1:])  # (one tensor read through several get_attr nodes: alike)
                by_input.setdefault((node.target, node.args[0], extra), []).append(node)
        order = {n: i for i, n in enumerate(graph.nodes)}  # nodes inserted later are never compared
        for (op, _, _), calls in by_input.items():
            if len(calls) < 2:
                continue
            dims, block = ops[op]
            tensors = {n: [weight(a) for a in n.args[1: 1 + len(dims)]] for n in calls}
            calls.sort(key=lambda n: (tensors[n][0].untyped_storage()._cdata, tensors[n][0].storage_offset()))
            run: list[torch.fx.Node] = []
            for node in calls + [None]:
                if node is not None and (not run or _continues(tensors[run[-1]], tensors[node], dims)):
                    run.append(node)
                    continue
                if len(run) >= 2:
                    self._fuse(graph, module, op, dims, block, run, [tensors[n] for n in run], order)
                run = [node] if node is not None else []

    @staticmethod
    def _fuse(graph, module, op, dims, block, calls, operands, order) -> None:
        name = f"_{calls[0].name}_fused"  # (FX node names are unique in a graph)
        blocks = sum(w[0].shape[0] for w in operands)
        spans = []  # each weight operand over the calls' span: the first call's, its dim d as long as theirs together
        for i, d in enumerate(dims):
            first = operands[0][i]
            shape = list(first.shape)
            shape[d] = sum(w[i].shape[d] for w in operands)
            spans.append((shape, first.stride(), first.storage_offset()))
        x = calls[0].args[0]
        earliest = min(calls, key=order.__getitem__)
        val = x.meta.get("val")
        with graph.inserting_before(earliest):
            attrs = []
            for i, (span, source) in enumerate(zip(spans, calls[0].args[1:])):
                if source.op == "get_attr":  # a frozen constant: a buffer viewing the span
                    module.register_buffer(f"{name}_{i}", operands[0][i].as_strided(*span), persistent=False)
                    attrs.append(graph.get_attr(f"{name}_{i}"))
                else:  # a graph input: a view of its storage, made in the graph (as_strided's offset is absolute)
                    attrs.append(graph.call_function(torch.ops.aten.as_strided.default, (source, *span)))
                    attrs[-1].meta["val"] = operands[0][i].as_strided(*span)
            extra = calls[0].args[2 + len(operands[0]):]  # (small_linear's live entries, after the bias)
            out = graph.call_function(op, (x, *attrs, None, *extra))
            if val is not None:
                with val.fake_mode:
                    out.meta["val"] = val.new_empty(*val.shape[:-1], blocks * block)
            parts, start = [], 0
            for w in operands:  # copies of the slices: viewing a slice, a symbolic rows' count would specialise at 1
                end = start + w[0].shape[0] * block
                piece = graph.call_function(torch.ops.aten.slice.Tensor, (out, -1, start, end))
                parts.append(graph.call_function(torch.ops.aten.clone.default, (piece,)))
                if val is not None:  # (fake values compute in their own mode)
                    piece.meta["val"] = out.meta["val"][..., start:end]
                    parts[-1].meta["val"] = piece.meta["val"].clone()
                start = end
        for node, part in zip(calls, parts):  # outside the insertion point: `earliest` is among the erased
            node.replace_all_uses_with(part)
            graph.erase_node(node)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
