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
from train.soft_ce import soft_cross_entropy

EAGLE1_CE_WEIGHT = 0.1


def _spread(where: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values (N,) placed at the N true entries of `where` (bool); -1 elsewhere."""
    return torch.full_like(where, -1, dtype=values.dtype).masked_scatter(where, values)


class DraftTrainModule(nn.Module):
    """Head + frozen target output layers; forward(batch) -> dict(loss, preds, targets, valid)."""

    def __init__(self, head: DraftHead, target: nn.Module, ttt_steps: int = 7, ttt_decay: float = 0.8,
                 feature_noise: float = 0.0, compile_loss: bool = False):
        super().__init__()
        self.head = head
        self.config = head.config  # accelerate reads config.hidden_size for DeepSpeed "auto" bucket sizes
        self.steps = ttt_steps if head.eagle3 else 1
        self.decay = ttt_decay
        self.feature_noise = feature_noise
        self.compile_loss = compile_loss
        if head.eagle3:
            ref = head.fc.weight
            self.target_norm = copy.deepcopy(target.get_decoder().norm).to(ref.device, ref.dtype)
            self.target_lm_head = copy.deepcopy(target.get_output_embeddings()).to(ref.device, ref.dtype)
            self.target_norm.requires_grad_(False)
            self.target_lm_head.requires_grad_(False)

    @torch.no_grad()
    def target_distribution(self, last_hidden: torch.Tensor):
        """Target at some positions: last_hidden (..., H) -> (probs over the draft vocab (..., Vd) fp32, greedy
        token (...), greedy token inside the draft vocab (...) bool)."""
        head = self.head
        if not head.eagle3:
            logits = head.logits(last_hidden).float()  # (..., V): the head carries the target's norm + lm_head
            greedy = logits.max(-1).indices
            return logits.softmax(-1), greedy, torch.ones_like(greedy, dtype=torch.bool)
        logits = self.target_lm_head(self.target_norm(last_hidden))  # (..., V)
        greedy = logits.max(-1).indices  # = argmax (first of equal maxima), ~3x faster over a vocabulary on CPU
        draft_ids = torch.arange(head.d2t.numel(), device=head.d2t.device) + head.d2t  # (Vd,) target ids
        probs = logits.index_select(-1, draft_ids).float().softmax(-1)  # (..., Vd)
        return probs, greedy, head.t2d[greedy]

    def forward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden: torch.Tensor,
                last_hidden: torch.Tensor) -> dict:
        """Loss, and per unroll step the head's and the target's tokens (B, T-i-2) and the valid mask.

        Logits (the head's and the target's, vocabulary-wide: most of a step's work) are computed only where a
        loss is taken: positions t with loss_mask[t+i+2] (prompt and padding positions are skipped, ~30-45 % of
        a batch of chat data); the tokens elsewhere read -1."""
        head = self.head
        dtype = head.fc.weight.dtype
        seq_len = input_ids.shape[1]
        last_hidden = last_hidden.to(dtype)  # (B, T, H)
        loss_mask = loss_mask.bool()
        # the target's distribution at the positions p whose next token is trained on (loss_mask[p+1]), compacted
        # to rows; row_of[b, p] is p's row (step i reads p = t+i+1 for its output t)
        needed = loss_mask[:, 1:]  # (B, T-1)
        probs, greedy_rows, in_draft_rows = self.target_distribution(last_hidden[:, :-1][needed])  # (M, Vd), (M,)
        row_of = (needed.flatten().cumsum(0) - 1).view_as(needed)
        greedy = _spread(needed, greedy_rows)  # (B, T-1)
        features = aux_hidden.to(dtype) if head.eagle3 else last_hidden  # (B, T, k·H) or (B, T, H)
        if self.training and self.feature_noise > 0:
            features = features + (torch.rand_like(features) * 2 - 1) * self.feature_noise
        outputs = ttt_unroll(head, input_ids, features, self.steps)  # steps x (B, T-1, H)
        norm, lm_head = head.output_layers()

        loss = input_ids.new_zeros((), dtype=torch.float32)
        preds, targets, valids = [], [], []
        for i, out in enumerate(outputs):
            n = seq_len - i - 2  # output indices t with t+i+2 < T
            if n <= 0:
                break
            valid = loss_mask[:, i + 2 : i + 2 + n]  # (B, n) predicts x_{t+i+2}
            out = out[:, :n][valid]  # (N, H): the valid outputs only
            rows = row_of[:, i + 1 : i + 1 + n][valid]  # (N,) their rows of the target's distribution
            in_draft = in_draft_rows[rows]  # (N,) bool; all true for EAGLE-1
            # sum over the rows of soft CE against the target (rows outside the draft vocabulary weigh 0), and the
            # head's argmax; the (N, Vd) logits never outlive a chunk of rows (train/soft_ce.py)
            ce_sum, top = soft_cross_entropy(norm(out), lm_head, probs, rows, in_draft, compiled=self.compile_loss)
            if head.eagle3:
                loss = loss + self.decay**i * ce_sum / in_draft.sum().clamp(min=1)
            else:
                regress = F.smooth_l1_loss(out.float(), last_hidden[:, 1 : 1 + n][valid].float(), reduction="none")
                count = max(rows.numel(), 1)
                loss = loss + regress.mean(-1).sum() / count + EAGLE1_CE_WEIGHT * ce_sum / count
            preds.append(_spread(valid, head.draft_to_target(top)))
            targets.append(greedy[:, i + 1 : i + 1 + n])
            valids.append(valid)
        return {"loss": loss, "preds": preds, "targets": targets, "valid": valids}
