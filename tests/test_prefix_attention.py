"""The prefix-attention kernels, each test for both: AVX512-BF16 in bf16 (inference/prefix_attention.cpp: the
float32 attention to bf16 rounding) and AVX2 in float32 (prefix_attention_avx2.cpp: to float32 rounding). Each reads
only the used slots, is row-independent, honours masks and the rows in use, and is what a static runner of its
dtype dispatches to (eager and compiled)."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

from inference.runners.attention import KERNEL_NAME, NAME, attend, decoding_attention, kernel_op

# the kernel's dtype, and how far from the exact attention its output may lie (relative to the largest output):
# bf16 probabilities and output, a few bf16 steps; float32 throughout
TOLERANCE = {torch.bfloat16: 0.02, torch.float32: 1e-5}


@pytest.fixture(scope="module", autouse=True, params=[torch.bfloat16, torch.float32], ids=["avx512_bf16", "avx2"])
def dtype(request):
    if kernel_op(request.param) is None:
        pytest.skip(f"no prefix-attention kernel for {request.param} on this CPU (AVX512-BF16 for bf16, AVX2 for "
                    "float32) or no C++ compiler")
    return request.param


def neg(dtype):
    return torch.finfo(dtype).min


def case(dtype, batch=1, heads=9, kv_heads=3, n=4, used=37, slots=64, dim=64, seed=0):
    """query (B, heads, n, D) as transformers passes it (a transposed view), key/value buffers of `slots`, and an
    additive mask: the prefix visible, a random tree pattern (each query sees itself) over the last n used slots."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, n, heads, dim, generator=g).to(dtype).transpose(1, 2)
    key = torch.randn(batch, kv_heads, slots, dim, generator=g).to(dtype)
    value = torch.randn(batch, kv_heads, slots, dim, generator=g).to(dtype)
    mask = torch.full((batch, 1, n, slots), neg(dtype), dtype=dtype)
    past = used - n
    mask[..., :past] = 0
    tree = (torch.rand(batch, n, n, generator=g) < 0.5).tril() | torch.eye(n, dtype=torch.bool)
    mask[:, 0, :, past:used] = torch.where(tree, 0.0, neg(dtype)).to(dtype)
    return query, key, value, mask


def kernel_attention(query, key, value, mask, used, rows=None, scaling=0.125):
    rows = query.shape[0] if rows is None else rows
    return kernel_op(query.dtype)(query, key, value, mask, scaling, torch.tensor(used), torch.tensor(rows))


def close_to_exact(ours, query, key, value, mask):
    exact = attend(query.double(), key.double(), value.double(), mask.double(), 0.125)
    return (ours.double() - exact).abs().max() <= TOLERANCE[query.dtype] * exact.abs().max()


@pytest.mark.parametrize("n,used,dim,heads,kv_heads", [(1, 1, 64, 9, 3), (1, 300, 64, 9, 3), (4, 37, 64, 9, 3),
                                                       (8, 200, 128, 4, 1), (16, 513, 32, 8, 8),
                                                       (7, 64, 64, 6, 2), (2, 77, 32, 4, 4)])
def test_kernel_matches_exact_attention(dtype, n, used, dim, heads, kv_heads):
    query, key, value, mask = case(dtype, heads=heads, kv_heads=kv_heads, n=n, used=used, slots=max(64, used + 3),
                                   dim=dim)
    ours = kernel_attention(query, key, value, mask, used)
    assert ours.shape == (1, n, heads, dim) and ours.dtype == dtype
    assert close_to_exact(ours, query, key, value, mask)


def test_slots_after_the_used_length_are_never_read(dtype):
    query, key, value, mask = case(dtype, n=3, used=40, slots=64)
    reference = kernel_attention(query, key, value, mask, 40)
    key[:, :, 40:], value[:, :, 40:] = float("nan"), float("nan")
    assert torch.equal(kernel_attention(query, key, value, mask, 40), reference)


def test_a_querys_output_does_not_depend_on_the_others(dtype):
    """Also across the bf16 kernel's two layouts: few lanes (1-2 queries here) score 16 keys a vector, more score
    16 lanes a vector; a lane's arithmetic is the same (and the float32 kernel's lanes are one vector's lanes)."""
    query, key, value, mask = case(dtype, n=16, used=300, slots=320)
    together = kernel_attention(query, key, value, mask, 300)
    for i in (0, 5, 14):
        alone = kernel_attention(query[:, :, i:i + 1], key, value, mask[:, :, i:i + 1], 300)
        assert torch.equal(alone[:, 0], together[:, i])
        two = kernel_attention(query[:, :, i:i + 2], key, value, mask[:, :, i:i + 2], 300)
        assert torch.equal(two, together[:, i:i + 2])


def test_long_contexts_across_blocks_and_spans(dtype):
    """Keys walked in blocks with a running max and split in spans combined after: a context past several blocks
    and spans, an odd length, one row (spans shared by the threads) and several."""
    for batch, n, used in ((1, 1, 9001), (2, 4, 5001), (1, 16, 4099)):
        query, key, value, mask = case(dtype, batch=batch, n=n, used=used, slots=used + 7, seed=used)
        assert close_to_exact(kernel_attention(query, key, value, mask, used), query, key, value, mask)


def test_a_token_alone_and_inside_a_tree_get_the_same_bits(dtype):
    """A token decoded alone (its own slot the last one used) and the same token verified with tree nodes after
    it (slots it cannot see) attend identically: the blocks and spans are fixed slot ranges and hidden slots add
    exact zeros. Across a span boundary too (the tree's slots start a new span)."""
    for past in (300, 4095):
        query, key, value, mask = case(dtype, n=5, used=past + 5, slots=past + 16, seed=past)
        mask[:, :, 0, past + 1:] = neg(dtype)  # query 0 sits at slot `past` and sees only the prefix and itself
        mask[:, :, 0, :past + 1] = 0
        tree = kernel_attention(query, key, value, mask, past + 5)
        alone = kernel_attention(query[:, :, :1], key, value, mask[:, :, :1], past + 1)
        assert torch.equal(alone[:, 0], tree[:, 0])


def test_masked_prefix_slots_batches_and_rows_in_use(dtype):
    """Per-row masks with hidden prefix slots (left padding), a float mask, and rows past `rows` left zero."""
    query, key, value, mask = case(dtype, batch=3, n=2, used=50, slots=64)
    mask[0, :, :, :7] = neg(dtype)  # row 0 is left-padded by 7 slots
    ours = kernel_attention(query, key, value, mask, 50)
    assert close_to_exact(ours, query, key, value, mask)
    assert torch.equal(kernel_attention(query, key, value, mask.float(), 50), ours)
    alive = kernel_attention(query, key, value, mask, 50, rows=2)
    assert torch.equal(alive[:2], ours[:2]) and not alive[2].any()


def test_static_runner_dispatches_to_the_kernel_eager_and_compiled(dtype):
    from torch.profiler import ProfilerActivity, profile

    from drafthead.masks import causal_allowed
    from inference.runners.static import StaticRunner

    assert decoding_attention(torch.device("cpu"), dtype) == KERNEL_NAME
    assert decoding_attention(torch.device("cpu"), torch.float16) != KERNEL_NAME
    target = tiny_model("llama", dtype=dtype, head_dim=32, num_layers=2)  # compiled: each layer adds graph to build
    ids = torch.randint(3, 320, (1, 20), generator=torch.Generator().manual_seed(0))
    def verify_last_four(runner):
        with runner.session(), torch.inference_mode():
            runner.reset(1, 20)
            runner.prefill(ids[:, :16])
            return runner.verify(ids[:, 16:], torch.arange(4)[None], causal_allowed(4, 0, ids.device)[None])[0]

    reference_runner = StaticRunner(target, [0, 1])
    reference_runner.attention = NAME  # the matmul kernel: PyTorch's matmuls and softmax
    reference = verify_last_four(reference_runner)
    reference_runner.close()
    for compile in (False, True):
        # one 8-token bucket: no GEMM templates to tune (their compile is the lossless compiled tests' subject)
        runner = StaticRunner(target, [0, 1], compile=compile, buckets=(8,))
        assert runner.attention == KERNEL_NAME
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            logits = verify_last_four(runner)
        assert any("prefix_attention" in event.key for event in prof.key_averages())
        assert (logits - reference).abs().max() <= 2.5 * TOLERANCE[dtype] * reference.abs().max()
        runner.close()
