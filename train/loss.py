"""Training objectives: EAGLE-3 training-time test (soft CE over the draft vocabulary) and EAGLE-1/2.

`DraftTrainModule` is what the engine (DeepSpeed or DDP) wraps: the head plus frozen copies of the target's
final norm and lm_head (EAGLE-3; an EAGLE-1 head carries its own). Its forward takes a feature batch and
returns the loss and, per unroll step i, the head's token, the target's greedy token and the valid mask, all
(B, T-i-2) and indexed by t, for the prediction of token t+i+2.

EAGLE-3, step i, output index t (predicts x_{t+i+2}):
    target = softmax over the draft vocabulary of target_lm_head(target_norm(last_hidden[t+i+1]))
    loss_i = soft cross-entropy, mean over valid t;  loss = sum_i ttt_decay**i * loss_i
    valid  = t+i+2 < T and loss_mask[t+i+2] and the target's argmax lies inside the draft vocabulary
             (the head cannot produce a token outside it, so such positions only add noise to the loss; they
             still count as misses in the accuracy statistics).
EAGLE-1/2 (one step): smooth-L1(head output at t, last_hidden[t+1]) + 0.1 * CE(head logits, target distribution
    at t+1), optional uniform noise of +-feature_noise on the input features while training.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from drafthead import DraftHead
from drafthead.ttt import ttt_unroll

EAGLE1_CE_WEIGHT = 0.1


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


class DraftTrainModule(nn.Module):
    """Head + frozen target output layers; forward(batch) -> dict(loss, preds, targets, valid)."""

    def __init__(self, head: DraftHead, target: nn.Module, ttt_steps: int = 7, ttt_decay: float = 0.8,
                 feature_noise: float = 0.0):
        super().__init__()
        self.head = head
        self.config = head.config  # accelerate reads config.hidden_size for DeepSpeed "auto" bucket sizes
        self.steps = ttt_steps if head.eagle3 else 1
        self.decay = ttt_decay
        self.feature_noise = feature_noise
        if head.eagle3:
            ref = head.fc.weight
            self.target_norm = copy.deepcopy(target.get_decoder().norm).to(ref.device, ref.dtype)
            self.target_lm_head = copy.deepcopy(target.get_output_embeddings()).to(ref.device, ref.dtype)
            self.target_norm.requires_grad_(False)
            self.target_lm_head.requires_grad_(False)

    @torch.no_grad()
    def target_distribution(self, last_hidden: torch.Tensor):
        """Target at every position -> (probs over the draft vocab (B, T, Vd) fp32, greedy token (B, T),
        greedy token inside the draft vocab (B, T) bool)."""
        head = self.head
        if not head.eagle3:
            logits = head.logits(last_hidden).float()  # (B, T, V): the head carries the target's norm + lm_head
            greedy = logits.argmax(-1)
            return logits.softmax(-1), greedy, torch.ones_like(greedy, dtype=torch.bool)
        logits = self.target_lm_head(self.target_norm(last_hidden))  # (B, T, V)
        greedy = logits.argmax(-1)
        draft_ids = torch.arange(head.d2t.numel(), device=head.d2t.device) + head.d2t  # (Vd,) target ids
        probs = logits.index_select(-1, draft_ids).float().softmax(-1)  # (B, T, Vd)
        return probs, greedy, head.t2d[greedy]

    def forward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden: torch.Tensor,
                last_hidden: torch.Tensor) -> dict:
        head = self.head
        dtype = head.fc.weight.dtype
        seq_len = input_ids.shape[1]
        last_hidden = last_hidden.to(dtype)  # (B, T, H)
        probs, greedy, in_draft = self.target_distribution(last_hidden)
        features = aux_hidden.to(dtype) if head.eagle3 else last_hidden  # (B, T, k·H) or (B, T, H)
        if self.training and self.feature_noise > 0:
            features = features + (torch.rand_like(features) * 2 - 1) * self.feature_noise
        outputs = ttt_unroll(head, input_ids, features, self.steps)  # steps x (B, T-1, H)

        loss = input_ids.new_zeros((), dtype=torch.float32)
        preds, targets, valids = [], [], []
        for i, out in enumerate(outputs):
            n = seq_len - i - 2  # output indices t with t+i+2 < T
            if n <= 0:
                break
            out = out[:, :n]  # (B, n, H)
            valid = loss_mask[:, i + 2 : i + 2 + n]  # (B, n) predicts x_{t+i+2}
            logits = head.logits(out)  # (B, n, Vd)
            logp = logits.float().log_softmax(-1)
            ce = -(probs[:, i + 1 : i + 1 + n] * logp).sum(-1)  # (B, n)
            if head.eagle3:
                loss = loss + self.decay**i * _masked_mean(ce, valid & in_draft[:, i + 1 : i + 1 + n])
            else:
                regress = F.smooth_l1_loss(out.float(), last_hidden[:, 1 : 1 + n].float(), reduction="none")
                loss = loss + _masked_mean(regress.mean(-1), valid) + EAGLE1_CE_WEIGHT * _masked_mean(ce, valid)
            preds.append(head.draft_to_target(logits.argmax(-1)))
            targets.append(greedy[:, i + 1 : i + 1 + n])
            valids.append(valid)
        return {"loss": loss, "preds": preds, "targets": targets, "valid": valids}
