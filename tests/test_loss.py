"""Training objective: the loss computed on the trained positions only equals the loss over every position."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_head, tiny_model

from drafthead.capture import HiddenStateCapture
from drafthead.ttt import ttt_unroll
from train.loss import EAGLE1_CE_WEIGHT, DraftTrainModule


def features(target, head, input_ids):
    """(aux_hidden, last_hidden) of a real target forward: the aux layers and the last layer before the norm."""
    last = target.config.num_hidden_layers - 1
    ids = sorted(set(head.config.aux_layer_ids) | {last})
    with torch.no_grad(), HiddenStateCapture(target, ids) as cap:
        target(input_ids)
    return cap.stacked(head.config.aux_layer_ids), cap.stacked([last])


def reference_loss(module: DraftTrainModule, input_ids, loss_mask, aux_hidden, last_hidden):
    """The objective written out over every position (logits everywhere, masked means): what the module's
    compacted computation must equal. Returns (loss, per step the head's tokens (B, n))."""
    head = module.head
    with torch.no_grad():
        if head.eagle3:
            logits = module.target_lm_head(module.target_norm(last_hidden))
            draft_ids = torch.arange(head.d2t.numel()) + head.d2t
            probs = logits.index_select(-1, draft_ids).float().softmax(-1)
            in_draft = head.t2d[logits.argmax(-1)]
        else:
            probs = head.logits(last_hidden).float().softmax(-1)
    outputs = ttt_unroll(head, input_ids, aux_hidden if head.eagle3 else last_hidden, module.steps)
    loss, preds = torch.zeros(()), []
    for i, out in enumerate(outputs):
        n = input_ids.shape[1] - i - 2
        out, valid = out[:, :n], loss_mask[:, i + 2 : i + 2 + n].float()
        logits = head.logits(out)
        ce = -(probs[:, i + 1 : i + 1 + n] * logits.float().log_softmax(-1)).sum(-1)
        if head.eagle3:
            weight = valid * in_draft[:, i + 1 : i + 1 + n]
            loss = loss + module.decay**i * (ce * weight).sum() / weight.sum().clamp(min=1)
        else:
            regress = F.smooth_l1_loss(out, last_hidden[:, 1 : 1 + n], reduction="none").mean(-1)
            loss = loss + ((regress + EAGLE1_CE_WEIGHT * ce) * valid).sum() / valid.sum().clamp(min=1)
        preds.append(head.draft_to_target(logits.argmax(-1)))
    return loss, preds


@pytest.mark.parametrize("arch,kind,compile_loss", [("llama", "eagle3", False), ("llama", "eagle1", False),
                                                     ("qwen2", "eagle3", False), ("qwen2", "eagle1", False),
                                                     ("llama", "eagle3", True), ("qwen2", "eagle1", True)])
def test_loss_on_trained_positions_equals_loss_over_all_positions(arch, kind, compile_loss):
    target = tiny_model(arch)
    head = tiny_head(target, kind).train()
    module = DraftTrainModule(head, target, ttt_steps=4, compile_loss=compile_loss)
    input_ids = torch.randint(3, target.config.vocab_size, (3, 14), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.zeros(3, 14, dtype=torch.bool)
    loss_mask[0, 5:] = True  # a prompt, then the answer to the end
    loss_mask[1, 3:9] = True  # an answer, then right padding
    loss_mask[2, 2:4] = loss_mask[2, 8:12] = True  # two short answers
    aux_hidden, last_hidden = features(target, head, input_ids)

    out = module(input_ids, loss_mask, aux_hidden, last_hidden)
    grads = torch.autograd.grad(out["loss"], [p for p in head.parameters() if p.requires_grad])
    expected, expected_preds = reference_loss(module, input_ids, loss_mask, aux_hidden, last_hidden)
    expected_grads = torch.autograd.grad(expected, [p for p in head.parameters() if p.requires_grad])

    torch.testing.assert_close(out["loss"], expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    assert len(out["preds"]) == module.steps == (4 if kind == "eagle3" else 1)
    for i, (pred, valid) in enumerate(zip(out["preds"], out["valid"])):
        torch.testing.assert_close(valid, loss_mask[:, i + 2 : i + 2 + pred.shape[1]])
        assert torch.equal(pred[valid], expected_preds[i][valid])  # the head's tokens where a loss is taken
        assert (pred[~valid] == -1).all()  # elsewhere none were computed


def test_loss_of_a_batch_without_trained_positions_is_zero_with_a_graph():
    """A micro-batch whose answers fall outside every unroll step (all prompt) still gives a loss that backward
    accepts (ranks keep their collectives paired), and contributes nothing."""
    target = tiny_model("llama")
    head = tiny_head(target, "eagle3").train()
    module = DraftTrainModule(head, target, ttt_steps=3)
    input_ids = torch.randint(3, target.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.zeros(2, 8, dtype=torch.bool)
    out = module(input_ids, loss_mask, *features(target, head, input_ids))
    assert out["loss"].item() == 0.0 and out["loss"].requires_grad
    out["loss"].backward()
    assert all(p.grad is None or not p.grad.any() for p in head.parameters())


def test_autocast_with_float32_master_weights_over_several_chunks():
    """mixed_precision=bf16 without DeepSpeed (`python -m train` on one process): fp32 head under autocast, more
    trained rows than one chunk of the chunked loss holds. Same loss and gradients as autograd's under autocast."""
    from train.soft_ce import CHUNK_ROWS

    target = tiny_model("llama")
    head = tiny_head(target, "eagle3").train()
    module = DraftTrainModule(head, target, ttt_steps=2)
    input_ids = torch.randint(3, target.config.vocab_size, (3, 480), generator=torch.Generator().manual_seed(2))
    loss_mask = torch.ones(3, 480, dtype=torch.bool)
    loss_mask[:, :10] = False
    assert loss_mask[:, 2:].sum() > CHUNK_ROWS  # the first unroll step spans two chunks
    aux_hidden, last_hidden = features(target, head, input_ids)
    params = [p for p in head.parameters() if p.requires_grad]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(input_ids, loss_mask, aux_hidden, last_hidden)
        expected, _ = reference_loss(module, input_ids, loss_mask, aux_hidden, last_hidden)
    grads = torch.autograd.grad(out["loss"], params)
    expected_grads = torch.autograd.grad(expected, params)
    torch.testing.assert_close(out["loss"], expected, rtol=2e-3, atol=0)
    for g, e in zip(grads, expected_grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, e, rtol=5e-2, atol=5e-2 * e.abs().max().item())
