"""Draft head: forward shapes, training-time test == incremental drafting, tree masks, sizes, checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import tiny_head, tiny_model

from drafthead import HeadConfig, HeadKVCache, HeadMismatchError, load_head, save_head
from drafthead.capture import HiddenStateCapture
from drafthead.masks import causal_mask, to_additive, ttt_allowed
from drafthead.ttt import ttt_unroll

KINDS = ("eagle3", "eagle1")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return tiny_model(request.param)


def target_features(target, head, input_ids: torch.Tensor) -> torch.Tensor:
    """The features the head reads, captured from a real target forward: (B, T, k·TH) or (B, T, H)."""
    ids = head.config.aux_layer_ids
    with torch.no_grad(), HiddenStateCapture(target, ids) as cap:
        target(input_ids)
    return cap.stacked(ids)


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    """fp32 agreement up to rounding: max |difference| <= tol · max |expected| (hidden states reach ~100 here)."""
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= tol * scale, f"max abs difference {err:.3g} > {tol} x scale {scale:.3g}"


def random_ids(batch: int, length: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
def test_training_forward_shapes(target, kind):
    head = tiny_head(target, kind)
    cfg = head.config
    ids = random_ids(2, 10, cfg.vocab_size)
    feats = target_features(target, head, ids)
    assert feats.shape == (2, 10, cfg.feature_size if kind == "eagle3" else cfg.hidden_size)
    hidden = head.fuse(feats[:, :-1])
    out = head(ids[:, 1:], hidden, torch.arange(9).expand(2, 9))
    assert out.shape == (2, 9, cfg.hidden_size)
    logits = head.logits(out)
    assert logits.shape == (2, 9, cfg.draft_vocab_size if kind == "eagle3" else cfg.vocab_size)
    assert torch.isfinite(logits).all()
    # the training pass is causal: a later token never changes an earlier output
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % cfg.vocab_size
    out2 = head(ids2[:, 1:], hidden, torch.arange(9).expand(2, 9))
    torch.testing.assert_close(out2[:, :-1], out[:, :-1])
    assert not torch.allclose(out2[:, -1], out[:, -1])


@pytest.mark.parametrize("kind", KINDS)
def test_ttt_unroll_shapes(target, kind):
    head = tiny_head(target, kind)
    ids = random_ids(2, 12, head.config.vocab_size)
    outs = ttt_unroll(head, ids, target_features(target, head, ids), steps=3)
    assert len(outs) == 3
    assert all(o.shape == (2, 11, head.config.hidden_size) for o in outs)
    assert not torch.allclose(outs[0], outs[1])


# fp64 proves exact agreement. fp32 agrees up to rounding, which the random EAGLE-1 chain amplifies (hidden
# states ~60, peaked attention): up to ~1e-4 of scale; a wrong mask or position is off by O(scale).
PRECISIONS = [(torch.float32, 1e-3), (torch.float64, 1e-10)]


@pytest.mark.parametrize("dtype, tol", PRECISIONS)
@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_ttt_equals_incremental_drafting(target, kind, dtype, tol):
    """ttt_unroll step i at index t == prefill 0..t then draft the chain step by step at positions t+i."""
    head = tiny_head(target, kind).to(dtype)
    steps, seq_len = 3, 9
    ids = random_ids(1, seq_len, head.config.vocab_size, seed=2)
    feats = target_features(target, head, ids).to(dtype)
    outs = ttt_unroll(head, ids, feats, steps)
    length = seq_len - 1

    cache = HeadKVCache()
    hidden0 = head.fuse(feats[:, :-1])
    step0 = head(ids[:, 1:], hidden0, torch.arange(length)[None], causal_mask(length, 0, dtype), cache)
    assert_close_scaled(step0, outs[0], tol)
    padded = torch.nn.functional.pad(ids, (0, steps), value=0)  # ttt feeds token 0 past the end
    for t in range(length):
        chain = copy.copy(cache)
        chain.crop(t + 1)  # the real prefix 0..t
        prev = step0[:, t : t + 1]
        for i in range(1, steps):
            token = padded[:, t + 1 + i : t + 2 + i]
            mask = causal_mask(1, len(chain), dtype)
            prev = head(token, prev, torch.tensor([[t + i]]), mask, chain)
            assert_close_scaled(prev[:, 0], outs[i][:, t], tol)
        assert len(chain) == t + steps


@pytest.mark.parametrize("kind", KINDS)
def test_ttt_attention_equals_dense_masked_attention_with_gradients(target, kind):
    """The unroll's structured attention (a causal block + one diagonal score per earlier step) gives the outputs
    and parameter gradients of SDPA over all (step+1)·L keys under the dense training-time-test mask."""
    head = tiny_head(target, kind).to(torch.float64).train()
    steps = 4
    ids = random_ids(2, 11, head.config.vocab_size, seed=3)
    feats = target_features(target, head, ids).to(torch.float64)
    params = [p for name, p in head.named_parameters() if p.requires_grad and not name.startswith(("norm", "lm_head"))]
    weights = torch.randn(steps, 2, 10, head.config.hidden_size, generator=torch.Generator().manual_seed(4),
                          dtype=torch.float64)

    outs = ttt_unroll(head, ids, feats, steps)
    grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights)), params)
    assert head.midlayer.self_attn.config._attn_implementation == "sdpa"  # restored after the unroll

    hidden, cache, dense = head.fuse(feats[:, :-1]), HeadKVCache(), []
    for step in range(steps):  # the unroll with a dense mask over every cached block
        tokens = torch.nn.functional.pad(ids[:, 1 + step :], (0, step), value=0)
        mask = to_additive(ttt_allowed(10, step), torch.float64)
        hidden = head(tokens, hidden, torch.arange(10).expand(2, 10) + step, mask, cache)
        dense.append(hidden)
    dense_grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(dense, weights)), params)
    for out, expected in zip(outs, dense):
        assert_close_scaled(out, expected, 1e-10)
    for grad, expected in zip(grads, dense_grads):
        assert_close_scaled(grad, expected, 1e-9)


def tree_allowed(parents: list[int]) -> torch.Tensor:
    """bool (N, N): node j sees node k iff k is j or an ancestor of j (parents[j] = -1 for a root child)."""
    n = len(parents)
    allowed = torch.eye(n, dtype=torch.bool)
    for j in range(n):
        k = parents[j]
        while k >= 0:
            allowed[j, k] = True
            k = parents[k]
    return allowed


@pytest.mark.parametrize("dtype, tol", PRECISIONS)
@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_tree_drafting_with_cache_matches_chains(target, kind, dtype, tol):
    """One tree forward (cache + explicit positions + tree mask) == running each node's chain on its own."""
    head = tiny_head(target, kind).to(dtype)
    cfg = head.config
    prefix = 6
    ids = random_ids(1, prefix + 1, cfg.vocab_size, seed=3)
    feats = target_features(target, head, ids).to(dtype)
    cache = HeadKVCache()
    head(ids[:, 1:], head.fuse(feats[:, :-1]), torch.arange(prefix)[None], causal_mask(prefix, 0, dtype), cache)

    parents = [-1, -1, 0, 2, 1]  # two root children; a depth-3 chain 0 -> 2 -> 3; node 4 under node 1
    depth = [1, 1, 2, 3, 2]
    n = len(parents)
    tokens = random_ids(1, n, cfg.vocab_size, seed=4)
    node_hidden = torch.randn(1, n, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).to(dtype)
    positions = torch.tensor([[prefix - 1 + d for d in depth]])
    allowed = torch.cat([torch.ones(n, prefix, dtype=torch.bool), tree_allowed(parents)], dim=1)
    tree_cache = copy.copy(cache)
    out = head(tokens, node_hidden, positions, to_additive(allowed, dtype), tree_cache)
    assert out.shape == (1, n, cfg.hidden_size)
    assert len(tree_cache) == prefix + n

    for j in range(n):
        chain = [j]
        while parents[chain[0]] >= 0:
            chain.insert(0, parents[chain[0]])
        solo = copy.copy(cache)
        ref = head(tokens[:, chain], node_hidden[:, chain], positions[:, chain],
                   causal_mask(len(chain), prefix, dtype), solo)
        assert_close_scaled(out[:, j], ref[:, -1], tol)


def closed_form_parameters(cfg: HeadConfig) -> int:
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    if cfg.kind == "eagle3":
        return (cfg.num_aux * cfg.target_hidden_size * h + 2 * h * q + 2 * 2 * h * kv + q * h + 3 * h * inter
                + 4 * h + h * cfg.draft_vocab_size)
    return 2 * h * h + h + h * q + 2 * h * kv + q * h + 3 * h * inter + h


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_count_closed_form(target, kind):
    head = tiny_head(target, kind, draft_vocab_size=150)
    assert head.num_trainable_parameters() == closed_form_parameters(head.config)
    frozen = {n for n, p in head.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith(("embed_tokens.", "target_norm.", "target_lm_head.")) for n in frozen)


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_save_load_identical_logits(target, kind, tmp_path):
    head = tiny_head(target, kind)
    save_head(head, tmp_path / "head")
    loaded = load_head(tmp_path / "head", target=target, kind=kind)
    ids = random_ids(1, 8, head.config.vocab_size)
    feats = target_features(target, head, ids)
    pos = torch.arange(8)[None]
    expected = head.logits(head(ids, head.fuse(feats), pos))
    assert torch.equal(loaded.logits(loaded(ids, loaded.fuse(feats), pos)), expected)
    if kind == "eagle3":
        assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    # the saved file holds only the head, never the borrowed target weights
    from safetensors import safe_open

    with safe_open(str(tmp_path / "head" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not any(n.startswith(("embed_tokens", "target_")) for n in names)
    assert sum(p.numel() for n, p in head.saved_state_dict().items() if n not in ("d2t", "t2d")) == (
        head.num_trainable_parameters()
    )


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(vocab_size=400), "vocab_size"),
        (dict(hidden_size=96, num_attention_heads=4), "hidden_size"),
        (dict(num_layers=6), "num_hidden_layers"),
        (dict(num_layers=4), "aux_layer_ids"),
    ],
)
def test_load_mismatched_target_names_field(tmp_path, overrides, field):
    target = tiny_model("llama")
    save_head(tiny_head(target, "eagle3", aux_layer_ids=[1, 3, 6]), tmp_path / "head")
    other = tiny_model("llama", **overrides)
    with pytest.raises(HeadMismatchError, match=field):
        load_head(tmp_path / "head", target=other)


def test_load_wrong_kind_names_kind(tmp_path):
    target = tiny_model("llama")
    save_head(tiny_head(target, "eagle1"), tmp_path / "head")
    with pytest.raises(HeadMismatchError, match="head kind"):
        load_head(tmp_path / "head", target=target, kind="eagle3")
    with pytest.raises(HeadMismatchError, match="head kind"):
        load_head(tmp_path / "head", kind="eagle3")
