"""The small-row bf16 GEMM kernel (inference/small_gemm.cpp): exact to bf16 rounding, row-independent, used only
inside the runners' decoding sessions (also through torch.compile), and transparent to the model otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny import tiny_model

from inference.cpu.kernels import kernels_available
from inference.cpu.small_gemm import SmallRowLinear, small_row_kernel, use_small_row_kernel


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not kernels_available():
        pytest.skip("the small-row kernel needs a CPU with AVX512-BF16 and a C++ compiler")


def linear(n_in: int, n_out: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    module = nn.Linear(n_in, n_out, bias=bias).to(torch.bfloat16)
    if bias:
        nn.init.normal_(module.bias)
    return module


# 576 in_features take the AMX tiles where the CPU has them (K a multiple of 32), 578 the vdpbf16ps loop always;
# past 16 rows AMX makes a second pass of the rows left
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n_in", [576, 578])
def test_kernel_matches_the_exact_product_to_bf16_rounding(rows, bias, n_in):
    module = linear(n_in, 192, bias)
    x = torch.randn(1, rows, n_in).to(torch.bfloat16)
    exact = x.double() @ module.weight.double().T + (module.bias.double() if bias else 0)
    reference = F.linear(x, module.weight, module.bias)
    assert use_small_row_kernel(module) == 1 and isinstance(module, SmallRowLinear)
    with small_row_kernel():
        ours = module(x)
    assert ours.shape == (1, rows, 192) and ours.dtype == torch.bfloat16
    # fp32 accumulation rounded once to bf16: within one bf16 step of the exact value, as PyTorch's own linear
    ulp = exact.abs().clamp_min(1e-3) * 2.0 ** -7
    assert ((ours.double() - exact).abs() <= ulp + 1e-4).all()
    assert ((reference.double() - exact).abs() <= ulp + 1e-4).all()


def test_a_rows_result_does_not_depend_on_the_other_rows():
    module = linear(1536, 576, bias=False)
    use_small_row_kernel(module)
    x = torch.randn(40, 1536).to(torch.bfloat16)
    with small_row_kernel(64):
        together = module(x)
        for i in (0, 7, 8, 15, 16, 39):
            assert torch.equal(module(x[i : i + 1]), together[i : i + 1])
        assert torch.equal(module(x[:20]), together[:20])


def test_only_the_live_entries_rows_are_multiplied_also_compiled():
    """Inside live_entries(b) the kernel (bf16 weights and int8 copies) multiplies the rows of the input's first b
    entries (a batch's rows still decoding) and gives zeros for the rest; a compiled step reads the value at each
    call, without recompiling."""
    from inference.cpu.small_gemm import int8_weights, live_entries, use_int8_weights

    module = linear(576, 192, bias=True)
    use_small_row_kernel(module)
    use_int8_weights(module)
    x = torch.randn(4, 3, 576).to(torch.bfloat16)
    counts = torch._dynamo.utils.counters["stats"]
    for int8 in (False, True):
        compiled = torch.compile(module)
        with small_row_kernel(), int8_weights(int8), torch.inference_mode():
            full = module(x)
            for step in (module, compiled):
                calls = counts["unique_graphs"]
                for b in (4, 2, 1, 0):
                    with live_entries(b):
                        out = step(x)
                    assert torch.equal(out[:b], full[:b]) and not out[b:].any(), (int8, step, b)
                assert torch.equal(step(x), full)  # all entries again outside the context
                if step is compiled:
                    assert counts["unique_graphs"] == calls + 1  # one graph for every value


def test_kernel_is_used_only_inside_the_session_and_for_small_inputs():
    """A zeroed packed copy makes the kernel's path visible: it returns the bias; nn.Linear's path the product."""
    module = linear(64, 96, bias=True)
    use_small_row_kernel(module)
    module.packed.zero_()
    small, large = torch.randn(4, 64).to(torch.bfloat16), torch.randn(5, 64).to(torch.bfloat16)
    assert torch.equal(module(small), F.linear(small, module.weight, module.bias))  # outside: nn.Linear exactly
    with small_row_kernel(max_rows=4):
        assert torch.equal(module(small), module.bias.expand(4, 96))
        assert torch.equal(module(large), F.linear(large, module.weight, module.bias))  # too many rows
    step = torch.compile(lambda x: module(x) * 1, dynamic=False)
    with torch.inference_mode():
        with small_row_kernel(max_rows=4):
            assert torch.equal(step(small), module.bias.expand(4, 96))
        assert torch.equal(step(small), F.linear(small, module.weight, module.bias))  # the guard recompiles
        with small_row_kernel(max_rows=4):
            assert torch.equal(step(small), module.bias.expand(4, 96))


def test_conversion_keeps_parameters_ties_and_state_dict():
    target = tiny_model("llama", dtype=torch.bfloat16, tie_word_embeddings=True, vocab_size=320)
    keys = list(target.state_dict())
    converted = use_small_row_kernel(target)
    assert converted == 8 * 7 + 1  # q, k, v, o, gate, up, down per layer, and lm_head
    assert list(target.state_dict()) == keys
    assert target.lm_head.weight is target.model.embed_tokens.weight
    assert use_small_row_kernel(target) == converted  # converting twice is a no-op
    assert use_small_row_kernel(tiny_model("llama")) == 0  # float32: only when asked (the batch runner)
    assert use_small_row_kernel(tiny_model("llama"), float32=True) == converted  # small_gemm_avx2.cpp


def test_a_float32_copy_of_a_converted_model_is_packed_for_float32():
    """copy.deepcopy of a model in use (converted in bf16), then .float() (the bench's float32 reference): converted
    again, its small-row products are float32 ones, not the bf16 layout read as float32."""
    import copy

    target = tiny_model("llama", dtype=torch.bfloat16, vocab_size=320)
    use_small_row_kernel(target)
    reference = copy.deepcopy(target).float()
    assert use_small_row_kernel(reference, float32=True) == 8 * 7 + 1
    x = torch.randn(3, reference.lm_head.in_features)
    with small_row_kernel(max_rows=4):
        assert torch.allclose(reference.lm_head(x), F.linear(x, reference.lm_head.weight), atol=1e-5)


@pytest.mark.parametrize("compile", [False, True])
def test_the_static_runner_verifies_with_the_kernel_close_to_pytorchs_linears(compile):
    """A bf16 tree verification on the static runner runs the kernel (seen in the profile) and gives the logits
    of PyTorch's linears up to bf16 rounding."""
    from torch.profiler import ProfilerActivity, profile

    from drafthead.masks import causal_allowed
    from inference.runners.static import StaticRunner

    target = tiny_model("llama", dtype=torch.bfloat16, num_layers=2)  # compiled: each layer adds graph to build
    runner = StaticRunner(target, [0, 1], compile=compile)
    assert runner.small_rows and isinstance(target.model.layers[0].mlp.down_proj, SmallRowLinear)
    ids = torch.randint(3, 320, (1, 20), generator=torch.Generator().manual_seed(0))

    def verify_last_four():
        with runner.session(), torch.inference_mode():
            runner.reset(1, 20)
            runner.prefill(ids[:, :16])
            return runner.verify(ids[:, 16:], torch.arange(4)[None], causal_allowed(4, 0, ids.device)[None])

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logits, features, _ = verify_last_four()
    assert any("small_linear" in event.key for event in prof.key_averages())
    runner.small_rows = False  # the same runner with PyTorch's linears
    ref_logits, ref_features, _ = verify_last_four()
    scale = ref_logits.abs().max()
    assert (logits - ref_logits).abs().max() <= 0.05 * scale
    assert (features - ref_features).abs().max() <= 0.05 * ref_features.abs().max()


def test_a_batch_runners_verify_multiplies_rows_times_tree_tokens_with_the_kernel():
    """4 rows × 8 tree tokens = 32 rows: past the single-sequence limit (KERNEL_ROWS), within the batch runner's
    (BATCH_KERNEL_ROWS), so its session runs the kernel where a plain session would use nn.Linear."""
    from torch.profiler import ProfilerActivity, profile

    from inference.runners.static import StaticRunner
    from inference.cpu.small_gemm import BATCH_KERNEL_ROWS, KERNEL_ROWS

    assert KERNEL_ROWS < 4 * 8 <= BATCH_KERNEL_ROWS
    runner = StaticRunner(tiny_model("llama", dtype=torch.bfloat16, head_dim=32), [])
    ids = torch.randint(3, 320, (4, 12), generator=torch.Generator().manual_seed(0))
    chain = torch.ones(8, 8, dtype=torch.bool).tril().expand(4, 8, 8)
    depths = torch.arange(8).expand(4, 8)

    def kernel_calls(session) -> int:
        with session, torch.inference_mode():
            runner.reset(4, 12 + 8)
            runner.prefill(ids)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                runner.verify(ids[:, :8], depths, chain)
        return sum(event.count for event in prof.key_averages() if "small_linear" in event.key)

    assert kernel_calls(runner.session()) > 0
    assert kernel_calls(small_row_kernel()) == 0  # the single-sequence limit: 32 rows go to nn.Linear


class Projections(nn.Module):
    """An attention's projections: q, k and v read the same input, o another one."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.o = (nn.Linear(64, n, bias=False).to(dtype) for n in (64, 32, 32, 64))


class KernelCalls(nn.Module):
    """The projections' kernel calls as a compiled step's graph holds them (weights read with get_attr); `library`:
    the op library of the projections' dtype."""

    def __init__(self, projections: Projections, library: str = "drafthead_kernels"):
        super().__init__()
        self.p = projections
        self.library = library

    def forward(self, x):
        op = getattr(torch.ops, self.library).small_linear.default
        return (op(x, self.p.q.packed, None), op(x, self.p.k.packed, None) * 2, op(x, self.p.v.packed, None),
                op(x + 1, self.p.o.packed, None))


class LiveKernelCalls(KernelCalls):
    """The same, each call also passed the live entries' tensor (as SmallRowLinear passes it)."""

    def forward(self, x):
        from inference.cpu import small_gemm

        op, live = getattr(torch.ops, self.library).small_linear.default, small_gemm._live
        return (op(x, self.p.q.packed, None, live), op(x, self.p.k.packed, None, live) * 2,
                op(x, self.p.v.packed, None, live), op(x + 1, self.p.o.packed, None, live))


class Int8KernelCalls(KernelCalls):
    """The same with the int8 copies (use_int8_weights): weight and columns read with get_attr."""

    def forward(self, x):
        op = getattr(torch.ops, self.library).small_linear_int8.default
        p = self.p
        return (op(x, p.q.int8_weight, p.q.int8_columns, None), op(x, p.k.int8_weight, p.k.int8_columns, None) * 2,
                op(x, p.v.int8_weight, p.v.int8_columns, None), op(x + 1, p.o.int8_weight, p.o.int8_columns, None))


def test_siblings_sharing_an_input_become_one_call_with_bit_identical_results():
    """use_small_row_kernel packs a module's same-width linears back to back in one buffer; the graph pass then
    multiplies the ones that share an input (q, k, v; not o) in one call over that span, sliced per call."""
    projections = Projections()
    assert use_small_row_kernel(projections) == 4
    packed = [getattr(projections, name).packed for name in "qkvo"]
    assert len({p.untyped_storage().data_ptr() for p in packed}) == 1  # one buffer, no copy
    assert [p.storage_offset() for p in packed] == [0, 64 * 64, 96 * 64, 128 * 64]
    x = torch.randn(3, 64).to(torch.bfloat16)
    after = fused_calls(KernelCalls(projections), torch.ops.drafthead_kernels.small_linear.default, x)
    with small_row_kernel():  # and the modules' own path agrees with both
        assert torch.equal(projections.k(x) * 2, after[1])
    # the calls SmallRowLinear makes (with the live entries' tensor) fuse alike, keeping it
    from inference.cpu.small_gemm import live_entries

    with live_entries(2):
        live = fused_calls(LiveKernelCalls(projections), torch.ops.drafthead_kernels.small_linear.default, x)
    assert all(torch.equal(a[:2], b[:2]) and not a[2:].any() for a, b in zip(live[:3], after[:3]))


def fused_calls(calls_module: nn.Module, op, x: torch.Tensor) -> tuple:
    """Trace the module's four kernel calls, run FuseSiblingLinears on the graph: q/k/v become one call, o stays
    alone (another input), and the outputs keep their bits. Returns the fused graph's outputs."""
    from inference.cpu.small_gemm import FuseSiblingLinears

    graph_module = torch.fx.symbolic_trace(calls_module)
    before = graph_module(x)

    def calls():
        return sum(node.target is op for node in graph_module.graph.nodes)

    assert calls() == 4
    FuseSiblingLinears()(graph_module.graph)
    graph_module.recompile()
    assert calls() == 2
    after = graph_module(x)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    return after


def test_int8_siblings_sharing_an_input_become_one_call_with_bit_identical_results():
    """use_int8_weights lays the siblings' int8 weights back to back and their columns side by side; the graph
    pass fuses the int8 calls that share an input as it does the bf16 ones."""
    from inference.cpu.small_gemm import int8_weights, use_int8_weights

    projections = Projections()
    assert use_int8_weights(projections) == 4
    weights = [getattr(projections, name).int8_weight for name in "qkvo"]
    columns = [getattr(projections, name).int8_columns for name in "qkvo"]
    assert len({w.untyped_storage().data_ptr() for w in weights}) == 1  # one buffer each, no copy
    assert [w.storage_offset() for w in weights] == [0, 64 * 64, 96 * 64, 128 * 64]
    assert [c.storage_offset() for c in columns] == [0, 64, 96, 128] and columns[0].stride() == (192, 1)
    x = torch.randn(3, 64).to(torch.bfloat16)
    after = fused_calls(Int8KernelCalls(projections), torch.ops.drafthead_kernels.small_linear_int8.default, x)
    with int8_weights():  # and the modules' own path agrees with both
        assert torch.equal(projections.k(x) * 2, after[1])


# ---------------------------------------------------------------------------------------------- int8 drafting
@pytest.mark.parametrize("rows", [1, 5, 8, 11])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_kernel_computes_the_reference_int8_product(rows, bias):
    """The AVX512-VNNI kernel (packed weights) gives small_gemm's reference int8 math (plain int8 weights) to bf16
    rounding, and both stay within int8 quantisation error of the bf16 product."""
    from inference.cpu.small_gemm import int8_linear, pack_int8, quantize_weight_int8

    module = linear(576, 192, bias)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    plain, columns = quantize_weight_int8(module.weight)
    ours = int8_linear(x, pack_int8(plain), columns, module.bias)
    reference = int8_linear(x, plain, columns, module.bias)
    assert ours.shape == (rows, 192) and ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), reference.float(), rtol=2 ** -7, atol=1e-3)
    exact = F.linear(x.float(), module.weight.float(), module.bias.float() if bias else None)
    error = (ours.float() - exact).abs().max() / exact.abs().max()
    assert 0 < error < 0.03  # quantised: close, not equal


def test_int8_copies_are_used_only_inside_int8_weights_also_compiled():
    """use_int8_weights keeps parameters, ties and state dict; the int8 copy answers only inside int8_weights()
    (a zeroed copy makes it visible: the output is the bias), also through a compiled step (the global is guarded);
    it combines with the bf16 kernel in either order; a float32 model's copies are packed for the AVX2 kernel."""
    from inference.cpu.small_gemm import int8_weights, use_int8_weights

    module = linear(64, 96, bias=True)
    assert use_int8_weights(module) == 1 and module.int8_weight.dim() == 4  # packed for the kernel
    use_small_row_kernel(module)
    assert isinstance(module, SmallRowLinear) and module.int8_weight is not None
    module.int8_weight.zero_()
    module.int8_columns[1].zero_()  # (the zero point's correction of the old weights)
    x = torch.randn(4, 64).to(torch.bfloat16)
    assert torch.equal(module(x), F.linear(x, module.weight, module.bias))
    with int8_weights():
        assert torch.equal(module(x), module.bias.expand(4, 96))
    step = torch.compile(lambda x: module(x) * 1, dynamic=False)
    with torch.inference_mode():
        assert torch.equal(step(x), F.linear(x, module.weight, module.bias))
        with int8_weights():
            assert torch.equal(step(x), module.bias.expand(4, 96))
        with int8_weights(False):
            assert torch.equal(step(x), F.linear(x, module.weight, module.bias))

    target = tiny_model("llama", dtype=torch.bfloat16, tie_word_embeddings=True, vocab_size=320)
    keys = list(target.state_dict())
    count = use_int8_weights(target)
    assert count >= 8 * 6 + 1 and use_int8_weights(target) == count  # a second call adds nothing
    assert list(target.state_dict()) == keys and target.lm_head.weight is target.model.embed_tokens.weight
    ids = torch.randint(3, 320, (2, 7))
    with torch.inference_mode():
        full = target(ids).logits
        with int8_weights():
            drafted = target(ids).logits
    assert not torch.equal(full, drafted) and (drafted - full).abs().max() < 0.2 * full.abs().max()
    fp32 = tiny_model("llama")  # packed for the AVX2 kernel (every AVX512-BF16 CPU has AVX2)
    assert use_int8_weights(fp32) > 0 and fp32.model.layers[0].mlp.up_proj.int8_weight.dim() == 3


def test_int8_self_draft_in_bf16_verifies_to_the_same_tokens():
    """bf16 tiny target, 3 left-padded rows: self-speculation drafting with int8 weights (the kernel) gives every
    row the same tokens as drafting with the bf16 weights (the target verifies both), and its drafts are accepted."""
    from test_batch import left_padded, row_prompts
    from test_inference_greedy import near_bigram_target

    from inference import SpeculativeGenerator
    from inference.drafters.self_draft import StreamingSelfDrafter

    target = near_bigram_target("llama", eps=0.05).to(torch.bfloat16)
    ids, mask = left_padded(row_prompts(target.config.vocab_size)[:3])
    outs = {}
    for weights in ("same", "int8"):
        gen = SpeculativeGenerator(target, StreamingSelfDrafter(target, sink=2, window=4, gamma=3, weights=weights))
        outs[weights] = gen.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(outs["same"].sequences, outs["int8"].sequences)
    assert outs["int8"].stats.mean_accepted > 1.2  # the int8 draft is accepted often


def test_the_batched_head_drafter_multiplies_its_linears_with_the_kernel():
    """HeadDrafter turns a bf16 head's linears into SmallRowLinear,
    and its drafting inside the batch runner's session runs the kernel: only the head runs in propose()."""
    from test_inference_greedy import TREES, random_head
    from torch.profiler import ProfilerActivity, profile

    from inference.drafters.eagle import HeadDrafter
    from inference.runners.static import StaticRunner
    from inference.sampling import SamplingParams

    target = tiny_model("llama", dtype=torch.bfloat16, head_dim=32)
    head = random_head(target).attach_target(target).to(torch.bfloat16)
    assert not isinstance(head.fc, SmallRowLinear)
    drafter = HeadDrafter(head, TREES["wide"], sink=4, window=16)
    assert isinstance(head.fc, SmallRowLinear) and isinstance(head.midlayer.mlp.down_proj, SmallRowLinear)
    runner = StaticRunner(target, drafter.feature_layers)
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    runner.reset(2, 24 + 16)
    with runner.session(), torch.inference_mode():
        logits, features = runner.prefill(ids, torch.ones_like(ids))
        drafter.begin(runner, ids, torch.ones_like(ids), features)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            tree = drafter.propose(logits.argmax(dim=-1), SamplingParams())
    assert any("small_linear" in event.key for event in prof.key_averages())
    assert tree.tokens.shape == (2, TREES["wide"].tree_size)
