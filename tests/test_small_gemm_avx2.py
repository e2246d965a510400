"""The small-row float32 GEMM kernel (inference/small_gemm_avx2.cpp, for CPUs where float32 is the fast dtype):
exact to float32 rounding, row-independent, used only inside the batch runner's decoding sessions and only up to
FLOAT_KERNEL_ROWS rows (also through torch.compile), and transparent to the model otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny import tiny_model

from inference.cpu_kernels import avx2_kernels_available
from inference.small_gemm import FLOAT_KERNEL_ROWS, SmallRowLinear, small_row_kernel, use_small_row_kernel


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


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 16])
@pytest.mark.parametrize("n_in", [40, 600])  # shorter than one 256-k piece; two and a part
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_the_exact_product_to_float32_rounding(rows, n_in, bias):
    module = linear(n_in, 96, bias)
    x = torch.randn(2, rows, n_in)
    exact = x.double() @ module.weight.double().T + (module.bias.double() if bias else 0)
    assert use_small_row_kernel(module, float32=True) == 1 and isinstance(module, SmallRowLinear)
    assert module.packed.shape == (96 // 16, n_in, 16)
    with small_row_kernel(max_rows=64):
        ours = module(x) if 2 * rows <= FLOAT_KERNEL_ROWS else module(x[:1])
    assert ours.dtype == torch.float32 and ours.shape[1:] == (rows, 96)
    # a float32 sum of n_in products: within n_in float32 steps of the largest product (as PyTorch's own linear)
    bound = n_in * 2.0 ** -23 * (x.abs().amax() * module.weight.abs().amax()).double() + 1e-6
    assert ((ours.double() - exact[: ours.shape[0]]).abs() <= bound).all()


def test_a_rows_result_does_not_depend_on_the_other_rows():
    module = linear(1536, 576, bias=True)
    use_small_row_kernel(module, float32=True)
    x = torch.randn(FLOAT_KERNEL_ROWS, 1536)
    with small_row_kernel():
        together = module(x)
        for i in (0, 3, 4, 7, FLOAT_KERNEL_ROWS - 1):
            assert torch.equal(module(x[i : i + 1]), together[i : i + 1])
        assert not torch.equal(together, F.linear(x, module.weight, module.bias))  # the kernel ran, not MKL


def test_kernel_is_used_only_inside_the_session_and_for_few_rows():
    """A zeroed packed copy makes the kernel's path visible: it returns the bias; nn.Linear's path the product.
    Past FLOAT_KERNEL_ROWS rows PyTorch's GEMM is as fast, so even a session that allows more uses nn.Linear."""
    module = linear(64, 96, bias=True)
    use_small_row_kernel(module, float32=True)
    module.packed.zero_()
    small, large = torch.randn(4, 64), torch.randn(FLOAT_KERNEL_ROWS + 1, 64)
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
    logits of PyTorch's linears to float32 rounding; a single-sequence runner leaves float32 linears alone."""
    from torch.profiler import ProfilerActivity, profile

    from inference.batch_runner import BatchRunner
    from inference.static_runner import StaticRunner

    assert not StaticRunner(tiny_model("llama"), [2, 4]).small_rows
    target = tiny_model("llama")
    runner = BatchRunner(target, [2, 4], compile=compile)
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
