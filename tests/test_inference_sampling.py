"""Sampling losslessness: speculative samples follow the target's processed distribution exactly."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from test_inference_greedy import near_bigram_target, oracle_head
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from inference import SamplingParams, SpeculativeGenerator, TreeOptions
from inference.sampling import process_logits, target_probs
from inference.tree import DraftTree, ancestor_matrix
from inference.verify import children_lists, verify_sampling

torch.set_num_threads(1)
SETTINGS = [SamplingParams(True, 1.0, 0, 1.0), SamplingParams(True, 0.7, 0, 0.9)]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 0.8), (0.5, 50, 0.95)])
def test_processing_identical_to_transformers(temperature, top_k, top_p):
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, :10] = 1.0  # ties at the top-k boundary
    hf = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    hf += [TopKLogitsWarper(top_k)] if top_k else []
    hf += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    expected = LogitsProcessorList(hf)(None, logits.clone())
    ours = process_logits(logits, SamplingParams(True, temperature, top_k, top_p))
    assert torch.equal(ours, expected)


def test_sampling_params_follow_generate_defaults():
    from transformers import GenerationConfig

    assert not SamplingParams.make().do_sample
    assert not SamplingParams.make(temperature=0.0).do_sample
    assert SamplingParams.make(temperature=0.7) == SamplingParams(True, 0.7, 50, 1.0)
    gc = GenerationConfig(do_sample=True, top_p=0.9)
    assert SamplingParams.make(generation_config=gc) == SamplingParams(True, 1.0, 50, 0.9)
    assert SamplingParams.make(top_k=3, generation_config=gc) == SamplingParams(True, 1.0, 3, 0.9)


def chi_square_p(observed: dict, expected: dict, n: int) -> float:
    """Goodness of fit; categories expected < 5 times are pooled. Impossible outcomes must never occur."""
    impossible = [k for k in observed if expected.get(k, 0.0) == 0.0]
    assert not impossible, f"outcomes with probability 0 were sampled: {impossible[:5]}"
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for k, p in expected.items():
        if p * n < 5:
            pool_o, pool_e = pool_o + observed.get(k, 0), pool_e + p * n
        else:
            obs.append(observed.get(k, 0))
            exp.append(p * n)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    scale = sum(obs) / sum(exp)  # float rounding of the probabilities
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def joint_first_two(probs: torch.Tensor, tree: DraftTree) -> dict:
    """Exact law of (first token, second token or None) emitted by one verification of `tree`."""
    tokens = tree.tokens[0].tolist()
    kids = children_lists(tree)
    expected = {}
    for t1, p1 in enumerate(probs[0].tolist()):
        child = next((c for c in kids[0] if tokens[c] == t1), None)
        if child is None:
            expected[(t1, None)] = p1  # the path leaves the tree: t1 is the bonus token
        else:
            for t2, p2 in enumerate(probs[child].tolist()):
                expected[(t1, t2)] = p1 * p2
    return expected


@pytest.mark.parametrize("params", SETTINGS, ids=["t1", "t0.7-p0.9"])
def test_verifier_is_exact(params):
    """The verifier alone, 24,000 draws on three trees with fixed target logits (children include tokens the
    processing removed, so rejections and empty residuals are exercised)."""
    vocab, draws = 12, 8000
    g = torch.Generator().manual_seed(1)
    trees = [  # (tokens, parents): root first, parents before children
        ([0, 3, 7, 1, 5, 3, 9, 2], [-1, 0, 0, 0, 1, 1, 2, 4]),
        ([4, 1, 2, 3, 4, 5, 6, 7, 8], [-1, 0, 0, 0, 0, 0, 0, 1, 1]),  # root children hold most of the mass
        ([0, 6, 6, 6, 6], [-1, 0, 1, 2, 3]),  # a chain
    ]
    longest = 0
    for tokens, parents in trees:
        parents_t = torch.tensor(parents)
        depths = torch.zeros(len(parents), dtype=torch.long)
        for i, p in enumerate(parents[1:], 1):
            depths[i] = depths[p] + 1
        tree = DraftTree(torch.tensor([tokens]), parents_t[None], depths[None],
                         ancestor_matrix(parents_t[None], int(depths.max())))
        logits = torch.randn(len(tokens), vocab, generator=g) * 2
        logits[:, tokens[1]] += 2  # make the first child likely, so multi-token paths are common
        probs = target_probs(logits, params)
        counts: dict = {}
        lengths = set()
        for _ in range(draws):
            path, new = verify_sampling(probs, tree, g)
            assert len(new) == len(path) and new[:-1] == [tokens[i] for i in path[1:]]
            key = (new[0], new[1] if len(new) > 1 else None)
            counts[key] = counts.get(key, 0) + 1
            lengths.add(len(new))
        assert max(lengths) >= 2
        longest = max(longest, max(lengths))
        p = chi_square_p(counts, joint_first_two(probs, tree), draws)
        assert p > 1e-3, (tokens, p)
    assert longest >= 3


def sampling_target():
    """The target of the end-to-end chi-square tests: a 16-token near-bigram Llama (drafts are often accepted) of
    two layers, since the tests draw thousands of times and the law they check is the target's own at any depth."""
    return near_bigram_target("llama", eps=0.02, vocab_size=16, num_layers=2)


def first_two_law(target, prompt: torch.Tensor, params: SamplingParams) -> dict:
    """The target's exact joint law of its first two sampled tokens after `prompt` (a 16-token vocabulary)."""
    with torch.inference_mode():
        p1 = target_probs(target(prompt).logits[0, -1], params)
        nxt = torch.cat([prompt.expand(16, -1), torch.arange(16).view(16, 1)], dim=1)
        p2 = target_probs(target(nxt).logits[:, -1], params)  # (16, V): law of t2 given t1
    return {(a, b): float(p1[a] * p2[a, b]) for a in range(16) for b in range(16)}


def sample_first_two(gen: SpeculativeGenerator, prompt: torch.Tensor, params: SamplingParams, draws: int,
                     seed: int) -> tuple[dict, int]:
    """Counts of the first two tokens over `draws` generations, and how many first steps accepted a draft."""
    g = torch.Generator().manual_seed(seed)
    counts: dict = {}
    accepted = 0
    for _ in range(draws):
        out = gen.generate(prompt, max_new_tokens=2, temperature=params.temperature, top_p=params.top_p,
                           top_k=params.top_k, eos_token_id=[], generator=g)
        key = tuple(out.sequences[0, prompt.shape[1]:].tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += out.stats.accept_lengths[0] > 1
    return counts, accepted


@pytest.mark.parametrize("params", SETTINGS[1:], ids=["t0.7-p0.9"])
def test_generate_samples_exactly(params, runner):
    """End to end through SpeculativeGenerator: joint law of the first two new tokens vs the target's own."""
    target = sampling_target()
    gen = SpeculativeGenerator(target, oracle_head(target).attach_target(target), tree=TreeOptions(3, 3, 6),
                               runner=runner)
    prompt = torch.tensor([[5, 9, 4]])
    draws = 1500
    counts, accepted = sample_first_two(gen, prompt, params, draws, seed=2)
    assert accepted > draws // 4  # the drafted token was accepted often
    assert chi_square_p(counts, first_two_law(target, prompt, params), draws) > 1e-3


def test_seed_reproducible(runner):
    target = near_bigram_target("qwen2", eps=0.02)
    gen = SpeculativeGenerator(target, oracle_head(target).attach_target(target), tree="cpu", runner=runner)
    prompt = torch.tensor([[5, 9, 4]])
    a = gen.generate(prompt, max_new_tokens=20, temperature=0.8, seed=7).sequences
    b = gen.generate(prompt, max_new_tokens=20, temperature=0.8, seed=7).sequences
    c = gen.generate(prompt, max_new_tokens=20, temperature=0.8, seed=8).sequences
    assert torch.equal(a, b) and not torch.equal(a, c)
