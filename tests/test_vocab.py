"""Draft vocabulary: frequencies over assistant tokens only, deterministic top-N with tie-breaking, d2t/t2d."""

from __future__ import annotations

import pytest
import torch

from drafthead.vocab import build_draft_vocab, full_vocab, token_frequencies


def test_token_frequencies_honours_loss_mask():
    ids = torch.tensor([5, 5, 7, 9, 9, 9])
    mask = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)
    counts = token_frequencies([(ids, mask), (torch.tensor([7, 3]), torch.tensor([True, False]))], vocab_size=12)
    expected = torch.zeros(12, dtype=torch.int64)
    expected[5], expected[7], expected[9] = 1, 2, 2
    assert torch.equal(counts, expected)
    assert counts[3] == 0  # masked out everywhere


def test_build_draft_vocab_picks_top_tokens_and_breaks_ties_by_lower_id():
    counts = torch.tensor([0, 4, 9, 4, 0, 4, 1, 9])
    d2t, t2d = build_draft_vocab(counts, 4)
    chosen = (torch.arange(4) + d2t).tolist()
    assert chosen == [1, 2, 3, 7]  # 9, 9 then the two lowest ids among the three 4s; increasing target ids
    assert t2d.tolist() == [False, True, True, True, False, False, False, True]
    d2t_again, t2d_again = build_draft_vocab(counts.clone(), 4)
    assert torch.equal(d2t, d2t_again) and torch.equal(t2d, t2d_again)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool


@pytest.mark.parametrize("size", [1, 37, 320])
def test_d2t_and_t2d_agree(size):
    counts = torch.randint(0, 50, (320,), generator=torch.Generator().manual_seed(size))
    d2t, t2d = build_draft_vocab(counts, size)
    target_ids = torch.arange(size) + d2t
    assert d2t.shape == (size,) and t2d.shape == (320,)
    assert torch.equal(torch.sort(target_ids).values, target_ids) and target_ids.unique().numel() == size
    assert torch.equal(t2d.nonzero().flatten(), target_ids)
    # every chosen token is at least as frequent as every token left out
    if size < 320:
        assert counts[t2d].min() >= counts[~t2d].max()


def test_full_vocab_is_identity():
    d2t, t2d = full_vocab(10)
    assert torch.equal(d2t, torch.zeros(10, dtype=torch.int64)) and bool(t2d.all())
    assert torch.equal(build_draft_vocab(torch.arange(10), 10)[0], d2t)


@pytest.mark.parametrize("size", [0, 11])
def test_build_draft_vocab_rejects_bad_size(size):
    with pytest.raises(ValueError, match="draft_vocab_size must be in 1..10"):
        build_draft_vocab(torch.ones(10), size)
