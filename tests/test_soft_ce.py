"""The chunked soft cross-entropy (train/soft_ce.py) equals autograd's over the whole matrix: loss, argmax and the
gradients of the input, weight and bias, for any chunking."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from train.soft_ce import soft_cross_entropy

CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA device (the compiled chunk runs on Triton)")


def problem(dtype, bias: bool, n=37, hidden=24, vocab=101, teacher_rows=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(hidden, vocab, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(vocab, hidden, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(vocab, generator=gen))
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    probs = torch.randn(teacher_rows, vocab, generator=gen, dtype=torch.float64).mul(3).softmax(-1).float()
    rows = torch.randint(0, teacher_rows, (n,), generator=gen)
    weight = (torch.rand(n, generator=gen) > 0.3).float() * torch.rand(n, generator=gen)  # some rows weigh 0
    return layer, x, probs, rows, weight


def reference(layer, x, probs, rows, weight):
    logits = layer(x)
    acc = torch.promote_types(logits.dtype, torch.float32)
    ce = -(probs[rows].to(acc) * logits.to(acc).log_softmax(-1)).sum(-1)
    return (ce * weight).sum(), logits.max(-1).indices


def grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t.requires_grad])


@pytest.mark.parametrize("chunk,bias,compiled", [(1, False, False), (5, True, False), (37, False, False),
                                                 (1000, True, False), (5, True, True)])
def test_equals_autograd_in_float64(chunk, bias, compiled):
    layer, x, probs, rows, weight = problem(torch.float64, bias)
    x.requires_grad_()
    params = [x, layer.weight] + ([layer.bias] if bias else [])
    want, want_top = reference(layer, x, probs, rows, weight.double())
    got, top = soft_cross_entropy(x, layer, probs, rows, weight, chunk=chunk, compiled=compiled)
    assert torch.equal(top, want_top) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    scale = 0.37  # a later factor (decay / count) reaches the stored gradients through backward
    for g, w in zip(grads(got * scale, params), grads(want * scale, params)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_within_rounding_and_frozen_weight_gets_no_gradient(compiled):
    layer, x, probs, rows, weight = problem(torch.bfloat16, False, n=300, hidden=64, vocab=500)
    layer.weight.requires_grad_(False)
    x.requires_grad_()
    got, top = soft_cross_entropy(x, layer, probs, rows, weight, chunk=128, compiled=compiled)
    want, want_top = reference(layer, x, probs, rows, weight)
    assert torch.equal(top, want_top)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    (w,) = grads(want, [x])
    got.backward()
    assert x.grad.dtype == torch.bfloat16 and layer.weight.grad is None
    torch.testing.assert_close(x.grad.float(), w.float(), rtol=2e-2, atol=2e-2 * w.float().abs().max().item())


def test_no_gradient_work_without_grad_and_empty_input():
    layer, x, probs, rows, weight = problem(torch.float32, True)
    with torch.no_grad():
        got, top = soft_cross_entropy(x, layer, probs, rows, weight)
        want, want_top = reference(layer, x, probs, rows, weight)
    torch.testing.assert_close(got, want)
    assert torch.equal(top, want_top)
    empty, none = soft_cross_entropy(x[:0].requires_grad_(), layer, probs, rows[:0], weight[:0])
    assert empty.item() == 0 and none.numel() == 0
    empty.backward()  # a batch without trained positions still backpropagates (zero gradients)
    assert torch.count_nonzero(layer.weight.grad) == 0


def test_matches_plain_linear_layer_call():
    """The logits are what nn.Linear computes (F.linear with the layer's own weight and bias)."""
    layer, x, probs, rows, weight = problem(torch.float32, True)
    _, top = soft_cross_entropy(x, layer, probs, rows, weight)
    assert torch.equal(top, F.linear(x, layer.weight, layer.bias).max(-1).indices)


@CUDA
def test_compiled_on_cuda_equals_autograd():
    layer, x, probs, rows, weight = problem(torch.float32, True, n=300, hidden=64, vocab=5000)
    layer, x, probs, rows, weight = (t.cuda() for t in (layer, x, probs, rows, weight))
    x.requires_grad_()
    params = [x, layer.weight, layer.bias]
    got, top = soft_cross_entropy(x, layer, probs, rows, weight, chunk=128, compiled=True)
    want, want_top = reference(layer, x, probs, rows, weight)
    assert torch.equal(top, want_top)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for g, w in zip(grads(got, params), grads(want, params)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device,compiled", [("cpu", False), ("cpu", True), pytest.param("cuda", True, marks=CUDA)])
def test_autocast_with_float32_master_weights(device, compiled):
    """mixed_precision=bf16 without DeepSpeed: fp32 parameters under autocast, several chunks. The products run in
    bf16 as nn.Linear's would; the gradients come back in the parameters' dtype."""
    layer, x, probs, rows, weight = problem(torch.float32, True, n=300, hidden=64, vocab=500)
    layer, x, probs, rows, weight = (t.to(device) for t in (layer, x, probs, rows, weight))
    x.requires_grad_()
    params = [x, layer.weight, layer.bias]
    with torch.autocast(device, dtype=torch.bfloat16):
        got, top = soft_cross_entropy(x, layer, probs, rows, weight, chunk=64, compiled=compiled)
        want, want_top = reference(layer, x, probs, rows, weight)
    assert torch.equal(top, want_top) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    got_grads, want_grads = grads(got, params), grads(want, params)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * w.abs().max().item())
