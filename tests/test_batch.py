"""Batched generation (B rows of different lengths, left-padded) and StreamingLLM self-speculation: every row's
output equals that row decoded alone by plain greedy decoding; sampling follows the target's law per row; the
streaming draft KV stays the same size however long the context."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_inference_greedy import TREES, near_bigram_target, oracle_head, random_head
from test_inference_sampling import chi_square_p, first_two_law, sampling_target
from tiny import tiny_model

from inference import SamplingParams, SpeculativeGenerator
from inference.drafters.draft_model import DraftModelDrafter
from inference.drafters.lookup import LookupBranch, prompt_lookup
from inference.drafters.self_draft import StreamingSelfDrafter
from inference.runners.attention import prefix_attention
from inference.runners.kv import SlotMap
from inference.runners.static import StaticRunner
from inference.switch import SpeculationSwitch

torch.set_num_threads(1)
LENGTHS = (5, 11, 2, 8)  # four rows of different prompt lengths


def left_padded(rows: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (1, T_i) -> left-padded input_ids (B, T) and attention_mask (B, T), as a tokenizer pads for generate."""
    t = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), t), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, t - r.shape[1]:] = r[0]
        mask[i, t - r.shape[1]:] = 1
    return ids, mask


def row_prompts(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, n), generator=g) for n in LENGTHS]


def generators(target, window: int = 4) -> dict[str, SpeculativeGenerator]:
    """Every drafter on one target: plain, head trees (full and windowed KV), self-speculation (with the target's
    whole vocabulary and with a draft vocabulary), both with the prompt-lookup branch, prompt lookup alone and a
    draft model."""
    oracle = oracle_head(target).attach_target(target)
    draft = copy.deepcopy(target)  # a draft model that mostly agrees with the target
    with torch.no_grad():
        draft.lm_head.weight.add_(0.05 * torch.randn_like(draft.lm_head.weight))
    return {
        "plain": SpeculativeGenerator(target, None, tree="none"),
        "head": SpeculativeGenerator(target, random_head(target).attach_target(target), tree=TREES["wide"]),
        "head_oracle": SpeculativeGenerator(target, oracle, tree=TREES["deep"]),
        "head_window": SpeculativeGenerator(target, oracle, tree=TREES["deep"], draft_kv="streaming", sink=2,
                                            window=window),
        # the head drafting with int8 copies of its weights
        "head_int8": SpeculativeGenerator(target, oracle, tree=TREES["deep"], draft_weights="int8"),
        "self": SpeculativeGenerator(target, StreamingSelfDrafter(target, sink=2, window=window, gamma=3)),
        # the self-draft proposing only even token ids: its drafts of odd tokens are always rejected
        "self_vocab": SpeculativeGenerator(target, StreamingSelfDrafter(
            target, sink=2, window=window, gamma=3, vocab=torch.arange(0, target.config.vocab_size, 2))),
        # drafting with int8 copies of the target's weights (float32 here: small_gemm's reference path)
        "self_int8": SpeculativeGenerator(target, StreamingSelfDrafter(target, sink=2, window=window, gamma=3,
                                                                       weights="int8")),
        # each row's prompt-lookup chain merged into its tree (batch_lookup.py), two nodes a row
        "self_lookup": SpeculativeGenerator(target, StreamingSelfDrafter(target, sink=2, window=window, gamma=3),
                                            hybrid=True, lookup_tokens=4, lookup_nodes=2),
        "head_lookup": SpeculativeGenerator(target, random_head(target).attach_target(target), tree=TREES["wide"],
                                            hybrid=True, lookup_tokens=4, lookup_nodes=2),
        "lookup": SpeculativeGenerator(target, prompt_lookup(4)),
        "draft_model": SpeculativeGenerator(target, DraftModelDrafter(draft, target.config.vocab_size, gamma=3)),
    }


def assert_rows_match(gen, target, rows, max_new: int, eos: int | None) -> None:
    """Each row of one batched generate == that row alone through transformers' greedy generate."""
    ids, mask = left_padded(rows)
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=[] if eos is None else eos)
    for i, row in enumerate(rows):
        ref = target.generate(row, do_sample=False, max_new_tokens=max_new, eos_token_id=eos,
                              pad_token_id=0)[0, row.shape[1]:].tolist()
        n = out.stats.rows_new_tokens[i]
        assert out.sequences[i, : ids.shape[1]].tolist() == ids[i].tolist()
        assert out.sequences[i, ids.shape[1]: ids.shape[1] + n].tolist() == ref, f"row {i}"


def no_deprecated_cache_keyword(caught) -> None:
    """The engine passes the KV cache by the keyword the installed transformers takes (5.2x renamed
    `past_key_values` to `cache`, warns about the old name and removes it in 5.40): no such warning."""
    deprecated = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert not deprecated, deprecated[0]


def test_every_single_row_forward_takes_the_kv_cache_by_the_installed_keyword():
    """One row through both target runners (every batched method: test_batch_greedy_matches_each_row_alone)."""
    target = tiny_model("llama")
    rows = row_prompts(target.config.vocab_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for runner in ("static", "eager"):
            gen = SpeculativeGenerator(target, random_head(target).attach_target(target), tree=TREES["wide"],
                                       runner=runner)
            gen.generate(rows[1], max_new_tokens=6, eos_token_id=[])
    no_deprecated_cache_keyword(caught)


# the methods that run the target's own layers or weights (where an architecture differs): every method on Llama,
# these on Qwen2 and Mistral too (the head's tree, its windowed KV and the lookup branch draft the same way on each)
ARCH_METHODS = ("plain", "head", "self", "self_int8", "head_lookup", "lookup", "draft_model")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_batch_greedy_matches_each_row_alone(arch):
    """fp32, B = 4 rows of different lengths: a random target with random heads (rejections everywhere), and a
    near-bigram target whose oracle head and self-draft accept long paths, so rows advance by different amounts.
    No method passes the KV cache by the deprecated keyword."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for target in (tiny_model(arch), near_bigram_target(arch)):
            rows = row_prompts(target.config.vocab_size)
            for name, gen in generators(target).items():
                if arch == "llama" or name in ARCH_METHODS:
                    assert_rows_match(gen, target, rows, max_new=24, eos=None)
    no_deprecated_cache_keyword(caught)


def test_batch_rows_that_hit_eos_stop_there():
    """eos chosen so that rows stop at different steps (one right away, one never): each row ends exactly where it
    ends alone, and the batch goes on (and repacks) without it."""
    target = near_bigram_target("llama")
    rows = row_prompts(target.config.vocab_size, seed=3)
    alone = [target.generate(r, do_sample=False, max_new_tokens=30, eos_token_id=None)[0, r.shape[1]:].tolist()
             for r in rows]
    eos = alone[0][4]  # row 0 stops after 5 tokens
    for name, gen in generators(target).items():
        ids, mask = left_padded(rows)
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos)
        ends = [alone[i].index(eos) + 1 if eos in alone[i] else 30 for i in range(4)]
        assert out.stats.rows_new_tokens == ends, name
        assert len(set(ends)) > 1
        steps = out.stats.rows_steps  # the batch verifies until its slowest row is done; each row counts its own
        assert max(steps) == out.stats.target_forwards - 1 and sum(steps) == len(out.stats.accept_lengths), name
        assert all(s <= e - 1 for s, e in zip(steps, ends)), name  # the first token comes from the prefill
        if name == "plain":
            assert steps == [e - 1 for e in ends]
        assert_rows_match(gen, target, rows, max_new=30, eos=eos)


def test_continuous_batching_admits_waiting_requests_losslessly():
    """Two rows, then four waiting requests of other lengths, each taking the first row that frees up (rows stop at
    different steps: eos): every request's fp32 greedy output equals it decoded alone, for every batched method."""
    from inference.decode import Request, decode
    from inference.stats import GenerationStats
    from inference.stopping import Stopper

    target = near_bigram_target("llama")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, target.config.vocab_size, (n,), generator=g) for n in (9, 9, 4, 13, 1, 7)]
    alone = [target.generate(p[None], do_sample=False, max_new_tokens=20, eos_token_id=None)[0, p.shape[0]:].tolist()
             for p in prompts]
    eos = next(e for e in alone[0][:10] if len({a.index(e) if e in a else 20 for a in alone}) > 2)
    ends = [a.index(eos) + 1 if eos in a else 20 for a in alone]
    for name, gen in generators(target).items():
        drafter = gen.drafter
        runner = gen.runner
        requests = []
        for p in prompts[2:]:  # prefilled one by one, as a server prefills arrivals
            runner.reset(1, p.shape[0] + 20 + drafter.tree_size)
            with runner.session():
                logits, features = runner.prefill(p[None])
            kv = runner.export_rows()[0]["kv"]
            requests.append(Request(p, kv, logits[0], None if features is None else features[0],
                                    Stopper({eos}, [], None, 20)))
        ids = torch.stack(prompts[:2])
        runner.reset(2, 13 + 20 + drafter.tree_size)
        stats = GenerationStats()
        with runner.session():
            new = decode(runner, drafter, ids, torch.ones_like(ids), SamplingParams(),
                               [Stopper({eos}, [], None, 20) for _ in range(2)], None, stats, lambda: None,
                               waiting=iter(requests))
        assert [len(r) for r in new] == ends, name
        assert new == [a[:e] for a, e in zip(alone, ends)], name
        assert len(stats.rows_steps) == 6 and sum(stats.rows_steps) == len(stats.accept_lengths), name
        assert stats.admit_time_s > 0
        # busy steps (both rows decoding) then the tail with one row: row-steps = 2 busy + tail, steps = busy + tail
        steps = stats.target_forwards - 1
        assert 0 < stats.busy_steps == sum(stats.rows_steps) - steps <= steps, name
        assert 0 < stats.busy_tokens <= sum(len(r) for r in new) and 0 < stats.busy_time_s, name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_generate_many_equals_each_prompt_alone(arch):
    """A queue of 7 prompts of different lengths through 3 rows (continuous batching; the waiting prompts
    prefilled 2 at a time, left-padded): each prompt's fp32 greedy output equals it decoded alone, eos stopping
    prompts at different steps, for every batched method; outputs come back in the prompts' order. With a head,
    each prompt takes as many verifications as it does alone (the batched trees are the single-row trees: τ
    measured in a batch is τ alone)."""
    target = near_bigram_target(arch)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, target.config.vocab_size, (n,), generator=g) for n in (9, 3, 12, 1, 6, 9, 4)]
    alone = [target.generate(p[None], do_sample=False, max_new_tokens=20, eos_token_id=None)[0, p.shape[0]:].tolist()
             for p in prompts]
    eos = next(e for e in alone[0][:10] if len({a.index(e) if e in a else 20 for a in alone}) > 2)
    ends = [a.index(eos) + 1 if eos in a else 20 for a in alone]
    for name, gen in generators(target).items():
        out = gen.generate_many(prompts, max_new_tokens=20, batch_size=3, prefill_group=2, eos_token_id=eos)
        assert out.new_tokens == [a[:e] for a, e in zip(alone, ends)], name
        assert out.stats.rows_new_tokens == ends and out.stats.new_tokens == sum(ends), name
        assert out.stats.admit_time_s > 0 and out.stats.busy_steps > 0, name
        # the batched trees are the single-row trees: each prompt verified as often alone (but the lookup branch,
        # whose rows are padded to the step's largest tree)
        if not isinstance(gen.drafter, LookupBranch):
            alone_steps = [len(gen.generate(p[None], max_new_tokens=20, eos_token_id=eos).stats.accept_lengths)
                           for p in prompts]
            assert out.stats.rows_steps == alone_steps, name
    plain = generators(target)["plain"]
    assert plain.generate_many([p.tolist() for p in prompts[:2]], max_new_tokens=20, batch_size=3,
                               eos_token_id=eos).new_tokens == [a[:e] for a, e in zip(alone[:2], ends[:2])]
    assert plain.generate_many([], max_new_tokens=5).new_tokens == []
    with pytest.raises(ValueError, match="at least one token"):
        plain.generate_many([prompts[0], torch.zeros(0, dtype=torch.long)], max_new_tokens=5)


def test_compiled_batch_keeps_one_graph_as_rows_leave():
    """Compiled self-draft and compiled target verify: rows stop at different steps and leave the batch (the rows
    still decoding move forward in the same buffers, attention skips the rest), the draft and verify steps keep
    their shapes (one graph each, no recompile), and every row still ends exactly as it does alone. The batch's
    5-token trees are verified as 5 tokens, not padded to the next bucket (8). Two decoder layers: each layer adds
    graph to build."""
    target = near_bigram_target("llama", num_layers=2)
    rows = row_prompts(target.config.vocab_size, seed=3)
    alone = [target.generate(r, do_sample=False, max_new_tokens=30, eos_token_id=None)[0, r.shape[1]:].tolist()
             for r in rows]
    ends = {e: [a.index(e) + 1 if e in a else 30 for a in alone] for e in alone[0][:12]}
    eos = next(e for e, end in ends.items() if sum(n < 20 for n in end) >= 2 and max(end) == 30)  # 2 rows stop early
    drafter = StreamingSelfDrafter(target, sink=2, window=4, gamma=4, compile=True)
    gen = SpeculativeGenerator(target, drafter, compile=True)
    for _ in range(2):
        assert_rows_match(gen, target, rows, max_new=30, eos=eos)
        runner = gen.runner
        assert runner.batch < len(rows) and runner.rows == len(rows)  # finished rows left; the buffers kept shape
        assert drafter.alive < len(rows) and drafter.kv_shape[0] == len(rows)
    assert drafter.batches == {len(rows)}
    assert sorted(n for _, _, n in runner.shapes) == [5] and runner.compiled
    for pick in ([0, 1], [0, 1, 2, 3], [1, 3]):  # other batch sizes and back: new buffers, new graphs
        step = runner._steps[5]
        assert cached_graphs(step)
        assert_rows_match(gen, target, [rows[i] for i in pick], max_new=30, eos=eos)
        assert not cached_graphs(step)  # the replaced buffers' graphs were freed with them
    assert sorted(drafter.batches) == [2, 4]
    assert sorted(r for r, _, _ in runner.shapes) == [2, 4]


def cached_graphs(step) -> list:
    """The graphs dynamo holds for a compiled step's code."""
    return torch._dynamo.eval_frame._debug_get_cache_entry_list(step.drafthead_code)


def test_attention_skips_rows_not_in_use():
    """The matmul kernel with `rows`: the leading rows exactly as without it, the others zeros (never read)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 6, 3, 8, generator=gen)
    k, v = torch.randn(4, 2, 10, 8, generator=gen), torch.randn(4, 2, 10, 8, generator=gen)
    mask = torch.zeros(4, 1, 3, 10)
    mask[..., 7:] = float("-inf")
    full = prefix_attention(q, k, v, mask, 0.3, torch.tensor(10), torch.tensor(4))
    some = prefix_attention(q, k, v, mask, 0.3, torch.tensor(10), torch.tensor(2))
    torch.testing.assert_close(some[:2], full[:2])
    assert some[2:].abs().sum() == 0 and full[2:].abs().sum() > 0


@pytest.mark.parametrize("keep", [[0, 3, 2], [2, 0, 1], [1, 0, 2], [3]])
def test_keep_rows_moves_each_kept_row_whole(keep):
    """After keep_rows, row j of the runner's and of the self-draft's buffers holds what row keep[j] held (its used
    slots), whether the kept rows only move into freed places (copied in place) or cross (gathered first)."""
    target = tiny_model("llama")
    ids, mask = left_padded(row_prompts(target.config.vocab_size))
    runner = StaticRunner(target, [])
    drafter = StreamingSelfDrafter(target, sink=2, window=4, gamma=2)
    with runner.session(), torch.inference_mode():
        runner.reset(len(LENGTHS), ids.shape[1] + 8)
        runner.prefill(ids, mask)
        drafter.begin(runner, ids, mask, None)
        before = [(k.clone(), v.clone()) for k, v in runner.layers()]
        draft_before = drafter.cache.drafthead_kv.clone()
        start, length = runner.start.clone(), runner.length.clone()
        runner.keep_rows(torch.tensor(keep))
        drafter.keep_rows(torch.tensor(keep))
        for j, row in enumerate(keep):
            assert runner.start[j] == start[row] and runner.length[j] == length[row]
            used = slice(int(start[row]), int(length[row]))
            for (k, v), (k0, v0) in zip(runner.layers(), before):
                assert torch.equal(k[j, :, used], k0[row, :, used]) and torch.equal(v[j, :, used], v0[row, :, used])
            assert torch.equal(drafter.cache.drafthead_kv[:, :, j], draft_before[:, :, row])


def test_batch_of_one_is_a_batch_whatever_its_padding():
    """B = 1 is a batch of one row: with or without left padding, the same trees and the same tokens as plain greedy
    decoding, for the self-draft, a windowed head and the hybrid head."""
    target = tiny_model("qwen2", seed=2)
    row = row_prompts(target.config.vocab_size)[1]
    ref = target.generate(row, do_sample=False, max_new_tokens=20)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), row], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(row)], dim=1)
    head = random_head(target).attach_target(target)
    for gen in (SpeculativeGenerator(target, StreamingSelfDrafter(target, sink=1, window=3, gamma=2)),
                SpeculativeGenerator(target, head, tree=TREES["deep"], draft_kv="streaming", window=5),
                SpeculativeGenerator(target, head, tree=TREES["wide"], hybrid=True, lookup_tokens=4)):
        trees = []
        propose = gen.drafter.propose
        gen.drafter.propose = lambda *a, **k: trees.append(propose(*a, **k)) or trees[-1]
        out = gen.generate(row, max_new_tokens=20)
        assert torch.equal(out.sequences, ref) and out.stats.rows_new_tokens == [20]
        alone, trees = trees, []
        again = gen.generate(padded, attention_mask=mask, max_new_tokens=20)
        assert torch.equal(again.sequences[:, 3:], ref)
        assert len(trees) == len(alone) > 0
        for a, b in zip(alone, trees):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


def test_batch_sampling_follows_the_target_per_row():
    """Chi-square per prompt: the joint law of each prompt's first two sampled tokens, 3 different prompts in one
    batch, against the target's exact law (2,000 draws per prompt), for self-speculation (draft q != p), an oracle
    head, a draft model and prompt lookup alone (point-mass drafts, on prompts whose last token occurred before, so
    that it drafts). Each batch holds every prompt `copies` times (rows in the order p0 p1 p2 p0 p1 p2 ...), so one
    verification samples 3 x copies rows; a draw shared between rows would repeat samples and fail the test."""
    params = SamplingParams(True, 0.7, 0, 0.9)
    target = sampling_target()
    rows = [torch.tensor([[5, 9, 4]]), torch.tensor([[7, 2]]), torch.tensor([[3, 3, 12, 8]])]
    with torch.inference_mode():  # a, g(a), g(g(a)), a: the lookup copies what the near-bigram target says next
        bigram = target(torch.arange(16)[:, None]).logits[:, -1].argmax(-1)
    copy_rows = [torch.tensor([[a, int(bigram[a]), int(bigram[bigram[a]]), a]]) for a in (5, 7, 11)]
    cases = [(SpeculativeGenerator(target, StreamingSelfDrafter(target, sink=1, window=2, gamma=2)), rows),
             (SpeculativeGenerator(target, StreamingSelfDrafter(target, sink=1, window=2, gamma=2, vocab=torch.tensor(
                 [2, 3, 5, 6, 8, 9, 11, 12, 14]))), rows),
             (SpeculativeGenerator(target, StreamingSelfDrafter(target, sink=1, window=2, gamma=2, weights="int8")),
              rows),
             # the lookup branch's nodes are point masses beside the self-draft's sampled chain
             (SpeculativeGenerator(target, StreamingSelfDrafter(target, sink=1, window=2, gamma=2), hybrid=True,
                                   lookup_tokens=3, lookup_nodes=2), rows),
             (SpeculativeGenerator(target, oracle_head(target).attach_target(target), tree=TREES["wide"]), rows),
             (SpeculativeGenerator(target, DraftModelDrafter(tiny_model("llama", seed=4, vocab_size=16, num_layers=2),
                                                             16, gamma=2)), rows),
             (SpeculativeGenerator(target, prompt_lookup(2)), copy_rows)]
    draws, copies = 2000, 50
    for gen, prompts in cases:
        ids, mask = left_padded(prompts * copies)
        laws = [first_two_law(target, r, params) for r in prompts]
        g = torch.Generator().manual_seed(4)
        counts = [{} for _ in prompts]
        accepted = 0
        for _ in range(draws // copies):
            out = gen.generate(ids, attention_mask=mask, max_new_tokens=2, temperature=0.7, top_p=0.9, top_k=0,
                               eos_token_id=[], generator=g)
            for j in range(ids.shape[0]):
                key, seen = tuple(out.sequences[j, ids.shape[1]:].tolist()), counts[j % len(prompts)]
                seen[key] = seen.get(key, 0) + 1
            assert out.stats.rows_steps == [1] * ids.shape[0]  # one verification a row: its first step
            accepted += sum(a > 1 for a in out.stats.accept_lengths)
        assert accepted > draws // 2, gen.drafter.name  # drafts were accepted often: the sampling rule was exercised
        for i in range(len(prompts)):
            assert sum(counts[i].values()) == draws
            assert chi_square_p(counts[i], laws[i], draws) > 1e-3, (gen.drafter.name, i)


def test_streaming_draft_kv_is_constant_in_context_length():
    """The self-draft's and the windowed head's KV buffers have the same shape for a 40- and a 400-token context,
    while the target's grow; the full-KV head's grow with the context."""
    target = tiny_model("llama")
    shapes = {}
    for context in (40, 400):
        ids = torch.randint(3, 300, (2, context), generator=torch.Generator().manual_seed(context))
        self_gen = SpeculativeGenerator(target, StreamingSelfDrafter(target, sink=4, window=16, gamma=3))
        head = random_head(target).attach_target(target)
        window_gen = SpeculativeGenerator(target, head, tree=TREES["wide"], draft_kv="streaming", sink=4, window=16)
        full_gen = SpeculativeGenerator(target, head, tree=TREES["wide"])
        for name, gen in (("self", self_gen), ("head_window", window_gen), ("head", full_gen)):
            gen.generate(ids, max_new_tokens=4, eos_token_id=[])
            shapes[name, context] = gen.drafter.kv_shape
            shapes["target", context] = tuple(gen.runner.layers()[0][0].shape)
    assert shapes["self", 40] == shapes["self", 400] == (2, 2, 4 + 16 + 3 + 1, 16)
    assert shapes["head_window", 40] == shapes["head_window", 400]
    assert shapes["head", 40][2] < shapes["head", 400][2]
    assert shapes["target", 40][2] < shapes["target", 400][2]


def test_slot_map_keeps_sinks_and_the_last_window():
    layout = SlotMap(sink=2, window=3)
    positions, valid = layout.needed(torch.tensor([0, 0, 5]), torch.tensor([9, 3, 7]))
    kept = [p[v].tolist() for p, v in zip(positions, valid)]
    assert kept == [[0, 1, 6, 7, 8], [0, 1, 2], [5, 6]]
    assert layout.slots(torch.tensor([0, 1, 2, 3, 4, 5, 8])).tolist() == [0, 1, 2, 3, 4, 2, 2]
    assert SlotMap().slots(torch.tensor([7])).tolist() == [7] and SlotMap().needed(
        torch.tensor([1]), torch.tensor([4]))[0].tolist() == [[1, 2, 3]]


def test_batch_refusals():
    target = tiny_model("llama")
    rows = row_prompts(target.config.vocab_size)
    ids, mask = left_padded(rows)
    gen = SpeculativeGenerator(target, None, tree="none")
    with pytest.raises(ValueError, match="left-padded"):
        gen.generate(ids, attention_mask=mask.flip(1), max_new_tokens=2)
    with pytest.raises(ValueError, match="streamer"):
        gen.generate(ids, attention_mask=mask, max_new_tokens=2, streamer=object())
    with pytest.raises(ValueError, match="to a draft head, to 'self' or to tree='none'"):
        SpeculativeGenerator.from_pretrained(target, "prompt-lookup", hybrid=True)
    with pytest.raises(ValueError, match="batch_size and prefill_group"):
        gen.generate_many([ids[0]], max_new_tokens=2, batch_size=0)
    with pytest.raises(ValueError, match="streaming"):
        SpeculativeGenerator.from_pretrained(target, "self")
    with pytest.raises(ValueError, match="speculate must be"):
        SpeculativeGenerator(target, None, tree="none", speculate="sometimes")
    with pytest.raises(ValueError, match="applies to a head or to the self-draft"):
        SpeculativeGenerator.from_pretrained(target, "prompt-lookup", draft_weights="int8")
    with pytest.raises(ValueError, match="weights must be one of"):
        SpeculativeGenerator.from_pretrained(target, "self", draft_kv="streaming", draft_weights="int4")
    with pytest.raises(ValueError, match="weights must be one of"):
        SpeculativeGenerator(target, random_head(target).attach_target(target), draft_weights="int4")
    with pytest.raises(NotImplementedError, match="static KV"):
        StaticRunner(tiny_model("mistral", sliding_window=8), [])


def test_grid_cell_methods_decode_the_same_rows():
    """One grid cell on a tiny fp32 target: every method decodes the same prefilled rows (greedy rows equal plain
    decoding's), each `repeats` times in turn, and the cell reports the median run of each."""
    from inference.bench.batch import prefill_rows, run_group, summarise_cell
    from inference.drafter import PlainDrafter

    target = near_bigram_target("llama")
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, target.config.vocab_size, (4, 40), generator=g).tolist()
    runner = StaticRunner(target, [])
    drafters = {"plain": PlainDrafter(), "self": StreamingSelfDrafter(target, sink=2, window=8, gamma=3)}
    drafters["self_auto"] = drafters["self"]  # the same drafter with the switch (batch_switch.py)
    rows, _ = prefill_rows(runner, prompts)
    group = run_group(runner, drafters, rows, max_new=16, repeats=3)
    cell = summarise_cell([group], list(drafters), b=4, context=40)
    for name, m in cell["methods"].items():
        assert len(m["decode_s_runs"]) == 3 and m["decode_s_runs"] == sorted(m["decode_s_runs"])
        assert m["decode_s"] == m["decode_s_runs"][1] and m["tokens"] == 4 * 16, name
    assert cell["methods"]["self"]["greedy_match"] and cell["methods"]["self"]["tau"] > 1.5
    assert cell["methods"]["self_auto"]["greedy_match"] and cell["methods"]["self"]["plain_steps"] == 0
    refs = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16)[0, 40:].tolist() for p in prompts]
    assert group["plain"]["rows"] == refs
    # continuous batching: two rows, the other two prompts (then the first two again) waiting for a free row
    queue = run_group(runner, drafters, rows[:2], max_new=16, waiting=rows[2:] + rows[:2])
    cell = summarise_cell([queue], list(drafters), b=2, context=40)
    assert cell["prompts"] == 6 and cell["methods"]["self"]["greedy_match"] and cell["methods"]["self_auto"]["greedy_match"]
    assert queue["self"]["rows"] == refs[:2] + refs[2:] + refs[:2] == queue["plain"]["rows"]
    assert cell["methods"]["self"]["admit_s"] > 0


def test_verify_steps_of_several_sizes_on_a_full_buffer_commit_nothing():
    """runner.verify of n chained tokens per row (n = 1 and 3) over 20 held entries, as a cost measurement runs it:
    each returns one row of logits per token and leaves the committed lengths alone."""
    runner = StaticRunner(tiny_model("llama"), [])
    batch, context = 2, 20
    runner.reset(batch, context + 4)
    gen = torch.Generator().manual_seed(0)
    for keys, values in runner.layers():
        keys.normal_(generator=gen)
        values.normal_(generator=gen)
    runner.start = torch.zeros(batch, dtype=torch.long)
    runner.length = torch.full((batch,), context, dtype=torch.long)
    with runner.session(), torch.inference_mode():
        for n in (1, 3, 1):
            tokens = torch.randint(0, runner.model.config.vocab_size, (batch, n), generator=gen)
            depths = torch.arange(n).expand(batch, n)
            chain = torch.ones(n, n, dtype=torch.bool).tril().expand(batch, n, n)
            logits, _, argmax = runner.verify(tokens, depths, chain)
            assert logits.shape[:2] == argmax.shape == (batch, n) and torch.isfinite(logits.float()).all()
    assert runner.length.tolist() == [context, context]  # verify steps only: nothing committed


def test_self_draft_vocabulary_drafts_only_its_tokens():
    """A self-draft with a draft vocabulary proposes only those target ids, greedy (its best among them) and
    sampled (q is zero outside them), and refuses ids outside the target's vocabulary."""
    target = near_bigram_target("llama")
    vocab = torch.arange(1, target.config.vocab_size, 3)

    class Recording(StreamingSelfDrafter):
        def propose(self, roots, params, generator=None):
            tree = super().propose(roots, params, generator)
            self.trees.append(tree)
            return tree

    drafter = Recording(target, sink=2, window=4, gamma=3, vocab=vocab)
    drafter.trees = []
    gen = SpeculativeGenerator(target, drafter)
    ids, mask = left_padded(row_prompts(target.config.vocab_size, seed=5))
    gen.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[])
    gen.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], temperature=1.0,
                 generator=torch.Generator().manual_seed(0))
    drafted = torch.cat([t.tokens[:, 1:].flatten() for t in drafter.trees])
    assert len(drafted) > 50 and torch.isin(drafted, vocab).all()
    sampled = [t.q[:, 1:] for t in drafter.trees if getattr(t, "q", None) is not None]
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    assert sampled and all(float(q[..., outside].sum()) == 0 for q in sampled)
    for bad in (torch.tensor([0, target.config.vocab_size]), torch.tensor([], dtype=torch.long)):
        with pytest.raises(ValueError, match="vocab must be a 1-D tensor of target ids"):
            StreamingSelfDrafter(target, vocab=bad)


class Alternating(SpeculationSwitch):
    """A switch that takes a plain step every third step whatever the costs (the mix the exactness tests need)."""

    def speculate(self, requests):
        return self.steps % 3 != 2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_switch_mixes_plain_and_speculative_steps_losslessly(arch):
    """fp32, B = 4 rows of different lengths, eos stopping rows at different steps: with plain steps between the
    speculative ones (the drafter's skip() keeps it in step), every row still equals that row decoded alone, for
    the head (full and windowed KV) and the self-draft."""
    target = near_bigram_target(arch)
    rows = row_prompts(target.config.vocab_size, seed=3)
    alone = [target.generate(r, do_sample=False, max_new_tokens=24, eos_token_id=None)[0, r.shape[1]:].tolist()
             for r in rows]
    eos = alone[0][6]
    oracle = oracle_head(target).attach_target(target)
    gens = {
        "head": SpeculativeGenerator(target, random_head(target).attach_target(target), tree=TREES["wide"],
                                     speculate=Alternating()),
        "head_window": SpeculativeGenerator(target, oracle, tree=TREES["deep"], draft_kv="streaming", sink=2,
                                            window=4, speculate=Alternating()),
        "self": SpeculativeGenerator(target, StreamingSelfDrafter(target, sink=2, window=4, gamma=3),
                                     speculate=Alternating()),
    }
    for name, gen in gens.items():
        for stop in (None, eos):
            assert_rows_match(gen, target, rows, max_new=24, eos=stop)
            ids, mask = left_padded(rows)
            out = gen.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[] if stop is None else stop)
            steps = out.stats.target_forwards - 1
            assert out.stats.plain_steps == steps // 3 > 0, name
            if name != "head":  # oracle drafts: the speculative steps still accept long paths
                assert max(out.stats.accept_lengths) > 2, name
            if name == "head" and stop is None:  # every committed pair is in the head's KV but each row's last,
                d = gen.drafter  # which waits for the next step with its root
                fed = d.next_pos + d.pending["valid"].sum(dim=1)
                assert fed.tolist() == gen.runner.positions.tolist() == (d.slot_pos >= 0).sum(1).add(1).tolist()


def test_switch_speculates_only_where_it_pays():
    """The switch's choice from measured costs: each kind tried once for a batch size, then the faster one in
    tokens a second (rows' measured tokens per speculative step against one token per plain step), the other
    tried again every recheck_every steps; a compile-slow first step does not count once a second one is seen."""
    with pytest.raises(ValueError):
        SpeculationSwitch(recheck_every=1)
    s = SpeculationSwitch(recheck_every=4)
    assert s.speculate([0, 1, 2, 3])  # nothing measured: speculate first
    s.record(True, [0, 1, 2, 3], 30.0, [3, 3, 3, 3])  # a first step that compiled
    assert not s.speculate([0, 1, 2, 3])  # then a plain step, to measure it
    s.record(False, [0, 1, 2, 3], 0.05, [1, 1, 1, 1])
    assert not s.speculate([0, 1, 2, 3])  # 12 tokens in 30 s against 4 in 0.05 s
    s.record(False, [0, 1, 2, 3], 0.05, [1, 1, 1, 1])
    s.record(True, [0, 1, 2, 3], 0.1, [3, 3, 3, 3])  # the speculative step measured again (the recheck)
    assert s.cost(True, 4) == 0.1 and s.cost(False, 4) == 0.05
    assert s.speculate([0, 1, 2, 3])  # 120 tokens/s against 80
    for _ in range(3):
        s.record(True, [0, 1, 2, 3], 0.1, [3, 3, 3, 3])
        assert s.speculate([0, 1, 2, 3])
    s.record(True, [0, 1, 2, 3], 0.1, [3, 3, 3, 3])
    assert not s.speculate([0, 1, 2, 3])  # recheck_every steps of one kind: the other once
    s.record(False, [0, 1, 2, 3], 0.05, [1, 1, 1, 1])
    assert s.speculate([0, 1, 2, 3])
    # rows that accept little: 4 × 1.2 tokens in 0.1 s against 4 in 0.05 s
    for _ in range(4):
        s.record(True, [0, 1, 2, 3], 0.1, [1, 1, 2, 1])
    assert not s.speculate([0, 1, 2, 3])
    # two rows left: their own gains, the speculative cost of the larger batch until measured, plain tried once
    s.reset()
    s.record(True, [0, 1, 2, 3], 0.1, [4, 4, 1, 1])
    s.record(False, [0, 1, 2, 3], 0.06, [1, 1, 1, 1])
    assert s.cost(True, 2) == 0.1 and s.cost(False, 2) is None
    assert not s.speculate([2, 3])
    s.record(False, [2, 3], 0.03, [1, 1])
    assert not s.speculate([2, 3])  # rows 2 and 3 accept nothing: 2 tokens in 0.1 s against 2 in 0.03 s
    assert s.speculate([0, 1])  # rows 0 and 1: 8 tokens in 0.1 s against 2 in 0.03 s


def test_grid_plot_is_written_with_and_without_the_busy_rates(tmp_path):
    """plot_grid draws one panel per method from the grid's JSON; cells with busy_speedup get its dotted line,
    and a JSON from before that field still plots."""
    from inference.bench.batch import plot_grid

    def cell(batch, speedup, busy):
        self_figures = {"speedup": speedup, **({"busy_speedup": busy} if busy else {})}
        return {"context": 2048, "batch": batch, "methods": {"plain": {"speedup": 1.0}, "self": self_figures}}

    for busy in (True, False):
        result = {"target": "tiny", "dtype": "torch.float32", "max_new_tokens": 4,
                  "methods": {"plain": "", "self": ""},
                  "cells": [cell(1, 1.1, 1.1 if busy else None), cell(4, 1.2, 1.5 if busy else None)]}
        path = tmp_path / f"grid_{busy}.png"
        plot_grid(result, path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert not path.with_suffix(".tmp.png").exists()
