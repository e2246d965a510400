"""Soft cross-entropy over a linear output layer, formed chunk by chunk together with its gradients.

    loss = sum_n w_n * H(p_n, softmax(h_n W^T + b)),   H(p, q) = -sum_v p_v log q_v

The plain autograd version keeps, per unroll step, the float32 logits' log-softmax and the gathered teacher rows
for its backward pass: (N, V) float32 tensors (V = 32k for the default head, N = the trained positions of a
micro-batch) that live from the forward to the backward of every step. Here each chunk of rows forms its loss
and its logits' gradient w_n (sum(p_n) softmax(z_n) - p_n) while the chunk's logits are live, and turns the
latter at once into the gradients of h and W (the same two matrix products autograd does): nothing of size
(N, V) outlives its chunk, and the backward pass only scales the stored gradients. The elementwise part of a
chunk (`chunk_loss`) is compiled once (inductor fuses it into a few loops: C++ on a CPU, Triton on a GPU; about
half autograd's time an unroll step: docs/results/HISTORY.md). Same arithmetic as
autograd's: logits and the gradient products in the input's dtype, or autocast's under autocast (the chunks'
weight gradients summed in the weight's dtype, as autograd sums the unroll steps'), softmax and loss in float32.
"""

from __future__ import annotations

import functools
import sys

import torch

CHUNK_ROWS = 1024  # rows of logits alive at once: 1024 x 32k float32 = 128 MiB per temporary


def chunk_loss(logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
               with_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One chunk: logits (c, V), teacher probs[rows] (c, V), weight (c,) -> (sum_n w_n H(p_n, q_n), d/d logits in
    the logits' dtype (None without with_grad), argmax of each row (c,))."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    z = logits.to(acc)
    log_q = z - torch.logsumexp(z, -1, keepdim=True)
    p = probs[rows].to(acc)
    w = weight.to(acc)
    loss = -((p * log_q).sum(-1) * w).sum()
    top = logits.max(-1).indices
    if not with_grad:
        return loss, None, top
    grad = (log_q.exp() * p.sum(-1, keepdim=True) - p) * w[:, None]
    return loss, grad.to(logits.dtype), top


_compile_failed = False  # set once compiling failed in this process


@functools.cache
def _compiled_chunk_loss():
    return torch.compile(chunk_loss, dynamic=True)  # compiles at its first call; once per process


def _run_chunk(compiled: bool, *args):
    """chunk_loss(*args), through torch.compile when asked; if compiling fails here (no C++ compiler, no Triton),
    said once and eager from then on (the eager function computes the same)."""
    global _compile_failed
    if not compiled or _compile_failed:
        return chunk_loss(*args)
    try:
        return _compiled_chunk_loss()(*args)
    except Exception as error:  # noqa: BLE001
        _compile_failed = True
        print(f"train.soft_ce: compiling the loss failed ({type(error).__name__}: {str(error)[:200]}); "
              "running it eagerly", file=sys.stderr)
        return chunk_loss(*args)


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, probs, rows, row_weight, chunk, compiled):
        needs_h, needs_w, needs_b = ctx.needs_input_grad[:3]
        with_grad = needs_h or needs_w or needs_b
        # under autocast (fp32 master weights with mixed_precision=bf16) the products run in autocast's dtype, as
        # nn.Linear's would, reusing its cached cast of the weight; the sums stay in the parameters' dtypes
        n = hidden.shape[0]
        loss = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        preds = torch.empty(n, dtype=torch.long, device=hidden.device)
        grad_h = torch.empty_like(hidden) if needs_h else None
        grad_w = grad_b = None
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            h = hidden[start:end]  # (c, H)
            logits = torch.nn.functional.linear(h, weight, bias)  # (c, V) in the input's (or autocast's) dtype
            part, grad, preds[start:end] = _run_chunk(compiled, logits, probs, rows[start:end],
                                                      row_weight[start:end], with_grad)
            loss += part
            if needs_b:
                grad_b = grad.sum(0).to(bias.dtype) if grad_b is None else grad_b.add_(grad.sum(0))
            if needs_h:
                grad_h[start:end] = grad @ weight
            if needs_w:
                if grad_w is None:
                    grad_w = (grad.t() @ h).to(weight.dtype)
                elif grad_w.dtype == grad.dtype == h.dtype:
                    grad_w.addmm_(grad.t(), h)  # product and sum in one call
                else:  # autocast: a lower-precision product into the parameter-dtype sum
                    grad_w.add_(grad.t() @ h)
        if n == 0:  # no rows: zero gradients, so that backward still reaches every parameter
            grad_w = torch.zeros_like(weight) if needs_w else None
            grad_b = torch.zeros_like(bias) if needs_b else None
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.mark_non_differentiable(preds)
        return loss, preds

    @staticmethod
    def backward(ctx, grad_loss, _grad_preds):
        grads = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]  # (h, W, b)
        return *grads, None, None, None, None, None


def soft_cross_entropy(hidden: torch.Tensor, linear: torch.nn.Linear, probs: torch.Tensor, rows: torch.Tensor,
                       row_weight: torch.Tensor, chunk: int = CHUNK_ROWS,
                       compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_n row_weight[n] * H(probs[rows[n]], softmax(linear(hidden[n]))) and argmax_v of each row's logits.

    hidden (N, H) in the layer's dtype (any dtypes under autocast, which sets the products'); probs (M, V) rows
    that sum to 1 or less; rows (N,) long; row_weight (N,).
    Returns (loss () float32 (float64 for float64 inputs), preds (N,) long). Differentiable in hidden and in the
    layer's weight and bias (those that require grad). compiled=True runs each chunk's elementwise part through
    torch.compile (same results to float32 rounding, about twice as fast)."""
    return _SoftCrossEntropy.apply(hidden, linear.weight, linear.bias, probs, rows, row_weight, chunk, compiled)
