"""Greedy losslessness: speculative output == target.generate(do_sample=False), token for token."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tiny import tiny_model

from drafthead import DraftHead, HeadConfig, HeadMismatchError
from drafthead.capture import decoder_layers
from inference import SpeculativeGenerator, TreeOptions

TREES = {
    "chain": TreeOptions(depth=4, top_k=1, total_tokens=4),
    "wide": TreeOptions(depth=2, top_k=8, total_tokens=16),
    "deep": TreeOptions(depth=6, top_k=3, total_tokens=20),
}
MAX_NEW = 24
torch.set_num_threads(1)  # tiny matmuls: OpenMP threads only contend on the shared 2-core machine


def random_head(target, kind: str = "eagle3", seed: int = 1) -> DraftHead:
    torch.manual_seed(seed)
    aux = [1, 3, 6] if kind == "eagle3" else None
    draft_vocab = 200 if kind == "eagle3" else None
    head = DraftHead(HeadConfig.from_target_config(target.config, kind=kind, aux_layer_ids=aux,
                                                   draft_vocab_size=draft_vocab))
    if kind == "eagle3":  # a sparse draft vocabulary: every other target id from 3 on, where the vocabulary
        # holds that many (distinct target ids: two draft ids of one target token would draft duplicate siblings)
        step = 2 if 3 + 2 * 200 <= target.config.vocab_size else 1
        chosen = torch.arange(3, 3 + step * 200, step)
        head.d2t.copy_(chosen - torch.arange(200))
    return head


def near_bigram_target(arch: str = "llama", eps: float = 2e-3, **overrides):
    """A tiny target whose decoder layers barely touch the residual stream: next token ≈ g(current token)."""
    model = tiny_model(arch, **overrides)
    with torch.no_grad():
        for layer in decoder_layers(model):
            layer.self_attn.o_proj.weight.mul_(eps)
            layer.mlp.down_proj.weight.mul_(eps)
    return model


def oracle_head(target) -> DraftHead:
    """An EAGLE-1 head that drafts exactly the bigram part g of a near_bigram_target: h = embed(token)."""
    head = DraftHead(HeadConfig.from_target_config(target.config, kind="eagle1"))
    h = target.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :h] = torch.eye(h)  # fc(concat[embed, hidden]) = embed
        head.fc.bias.zero_()
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
    return head


def prompts(n: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, int(torch.randint(1, 14, (1,), generator=g))), generator=g) for _ in range(n)]


def assert_lossless(target, head, trees, n_prompts=20, max_new=MAX_NEW, every_tree=False, runner="static"):
    """Each prompt against plain greedy decoding, with the tree shapes in turn (or all of them)."""
    gens = {name: SpeculativeGenerator(target, head.attach_target(target) if head is not None else None, tree=opt,
                                       runner=runner) for name, opt in trees.items()}
    names = list(gens)
    for i, ids in enumerate(prompts(n_prompts, target.config.vocab_size)):
        ref = target.generate(ids, do_sample=False, max_new_tokens=max_new)
        for name in names if every_tree else [names[i % len(names)]]:
            out = gens[name].generate(ids, max_new_tokens=max_new)
            assert torch.equal(out.sequences, ref), f"tree {name}: prompt {ids.tolist()}"
    return gens


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_matches_target_eagle3(arch, runner):
    target = tiny_model(arch)
    assert_lossless(target, random_head(target, "eagle3"), TREES, runner=runner)


def test_greedy_matches_target_eagle1(runner):
    target = tiny_model("qwen2", seed=3)
    assert_lossless(target, random_head(target, "eagle1"), {"wide": TREES["wide"], "deep": TREES["deep"]},
                    runner=runner)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_plain_decoding_matches_target(arch, runner):
    """tree='none': the engine's own plain decoding (no head) is token-identical to transformers' generate."""
    target = tiny_model(arch)
    gens = assert_lossless(target, None, {"none": "none"}, n_prompts=8, runner=runner)
    stats = gens["none"].generate(prompts(1, 320)[0], max_new_tokens=10, eos_token_id=[]).stats
    assert stats.target_forwards == 10 and set(stats.accept_lengths) == {1}


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_multi_token_acceptance_is_exercised(arch, runner):
    """A draft that is usually right: long accepted paths (and some rejections) must still be exact."""
    target = near_bigram_target(arch)
    gens = assert_lossless(target, oracle_head(target), TREES, n_prompts=6, max_new=40, every_tree=True,
                           runner=runner)
    ids = prompts(1, target.config.vocab_size, seed=5)[0]
    for name, gen in gens.items():
        stats = gen.generate(ids, max_new_tokens=40).stats
        assert max(stats.histogram) > 1 and stats.mean_accepted > 1.8, (name, stats.histogram)
        if name == "chain":
            assert max(stats.histogram) <= TREES["chain"].depth + 1
    deep = gens["deep"].generate(ids, max_new_tokens=40).stats
    assert deep.target_forwards < 40 / 1.8 + 1


def test_tree_shape():
    """Every row of a batch gets a tree of the option set's size, parents before children, distinct siblings."""
    target = tiny_model("llama")
    head = random_head(target).attach_target(target)
    ids = torch.randint(3, 320, (2, 5))
    roots = (7, 9)
    for opt in TREES.values():
        gen = SpeculativeGenerator(target, head, tree=opt)
        runner, drafter = gen.runner, gen.drafter
        with torch.inference_mode():
            runner.reset(2, 64)
            _, feats = runner.prefill(ids)
            drafter.begin(runner, ids, torch.ones_like(ids), feats)  # 4 pairs; the root makes the fifth
            tree = drafter.propose(torch.tensor(roots))
        n = tree.size
        assert n == 1 + min(opt.total_tokens, opt.top_k + (opt.depth - 1) * opt.top_k**2)
        assert drafter.next_pos.tolist() == [5, 5]  # the drafted nodes are not part of the stable prefix
        for row, root in enumerate(roots):
            par, dep = tree.parents[row], tree.depths[row]
            assert par[0] == -1 and dep[0] == 0 and tree.tokens[row, 0] == root
            assert (par[1:] < torch.arange(1, n)).all() and (par[1:] >= 0).all()
            assert torch.equal(dep[1:], dep[par[1:]] + 1) and int(dep.max()) <= opt.depth
            assert torch.equal(tree.ancestors[row].sum(1), dep + 1)
            for p in range(n):  # siblings carry distinct tokens
                kids = tree.tokens[row, 1:][par[1:] == p]
                assert kids.unique().numel() == kids.numel()
            if opt.top_k == 1:
                assert torch.equal(dep, torch.arange(n))


def test_refuses_head_for_another_target():
    target = tiny_model("llama")
    other = tiny_model("llama", num_layers=6)
    head = DraftHead(HeadConfig.from_target_config(other.config, aux_layer_ids=[1, 2, 3]))
    with pytest.raises(HeadMismatchError):
        SpeculativeGenerator.from_pretrained(target, head)


HARD_CODED = re.compile(r"\.cuda\(|torch\.(float16|float32|bfloat16|half|float64)\b|\.half\(\)|\.bfloat16\(\)")
ALLOWED = re.compile(r"(==|!=|\bis\b|\bin\b)\s*\(?torch\.|[\"']\w+[\"']\s*:\s*torch\.")  # comparisons, name maps


def test_no_hard_coded_device_or_dtype():
    root = Path(__file__).resolve().parent.parent
    bad = []
    for folder in ("inference", "drafthead"):
        for path in sorted((root / folder).rglob("*.py")):
            # the one place that maps hardware to a default dtype, by design
            if path.relative_to(root).as_posix() == "drafthead/hardware.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if HARD_CODED.search(code) and not ALLOWED.search(code):
                    bad.append(f"{path.relative_to(root)}:{i}: {line.strip()}")
    assert not bad, "hard-coded device/dtype:\n" + "\n".join(bad)


def test_explain_divergence():
    from inference.bench.ties import bf16_resolution, explain_divergence, first_divergence

    assert bf16_resolution(1.0) == 2**-7 and bf16_resolution(-20.0) == 2**-3 and bf16_resolution(255.0) == 1.0
    target = tiny_model("llama")
    ids = prompts(1, 320, seed=9)[0]
    ref = target.generate(ids, do_sample=False, max_new_tokens=6)
    assert explain_divergence(target, ref, ref) is None
    pos = ids.shape[1] + 2
    with torch.inference_mode():
        logits = target(ref[:, :pos]).logits[0, -1]
    second = int(torch.topk(logits, 2).indices[1])
    other = ref.clone()
    other[0, pos] = second
    assert first_divergence(other, ref) == pos
    d = explain_divergence(target, other, ref, tolerance_ulps=1e9)
    assert d.position == pos and d.top2 == (int(ref[0, pos]), second) and d.is_near_tie
    assert d.gap == pytest.approx(float(logits[ref[0, pos]] - logits[second]), abs=1e-4)
    assert not explain_divergence(target, other, ref).is_near_tie  # fp32 random logits: a real gap
    # against a float32 reference (here the target itself: zero precision error) the direction matters: choosing
    # the exact model's worse token is a real mismatch, choosing its better one means the plain path strayed
    worse = explain_divergence(target, other, ref, reference=target)
    assert not worse.is_near_tie and worse.precision_error == 0 and worse.exact_gap == pytest.approx(d.gap, abs=1e-4)
    assert explain_divergence(target, ref, other, reference=target).is_near_tie
