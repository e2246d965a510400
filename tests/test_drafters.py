"""Every drafter behind one verifier: prompt lookup, a standalone draft model, and the head + lookup hybrid are
lossless (greedy token for token; sampling by chi-square), and each does what it claims."""

from __future__ import annotations

import copy
import statistics

import pytest
import torch
from test_inference_greedy import near_bigram_target, oracle_head, prompts, random_head
from test_inference_sampling import chi_square_p, first_two_law, sample_first_two, sampling_target
from tiny import tiny_model, tiny_tokenizer

import inference.verify
from inference import SamplingParams, SpeculativeGenerator, TreeOptions
from inference.drafter import Drafter
from inference.drafters.draft_model import DraftModelDrafter, TokenizerMismatchError, check_same_tokenizer
from inference.drafters.lookup import LookupBranch, NgramIndex, prompt_lookup
from inference.sampling import target_probs
from inference.tree import DraftTree, ancestor_matrix
from inference.verify import verify_sampling

torch.set_num_threads(1)
MAX_NEW = 32


def assert_greedy_lossless(target, gen: SpeculativeGenerator, n_prompts: int = 8, max_new: int = MAX_NEW,
                           seed: int = 0) -> list:
    """Each prompt's output == transformers' greedy generate; returns the generation stats."""
    stats = []
    for ids in prompts(n_prompts, target.config.vocab_size, seed=seed):
        ref = target.generate(ids, do_sample=False, max_new_tokens=max_new)
        out = gen.generate(ids, max_new_tokens=max_new)
        assert torch.equal(out.sequences, ref), f"prompt {ids.tolist()}"
        stats.append(out.stats)
    return stats


# ----------------------------------------------------------------------------------------------- prompt lookup
def test_lookup_prefers_longest_then_latest_match():
    ctx = [5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7]
    assert NgramIndex(ctx, 3).continuation(3) == [8, 1, 6]  # the 3-gram 5 6 7 matches only at the start
    assert NgramIndex(ctx, 2).continuation(3) == [9, 2, 5]  # the 2-gram 6 7: latest earlier match first
    assert NgramIndex(ctx + [4], 3).continuation(3) == []  # 4 never occurred before
    assert NgramIndex([3, 3, 3], 2).continuation(5) == [3]  # the match must be followed by a token
    assert NgramIndex(ctx, 3).continuation(2, min_ngram=3) == [8, 1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_prompt_lookup_greedy_lossless(arch, runner):
    target = near_bigram_target(arch, eps=0.05)  # next token mostly a function of the current one: it cycles
    gen = SpeculativeGenerator(target, prompt_lookup(5, max_ngram=2), runner=runner)
    stats = assert_greedy_lossless(target, gen)
    # drafts were proposed, some accepted, some rejected
    drafted = sum(s.drafted_by["prompt_lookup"] for s in stats)
    accepted = sum(s.accepted_by["prompt_lookup"] for s in stats)
    assert 0 < accepted < drafted


def test_prompt_lookup_from_pretrained(tiny_target_dir):
    gen = SpeculativeGenerator.from_pretrained(tiny_target_dir, "prompt-lookup", lookup_tokens=4)
    assert isinstance(gen.drafter, LookupBranch) and gen.drafter.tokens == 4 and gen.drafter.name == "prompt_lookup"
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    ref = gen.target.generate(ids, do_sample=False, max_new_tokens=16)
    assert torch.equal(gen.generate(ids, max_new_tokens=16).sequences, ref)


# ------------------------------------------------------------------------------------------------------ hybrid
class FixedTrees(Drafter):
    """A stand-in drafter whose trees the test gives (LookupBranch reads its name, sizes, origin names, feature
    layers and session)."""

    name, tree_size, feature_layers, origin_names = "eagle", 4, [], ("head",)


def test_lookup_branch_shares_nodes_appends_the_rest_and_pads_rows():
    #        0(root)
    #      1(4)   2(5)
    #     3(6)
    parents = torch.tensor([[-1, 0, 0, 1]]).repeat(3, 1)
    tree = DraftTree(torch.tensor([[9, 4, 5, 6]]).repeat(3, 1), parents, torch.tensor([[0, 1, 1, 2]]).repeat(3, 1),
                     ancestor_matrix(parents, 2))
    head, lookup = 1, 2  # origin bits
    branch = LookupBranch(FixedTrees(), tokens=4)
    # row 0 shares 4 -> 6, then adds 8 -> 3 under node 3; row 1 a new branch from the root; row 2 nothing new
    merged = branch._merge(tree, [[4, 6, 8, 3], [7, 7], [5]])
    assert merged.tokens.tolist() == [[9, 4, 5, 6, 8, 3], [9, 4, 5, 6, 7, 7], [9, 4, 5, 6, 4, 4]]
    assert merged.parents.tolist() == [[-1, 0, 0, 1, 3, 4], [-1, 0, 0, 1, 0, 4], [-1, 0, 0, 1, 0, 0]]
    assert merged.depths[0].tolist() == [0, 1, 1, 2, 3, 4]
    assert merged.origin.tolist() == [[0, head | lookup, head, head | lookup, lookup, lookup],
                                      [0, head, head, head, lookup, lookup],
                                      [0, head, head | lookup, head, 0, 0]]  # padding: copies of node 1
    assert torch.equal(merged.ancestors.sum(2), merged.depths + 1)
    assert merged.ancestors[0, 5].nonzero().view(-1).tolist() == [0, 1, 3, 4, 5]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hybrid_greedy_lossless(arch, runner):
    target = near_bigram_target(arch, eps=0.05)
    head = random_head(target).attach_target(target)
    gen = SpeculativeGenerator(target, head, tree=TreeOptions(depth=3, top_k=2, total_tokens=5), runner=runner,
                               hybrid=True, lookup_tokens=4)
    stats = assert_greedy_lossless(target, gen)
    assert sum(s.drafted_by["prompt_lookup"] for s in stats) > 0
    assert sum(s.accepted_by["prompt_lookup"] for s in stats) > 0


def test_hybrid_oracle_head_accepts_long_paths(runner):
    target = near_bigram_target("llama")
    gen = SpeculativeGenerator(target, oracle_head(target).attach_target(target), tree="chain", runner=runner,
                               hybrid=True, lookup_tokens=6)
    stats = assert_greedy_lossless(target, gen, n_prompts=4, max_new=40)
    assert statistics.fmean(s.mean_accepted for s in stats) > 2.5
    assert all(set(s.drafted_by) == {"head", "prompt_lookup"} for s in stats)


def test_hybrid_trees_fit_the_runner_or_are_refused_before_decoding():
    """The head's tree plus the lookup branch may outgrow the static runner's default buckets (the gpu preset's 61
    nodes + 10): the generator's own runner then gets a bucket that large and decodes losslessly; a runner passed in
    whose largest bucket is too small is refused at construction, saying what does not fit."""
    from inference.runners.static import DEFAULT_BUCKETS, StaticRunner

    target = near_bigram_target("llama", eps=0.05)
    head = random_head(target).attach_target(target)
    gen = SpeculativeGenerator(target, head, tree="gpu", runner="static", hybrid=True, lookup_tokens=10)
    largest = gen.drafter.tree_size
    assert largest > DEFAULT_BUCKETS[-1] and gen.runner.buckets[-1] == largest
    assert_greedy_lossless(target, gen, n_prompts=2, max_new=12)
    small = StaticRunner(target, head.config.aux_layer_ids, buckets=(1, 4, 8))
    with pytest.raises(ValueError, match="trees reach 10 tokens .* largest verify bucket is 8"):
        SpeculativeGenerator(target, head, tree=TreeOptions(depth=2, top_k=2, total_tokens=5), runner=small,
                             hybrid=True, lookup_tokens=4)


# -------------------------------------------------------------------------------------------------- draft model
def draft_pair(arch: str, close: bool):
    """A target and a smaller draft model (2 layers) with the same vocabulary. close=True: both near-bigram models
    of the same seed, so the draft is usually right; else a random draft, usually wrong."""
    if close:  # the same bigram map g: the target's embedding, final norm and lm_head
        target, draft = near_bigram_target(arch, eps=2e-3), near_bigram_target(arch, eps=0.01, num_layers=2)
        for name in ("model.embed_tokens", "model.norm", "lm_head"):
            draft.get_submodule(name).load_state_dict(target.get_submodule(name).state_dict())
        return target, draft
    return tiny_model(arch), tiny_model(arch, seed=1, num_layers=2)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("close", [True, False], ids=["close", "random"])
def test_draft_model_greedy_lossless(arch, close, runner):
    target, draft = draft_pair(arch, close)
    gen = SpeculativeGenerator(target, DraftModelDrafter(draft, target.config.vocab_size, gamma=4, runner=runner),
                               runner=runner)
    stats = assert_greedy_lossless(target, gen, n_prompts=6)
    lengths = [n for s in stats for n in s.accept_lengths]
    if close:  # whole chains accepted (the cache rollback's "last draft not fed yet" case) and some rejections
        assert max(lengths) == 5 and min(lengths) < 5
    else:
        assert min(lengths) == 1


def test_draft_model_identical_to_target_accepts_everything(runner):
    target = tiny_model("qwen2")
    gen = SpeculativeGenerator(target, DraftModelDrafter(copy.deepcopy(target), 320, gamma=3, runner=runner),
                               runner=runner)
    out = gen.generate(prompts(1, 320)[0], max_new_tokens=24, eos_token_id=[])
    assert out.stats.accept_lengths == [4] * 6  # 24 tokens = 6 verifications of 3 drafts + bonus
    sampled = gen.generate(prompts(1, 320)[0], max_new_tokens=24, eos_token_id=[], temperature=0.9, seed=0)
    assert sampled.stats.accept_lengths == [4] * 6  # q == p: min(1, p/q) = 1 always


def test_draft_model_refuses_another_tokenizer(tmp_path):
    target = tiny_model("llama")
    with pytest.raises(TokenizerMismatchError, match="vocab size: draft model 300, target 320"):
        check_same_tokenizer(tiny_model("llama", vocab_size=300), target)
    tok = tiny_tokenizer()
    other = copy.deepcopy(tok)
    other.add_tokens(["<extra_token_xyz>"])
    with pytest.raises(TokenizerMismatchError, match="tokenizer differs"):
        check_same_tokenizer(target, target, other, tok)
    check_same_tokenizer(target, target, tok, copy.deepcopy(tok))  # the same vocabulary passes


def test_draft_model_from_pretrained(tiny_target_dir, tmp_path):
    small = tiny_model("llama", seed=1, num_layers=2)
    small.save_pretrained(tmp_path / "small")
    tiny_tokenizer().save_pretrained(tmp_path / "small")
    # float32: the default dtype is bf16 on a CPU with AVX512-BF16, where a random tiny model's near-ties may differ
    gen = SpeculativeGenerator.from_pretrained(tiny_target_dir, tmp_path / "small", gamma=3, dtype="float32")
    assert isinstance(gen.drafter, DraftModelDrafter) and gen.drafter.gamma == 3
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(gen.generate(ids, max_new_tokens=12).sequences,
                       gen.target.generate(ids, do_sample=False, max_new_tokens=12))


# --------------------------------------------------------------------------- sampling: min(1, p/q) and the residual
def chain_sampling_counts(draws: int, seed: int = 0) -> tuple[dict, dict]:
    """Speculative sampling of a 2-token chain drafted from q, verified against p, `draws` times: the observed joint
    law of the first two emitted tokens and the exact one, p1(a) p2(b | a). q is far from p, so a wrong acceptance
    or residual rule shows."""
    vocab = 10
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(True, 1.0, 0, 1.0)
    p1 = target_probs(torch.randn(vocab, generator=g) * 1.5, params)
    p2 = target_probs(torch.randn(vocab, vocab, generator=g) * 1.5, params)  # row a: p(. | first token a)
    q1 = target_probs(torch.randn(vocab, generator=g) * 1.5, params)
    q2 = target_probs(torch.randn(vocab, vocab, generator=g) * 1.5, params)
    root = torch.tensor([0])
    counts: dict = {}
    for _ in range(draws):
        d1 = torch.multinomial(q1, 1, generator=g)
        d2 = torch.multinomial(q2[d1[0]], 1, generator=g)
        tree = DraftTree.chain(root, torch.cat([d1, d2])[None], torch.stack([q1, q2[d1[0]]])[None])
        probs = torch.stack([p1, p2[d1[0]], p1])  # the target at each node (the last row is never used here)
        _, new = verify_sampling(probs, tree, g)
        if len(new) == 1:  # d1 rejected: the next step drafts from q2 after the emitted token and verifies again
            a = new[0]
            d = torch.multinomial(q2[a], 1, generator=g)
            _, more = verify_sampling(torch.stack([p2[a], p1]), DraftTree.chain(root, d[None], q2[a].view(1, 1, -1)),
                                      g)
            new = new + more
        key = (new[0], new[1])
        counts[key] = counts.get(key, 0) + 1
    expected = {(a, b): float(p1[a] * p2[a, b]) for a in range(vocab) for b in range(vocab)}
    return counts, expected


def test_speculative_sampling_rule_is_exact():
    draws = 24_000
    counts, expected = chain_sampling_counts(draws)
    assert chi_square_p(counts, expected, draws) > 1e-3


def test_chi_square_catches_a_wrong_residual(monkeypatch):
    """The same test with the residual norm(max(0, p - q)) replaced by p: it must fail decisively."""
    monkeypatch.setattr(inference.verify, "residual", lambda r, token, q: r)
    draws = 24_000
    counts, expected = chain_sampling_counts(draws)
    assert chi_square_p(counts, expected, draws) < 1e-6


def test_draft_model_generate_samples_exactly(runner):
    """End to end: the draft model's sampled chains, verified by the generator, give the target's joint law of the
    first two new tokens."""
    params = SamplingParams(True, 0.8, 0, 1.0)
    target = sampling_target()
    draft = tiny_model("llama", seed=4, vocab_size=16, num_layers=2)  # q unlike p
    gen = SpeculativeGenerator(target, DraftModelDrafter(draft, 16, gamma=2, runner=runner), runner=runner)
    prompt = torch.tensor([[5, 9, 4]])
    draws = 2000
    counts, accepted = sample_first_two(gen, prompt, params, draws, seed=3)
    assert 0 < accepted < draws  # drafts accepted and rejected
    assert chi_square_p(counts, first_two_law(target, prompt, params), draws) > 1e-3
