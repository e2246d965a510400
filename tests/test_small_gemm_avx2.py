"""The small-row float32 GEMM kernel (inference/small_gemm_avx2.cpp, for CPUs where float32 is the fast dtype):
exact to float32 rounding, row-independent, used only inside the batch runner's decoding sessions and only up to
the session's row limit (also through torch.compile), and transparent to the model otherwise; and its int8
weight-only product for the self-draft's int8 copies."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny import tiny_model

from inference.cpu.kernels import avx2_kernels_available
from inference.cpu.small_gemm import (BATCH_KERNEL_ROWS, SmallRowLinear, int8_linear, int8_weights, quantize_weight_int8,
                                   small_row_kernel, use_int8_weights, use_small_row_kernel)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not avx2_kernels_available():
        pytest.skip("the float32 small-row kernel needs a CPU with AVX2 and a C++ compiler")


def linear(n_in: int, n_out: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    module = nn.Linear(n_in, n_out, bias=bias)
    if bias:
        nn.init.normal_(module.bias)
    return module


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 16, 32])
@pytest.mark.parametrize("n_in", [40, 600])  # shorter than one 256-k piece; two and a part
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_the_exact_product_to_float32_rounding(rows, n_in, bias):
    module = linear(n_in, 96, bias)
    x = torch.randn(2, rows, n_in)
    exact = x.double() @ module.weight.double().T + (module.bias.double() if bias else 0)
    assert use_small_row_kernel(module, float32=True) == 1 and isinstance(module, SmallRowLinear)
    assert module.packed.shape == (96 // 16, n_in, 16)
    with small_row_kernel(max_rows=64):
        ours = module(x)
    assert ours.dtype == torch.float32 and ours.shape[1:] == (rows, 96)
    # a float32 sum of n_in products: within n_in float32 steps of the largest product (as PyTorch's own linear)
    bound = n_in * 2.0 ** -23 * (x.abs().amax() * module.weight.abs().amax()).double() + 1e-6
    assert ((ours.double() - exact).abs() <= bound).all()


def test_a_rows_result_does_not_depend_on_the_other_rows():
    module = linear(1536, 592, bias=True)  # 37 blocks: a single row takes three a pass, and one alone
    use_small_row_kernel(module, float32=True)
    x = torch.randn(BATCH_KERNEL_ROWS, 1536)
    with small_row_kernel(BATCH_KERNEL_ROWS):
        together = module(x)
        for i in (0, 3, 4, 7, BATCH_KERNEL_ROWS - 1):
            assert torch.equal(module(x[i : i + 1]), together[i : i + 1])
        assert not torch.equal(together, F.linear(x, module.weight, module.bias))  # the kernel ran, not MKL


def test_kernel_is_used_only_inside_the_session_and_for_few_rows():
    """A zeroed packed copy makes the kernel's path visible: it returns the bias; nn.Linear's path the product.
    Past the session's row limit nn.Linear multiplies."""
    module = linear(64, 96, bias=True)
    use_small_row_kernel(module, float32=True)
    module.packed.zero_()
    small, large = torch.randn(4, 64), torch.randn(65, 64)
    assert torch.equal(module(small), F.linear(small, module.weight, module.bias))  # outside: nn.Linear exactly
    with small_row_kernel(max_rows=64):
        assert torch.equal(module(small), module.bias.expand(4, 96))
        assert torch.equal(module(large), F.linear(large, module.weight, module.bias))
    step = torch.compile(lambda x: module(x) * 1, dynamic=False)
    with torch.inference_mode():
        with small_row_kernel(max_rows=4):
            assert torch.equal(step(small), module.bias.expand(4, 96))
        assert torch.equal(step(small), F.linear(small, module.weight, module.bias))  # the guard recompiles


@pytest.mark.parametrize("compile", [False, True])
def test_the_batch_runner_verifies_float32_with_the_kernel_and_pytorchs_logits(compile):
    """A float32 batched verification (4 rows × 2 tokens) runs the kernel (seen in the profile) and gives the
    logits of PyTorch's linears to float32 rounding."""
    from torch.profiler import ProfilerActivity, profile

    from inference.runners.static import StaticRunner

    target = tiny_model("llama", num_layers=2)  # compiled: each layer adds graph to build
    runner = StaticRunner(target, [0, 1], compile=compile)
    assert runner.small_rows and isinstance(target.lm_head, SmallRowLinear)
    ids = torch.randint(3, 320, (4, 14), generator=torch.Generator().manual_seed(0))
    chain = torch.ones(2, 2, dtype=torch.bool).tril().expand(4, 2, 2)
    depths = torch.arange(2).expand(4, 2)

    def verify_last_two():
        with runner.session(), torch.inference_mode():
            runner.reset(4, 14)
            runner.prefill(ids[:, :12])
            return runner.verify(ids[:, 12:], depths, chain)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logits, features, _ = verify_last_two()
    assert any("small_linear" in event.key for event in prof.key_averages())
    runner.small_rows = False  # the same runner with PyTorch's linears
    ref_logits, ref_features, _ = verify_last_two()
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(features, ref_features, rtol=1e-4, atol=1e-4)


def test_float32_siblings_sharing_an_input_become_one_call_with_bit_identical_results():
    from test_small_gemm import KernelCalls, Projections, fused_calls

    projections = Projections(torch.float32)
    assert use_small_row_kernel(projections, float32=True) == 4
    packed = [getattr(projections, name).packed for name in "qkvo"]
    assert len({p.untyped_storage().data_ptr() for p in packed}) == 1  # one buffer, no copy
    x = torch.randn(3, 64)
    after = fused_calls(KernelCalls(projections, "drafthead_avx2"), torch.ops.drafthead_avx2.small_linear.default, x)
    with small_row_kernel():  # and the modules' own path agrees with both
        assert torch.equal(projections.k(x) * 2, after[1])


def test_siblings_fuse_in_an_unfrozen_compiled_step_whose_graph_is_cached_whole():
    """A decoding step whose linears all run the kernel compiles unfrozen (scoped_settings): its packed weights are
    graph inputs, which the pass still fuses (their fake values share the buffer's storage), and the graph goes to
    AOTAutograd's cache, which a frozen graph bypasses: the next process loads it instead of compiling."""
    from test_small_gemm import KernelCalls, Projections
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    from inference.cpu.small_gemm import FuseSiblingLinears
    from inference.runners.compile import scoped_settings

    class Counted(FuseSiblingLinears):
        calls: list[int] = []

        def __call__(self, graph):
            super().__call__(graph)
            op = torch.ops.drafthead_avx2.small_linear.default
            self.calls.append(sum(node.target is op for node in graph.nodes))

    projections = Projections(torch.float32)
    use_small_row_kernel(projections, float32=True)
    calls = KernelCalls(projections, "drafthead_avx2")
    x = torch.randn(3, 64)
    torch._dynamo.reset()
    bypassed = counters["aot_autograd"]["autograd_cache_bypass"]
    with scoped_settings(cpu=True), fresh_cache():  # (a cache hit skips the pass)
        compiled = torch.compile(calls, options={"post_grad_custom_post_pass": Counted()})(x)
    assert Counted.calls == [2]  # q/k/v as one call, o alone
    assert all(torch.equal(a, b) for a, b in zip(compiled, calls(x)))
    assert counters["aot_autograd"]["autograd_cache_bypass"] == bypassed
    assert counters["aot_autograd"]["autograd_cache_saved"] + counters["aot_autograd"]["autograd_cache_hit"] > 0


# ---------------------------------------------------------------------------------------------- int8 drafting
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_kernel_multiplies_float32_rows_by_the_dequantised_weights(rows, bias):
    """A float32 model's int8 copy (use_int8_weights) is packed for the AVX2 kernel, which multiplies the float32
    rows (not quantised) by the int8 weights times each column's scale: to float32 rounding of that product,
    row-independent, and within int8 quantisation error of the float32 product."""
    # in_features a multiple of 16: two 256-k pieces and a part; 10 blocks: one row takes three a pass, the rest alone
    module = linear(608, 160, bias)
    assert use_int8_weights(module) == 1 and module.int8_weight.shape == (160 // 16, 608, 16)
    plain, columns = quantize_weight_int8(module.weight)
    torch.testing.assert_close(module.int8_columns, columns, rtol=0, atol=0)
    x = torch.randn(rows, 608)
    ours = int8_linear(x, module.int8_weight, module.int8_columns, module.bias)
    dequantised = plain.double() * columns[0].double()[:, None]
    exact = x.double() @ dequantised.T + (module.bias.double() if bias else 0)
    assert ours.dtype == torch.float32 and ours.shape == (rows, 160)
    bound = 608 * 2.0 ** -22 * (x.abs().amax() * dequantised.abs().amax()) + 1e-6
    assert ((ours.double() - exact).abs() <= bound).all()
    assert torch.equal(int8_linear(x[-1:], module.int8_weight, module.int8_columns, module.bias), ours[-1:])
    full = F.linear(x, module.weight, module.bias)
    error = (ours - full).abs().max() / full.abs().max()
    assert 0 < error < 0.03  # quantised: close, not equal


def test_float32_int8_copies_are_used_only_inside_int8_weights_and_fuse_bit_identically():
    """The int8 copy answers only inside int8_weights() (a zeroed copy makes it visible: the output is the bias),
    also through a compiled step; siblings' int8 copies lie back to back and their calls fuse with the same bits."""
    from test_small_gemm import Int8KernelCalls, Projections, fused_calls

    module = linear(64, 96, bias=True)
    use_int8_weights(module)
    module.int8_weight.zero_()
    x = torch.randn(4, 64)
    assert torch.equal(module(x), F.linear(x, module.weight, module.bias))
    step = torch.compile(lambda x: module(x) * 1, dynamic=False)
    with torch.inference_mode():
        with int8_weights():
            assert torch.equal(module(x), module.bias.expand(4, 96))
            assert torch.equal(step(x), module.bias.expand(4, 96))
        assert torch.equal(step(x), F.linear(x, module.weight, module.bias))

    projections = Projections(torch.float32)
    assert use_int8_weights(projections) == 4
    weights = [getattr(projections, name).int8_weight for name in "qkvo"]
    assert len({w.untyped_storage().data_ptr() for w in weights}) == 1  # one buffer, no copy
    calls = Int8KernelCalls(projections, "drafthead_avx2")
    after = fused_calls(calls, torch.ops.drafthead_avx2.small_linear_int8.default, x)
    with int8_weights():  # and the modules' own path agrees with both
        assert torch.equal(projections.k(x) * 2, after[1])


def test_rows_that_stopped_cost_the_batch_runner_no_gemm_work():
    """Inside live_entries(b) the float32 kernel multiplies only the rows of the input's first b entries (zeros for
    the rest); the batch runner's verify sets it to its rows in use, so after rows stop (keep_rows) the padding rows
    of its fixed-shape step reach the lm_head as zeros, while the rows in use get the logits of a batch of only them."""
    from inference.runners.static import StaticRunner
    from inference.cpu.small_gemm import live_entries

    module = linear(600, 96, bias=True)
    use_small_row_kernel(module, float32=True)
    use_int8_weights(module)
    x = torch.randn(4, 3, 600)
    for int8 in (False, True):  # the float32 weights and their int8 copy
        with small_row_kernel(BATCH_KERNEL_ROWS), int8_weights(int8):
            full = module(x)
            with live_entries(2):
                part = module(x)
        assert torch.equal(part[:2], full[:2]) and not part[2:].any()

    ids = torch.randint(3, 320, (4, 14), generator=torch.Generator().manual_seed(0))
    chain = torch.ones(2, 2, dtype=torch.bool).tril().expand(2, 2, 2)
    depths = torch.arange(2).expand(2, 2)
    target = tiny_model("llama")
    seen = []
    target.lm_head.register_forward_hook(lambda module, args, out: seen.append(out))

    def verify(rows: list[int], keep: list[int] | None) -> torch.Tensor:
        runner = StaticRunner(target, [])
        with runner.session(), torch.inference_mode():
            runner.reset(len(rows), 14)
            runner.prefill(ids[rows, :12])
            if keep is not None:
                runner.keep_rows(torch.tensor(keep))
            return runner.verify(ids[[0, 2], 12:], depths, chain)[0]

    after_stops = verify([0, 1, 2, 3], keep=[0, 2])
    assert seen[-1].shape[0] == 4 and seen[-1][:2].any() and not seen[-1][2:].any()
    torch.testing.assert_close(after_stops, verify([0, 2], keep=None), rtol=1e-5, atol=1e-5)


def test_copies_made_under_inference_mode_are_the_tensors_made_outside_it():
    """Inductor's cache key for a compiled step records whether each constant was made under inference mode: the
    packed and int8 copies a tuning process makes there must match a later process's, made outside it."""
    copies = {}
    for inference in (False, True):
        model = tiny_model("llama", vocab_size=320)
        with torch.inference_mode(inference):
            use_small_row_kernel(model, float32=True)
            use_int8_weights(model)
        copies[inference] = [(name, b.is_inference(), b.requires_grad) for name, b in model.named_buffers()
                             if name.endswith(("packed", "int8_weight", "int8_columns"))]
    assert len(copies[True]) == 3 * (8 * 7 + 1)
    assert copies[True] == copies[False]
