"""The prompt-lookup branch of batched trees (inference/drafters/lookup.py): its n-gram index finds what a scan of the
context finds, its merge hangs each row's chain where it leaves the drafter's tree within the node budget, and the
branch's nodes are accepted where the target copies its context, losslessly."""

from __future__ import annotations

import random

import pytest
import torch
from test_batch import assert_rows_match, left_padded, row_prompts
from test_inference_greedy import TREES, near_bigram_target, random_head

from inference import SpeculativeGenerator
from inference.drafter import Drafter
from inference.drafters.lookup import LookupBranch, NgramIndex
from inference.tree import DraftTree
from inference.drafters.self_draft import StreamingSelfDrafter

torch.set_num_threads(1)


def scan_continuation(context: list[int], num_tokens: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The reference: the tokens after the most recent earlier match of the context's last n tokens (longest n
    first), found by scanning the context; [] if none. A match must be followed by at least one token."""
    end = len(context)
    for n in range(min(max_ngram, end - 1), min_ngram - 1, -1):
        for start in range(end - n - 1, -1, -1):  # latest match first; a match must leave a token after it
            if context[start: start + n] == context[end - n:]:
                return context[start + n: start + n + num_tokens]
    return []


def test_ngram_index_finds_what_a_scan_finds():
    """At every prefix of random short-alphabet texts (many repeats), for several chain lengths and n-gram ranges,
    the incremental index gives scan_continuation's answer, also after tokens are appended."""
    rng = random.Random(0)
    for trial in range(20):
        text = [rng.randrange(4 if trial % 2 else 9) for _ in range(60)]
        for max_ngram, min_ngram in ((3, 1), (3, 2), (1, 1), (4, 3)):
            index = NgramIndex(text[:5], max_ngram)
            for end in range(5, len(text) + 1):
                for num in (1, 4):
                    assert index.continuation(num, min_ngram) == scan_continuation(
                        text[:end], num, max_ngram, min_ngram), (trial, end, max_ngram, min_ngram, num)
                if end < len(text):
                    index.extend([text[end]])


class FixedChain(Drafter):
    """A stand-in batched drafter that proposes the same chain under every root (enough to exercise the merge)."""

    name, tree_size, feature_layers, origin_names = "fixed", 4, [], ("fixed",)

    def __init__(self, chain):
        self.chain = torch.tensor(chain)

    def propose(self, roots, params, generator=None):
        return DraftTree.chain(roots, self.chain.expand(roots.shape[0], -1))


def merged(chain_by_row: list[list[int]], tokens: int, nodes: int) -> DraftTree:
    branch = LookupBranch(FixedChain([7, 8, 9]), tokens=tokens, nodes=nodes)
    return branch._merge(branch.drafter.propose(torch.tensor([1] * len(chain_by_row)), None), chain_by_row)


def test_merge_hangs_the_chain_where_it_leaves_the_tree_within_the_budget():
    tree = merged([[7, 5, 6], [7, 8, 9, 4], [], [3, 3]], tokens=4, nodes=2)
    assert tree.size == 4 + 2
    # row 0: shares 7, then 5 under it, then 6 under 5
    assert tree.tokens[0].tolist() == [1, 7, 8, 9, 5, 6] and tree.parents[0].tolist() == [-1, 0, 1, 2, 1, 4]
    assert tree.depths[0].tolist() == [0, 1, 2, 3, 2, 3]
    # row 1: the whole drafted chain shared, 4 extends it; padding: a copy of the root's first child
    assert tree.tokens[1].tolist() == [1, 7, 8, 9, 4, 7] and tree.parents[1].tolist() == [-1, 0, 1, 2, 3, 0]
    assert tree.depths[1].tolist() == [0, 1, 2, 3, 4, 1]
    assert tree.tokens[2].tolist() == [1, 7, 8, 9, 7, 7]  # no lookup match: two copies
    assert tree.tokens[3].tolist() == [1, 7, 8, 9, 3, 3] and tree.parents[3].tolist() == [-1, 0, 1, 2, 0, 4]
    for row in range(4):  # ancestors: each node and the nodes up its parent links
        for i in range(tree.size):
            path, node = set(), i
            while node >= 0:
                path.add(node)
                node = int(tree.parents[row, node])
            assert set(tree.ancestors[row, i].nonzero().flatten().tolist()) == path
    one = merged([[7, 5, 6]], tokens=4, nodes=1)  # a budget of one node: 6 does not fit
    assert one.tokens[0].tolist() == [1, 7, 8, 9, 5] and one.parents[0].tolist() == [-1, 0, 1, 2, 1]
    with pytest.raises(ValueError, match="nodes"):
        LookupBranch(FixedChain([7]), tokens=2, nodes=3)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lookup_branch_is_accepted_where_the_target_repeats_itself(arch):
    """A near-bigram target cycles through its context, a random head rarely guesses it: with the lookup branch
    (one or three nodes a row) rows accept lookup nodes and more tokens a step, every row's fp32 greedy output
    still equal to that row alone; the self-draft with the branch too."""
    target = near_bigram_target(arch, eps=0.05)
    rows = row_prompts(target.config.vocab_size, seed=2)
    ids, mask = left_padded(rows)
    head = random_head(target).attach_target(target)
    alone = SpeculativeGenerator(target, head, tree=TREES["wide"])
    base = alone.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=[]).stats
    for nodes in (1, 3):
        gen = SpeculativeGenerator(target, head, tree=TREES["wide"], hybrid=True, lookup_tokens=4, lookup_nodes=nodes)
        assert_rows_match(gen, target, rows, max_new=30, eos=None)
        branch = gen.drafter
        assert isinstance(branch, LookupBranch) and branch.tree_size == TREES["wide"].tree_size + nodes
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=[]).stats
        assert 0 < out.accepted_by["prompt_lookup"] <= out.drafted_by["prompt_lookup"]
        assert sum(out.rows_steps) < sum(base.rows_steps), nodes  # fewer verifications summed over the rows
    selfdraft = SpeculativeGenerator(target, StreamingSelfDrafter(target, sink=1, window=2, gamma=2), hybrid=True,
                                     lookup_tokens=3, lookup_nodes=2)
    assert_rows_match(selfdraft, target, rows, max_new=30, eos=None)
    assert selfdraft.generate(ids, attention_mask=mask, max_new_tokens=30).stats.accepted_by["prompt_lookup"] > 0
