"""Pruning a head's draft vocabulary (DraftHead.pruned, inference.tuning.draft_vocab) and `--draft-vocab auto`: the pruned
head drafts exactly the full head's logits over the kept tokens, decoding with it stays lossless, and the tuner
measures each candidate size on the chosen tree."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from test_inference_greedy import assert_lossless, prompts
from tiny import tiny_head, tiny_model, tiny_tokenizer

from conftest import save_tiny_target
from drafthead import save_head
from inference import SpeculativeGenerator, TreeOptions
from inference.tuning import budget
from inference.tuning.draft_vocab import assistant_token_counts, parse_draft_vocab, vocab_candidates
from inference.runners.static import StaticRunner

torch.set_num_threads(1)


def head_logits(head, target, ids: torch.Tensor) -> torch.Tensor:
    """The head's draft logits (1, T, draft vocab) over a prompt, fed the target's own features."""
    out = target(ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1] for i in head.config.aux_layer_ids], dim=-1)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    return head.logits(head(ids, head.fuse(features), positions))


def test_pruned_head_keeps_the_most_frequent_tokens_and_their_logits():
    """keep=30 of 200: the kept draft tokens are the 30 with the highest counts (by target id), in increasing target
    id; d2t maps each kept row to its target id, t2d marks exactly those; the logits are the full head's columns."""
    target = tiny_model("llama")
    head = tiny_head(target, draft_vocab_size=200)
    full_ids = torch.arange(200) + head.d2t  # target id of each draft row
    counts = torch.zeros(target.config.vocab_size, dtype=torch.long)
    counts[full_ids] = torch.randperm(200) + 1  # distinct counts
    pruned = head.pruned(counts, 30)
    kept = torch.sort(full_ids[torch.topk(counts[full_ids], 30).indices]).values
    assert pruned.config.draft_vocab_size == 30 and pruned.lm_head.weight.shape[0] == 30
    assert torch.equal(torch.arange(30) + pruned.d2t, kept)
    assert torch.equal(pruned.t2d.nonzero().flatten(), kept)
    assert head.config.draft_vocab_size == 200 and head.lm_head.weight.shape[0] == 200  # the original is untouched
    ids = prompts(1, target.config.vocab_size, seed=2)[0]
    with torch.no_grad():
        full, small = head_logits(head, target, ids), head_logits(pruned, target, ids)
    rows = torch.searchsorted(full_ids, kept)
    assert torch.equal(full_ids[rows], kept)
    torch.testing.assert_close(small, full[..., rows], rtol=0, atol=0)


def test_pruned_head_refuses_bad_sizes_and_eagle1():
    target = tiny_model("llama")
    head = tiny_head(target, draft_vocab_size=200)
    counts = torch.ones(target.config.vocab_size, dtype=torch.long)
    for keep in (0, 201):
        with pytest.raises(ValueError, match="keep must be in 1..200"):
            head.pruned(counts, keep)
    with pytest.raises(ValueError, match="only EAGLE-3"):
        tiny_head(target, kind="eagle1").pruned(counts, 10)


def test_decoding_with_a_pruned_head_is_lossless():
    """fp32 greedy: a head pruned to 12 of its 200 tokens (most of its proposals gone) still gives plain decoding's
    tokens exactly, on both runners."""
    target = tiny_model("qwen2")
    head = tiny_head(target, draft_vocab_size=200)
    pruned = head.pruned(torch.arange(target.config.vocab_size), 12)
    trees = {"chain": TreeOptions(depth=4, top_k=1, total_tokens=4), "tree": TreeOptions(3, 3, 7)}
    for runner in ("static", "eager"):
        assert_lossless(target, pruned, trees, n_prompts=6, runner=runner)


def test_assistant_token_counts_reads_both_conversation_formats(tmp_path):
    """ShareGPT `conversations` and OpenAI `messages` lines count only the assistant's words; a file without any
    assistant turn, or no file, is an error that names it."""
    tok = tiny_tokenizer()
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "hello world"},
                                                  {"from": "gpt", "value": "the quick brown fox"}]}) + "\n" +
                    json.dumps({"messages": [{"role": "user", "content": "lazy dog"},
                                             {"role": "assistant", "content": "the fox"}]}) + "\n")
    counts = assistant_token_counts(tok, path, 320)
    expected = torch.zeros(320, dtype=torch.int64)
    for text in ("the quick brown fox", "the fox"):
        for i in tok(text, add_special_tokens=False).input_ids:
            expected[i] += 1
    assert torch.equal(counts, expected)
    (tmp_path / "none.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(SystemExit, match="none.jsonl: no assistant turns"):
        assistant_token_counts(tok, tmp_path / "none.jsonl", 320)
    with pytest.raises(FileNotFoundError, match="absent.jsonl: no corpus .*fetch_assets"):  # not a bare traceback
        assistant_token_counts(tok, tmp_path / "absent.jsonl", 320)


def test_parse_draft_vocab_and_candidates():
    assert parse_draft_vocab("auto") == "auto" and parse_draft_vocab("4096") == 4096
    for bad in ("0", "-3", "many"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive number of draft tokens or 'auto'"):
            parse_draft_vocab(bad)
    target = tiny_model("llama")
    head = tiny_head(target, draft_vocab_size=200)
    heads = vocab_candidates(head, torch.arange(target.config.vocab_size), (50, 100, 400))
    assert sorted(heads) == [50, 100, 200] and heads[200] is head  # 400 is above the head's own size
    assert all(h.config.draft_vocab_size == n for n, h in heads.items())


def test_draft_vocab_trial_measures_every_size_and_keeps_the_fastest():
    """Each candidate decodes the calibration prompts on the chosen tree (taking turns on one runner): the rates
    are real (tokens/s > 0, tau >= 1), the choice is the fastest measured, and auto_tree reports it and hands the
    chosen head on."""
    target = tiny_model("llama")
    head = tiny_head(target, draft_vocab_size=200)
    heads = vocab_candidates(head, torch.arange(target.config.vocab_size), (20, 60))
    runner = StaticRunner(target, head.config.aux_layer_ids, buckets=(1, 4, 8))
    tree = TreeOptions(depth=2, top_k=2, total_tokens=3)
    calib = prompts(2, target.config.vocab_size, seed=6)
    chosen, report = budget.choose_draft_vocab(target, heads, runner, tree, calib, max_new_tokens=10, rounds=1,
                                               verbose=False, generator=SpeculativeGenerator)
    rates = report["trial"]
    assert set(rates) == {"20", "60", "200"}
    assert all(r["tokens_per_s"] > 0 and r["tau"] >= 1 for r in rates.values())
    assert str(report["chosen"]) == max(rates, key=lambda n: rates[n]["tokens_per_s"])
    assert chosen is heads[report["chosen"]]


def test_bench_draft_vocab_auto(tmp_path):
    """`--draft-vocab auto --vocab-sizes 20,60` with a preset tree: the JSON names the size the trial kept and its
    measured rates, the speculative method drafts with the head of that size, and the unpruned head is measured
    beside it unless it was the one kept; fp32 output equals plain decoding's."""
    from transformers import AutoModelForCausalLM

    from inference.bench import build_parser, run_bench

    target_dir = save_tiny_target(tmp_path / "target")
    save_head(tiny_head(AutoModelForCausalLM.from_pretrained(target_dir), draft_vocab_size=200), tmp_path / "h")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"conversations": [{"from": "gpt", "value": t}]}) + "\n"
                              for t in ["the quick brown fox", "jumps over the lazy dog", "hello world"]))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": w}) + "\n" for w in ["a b a b", "c d e"]))
    args = build_parser().parse_args([
        "--target", str(target_dir), "--draft", str(tmp_path / "h"), "--methods", "engine_plain,speculative,full_vocab",
        "--prompts", str(tmp_path / "p.jsonl"), "--max-new-tokens", "12", "--tree", "chain", "--dtype", "float32",
        "--compile", "off", "--threads", "1", "--draft-vocab", "auto", "--vocab-sizes", "20,60",
        "--vocab-corpus", str(corpus), "--calibration-tokens", "8"])
    result = run_bench(args)
    trial = result["tree"]["draft_vocab"]
    assert set(trial["trial"]) == {"20", "60", "200"}
    assert result["draft_vocab"] == trial["chosen"] and result["draft_vocab_requested"] == "auto"
    assert str(trial["chosen"]) == max(trial["trial"], key=lambda n: trial["trial"][n]["tokens_per_s"])
    names = list(result["tokens_per_s"])
    assert names[:3] == ["plain", "engine_plain", "speculative_chain"]
    assert ("speculative_full_vocab" in names) == (trial["chosen"] != 200)
    assert result["greedy_match"] == 1.0


def test_from_pretrained_draft_vocab(tmp_path, tiny_target_dir, sharegpt_path):
    """from_pretrained(..., draft_vocab=N): the self-draft proposes the N tokens ShareGPT's assistant turns use
    most, a head is pruned to N rows; other drafters refuse it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference.tuning.draft_vocab import frequent_tokens

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    gen = SpeculativeGenerator.from_pretrained(tiny_target_dir, "self", draft_kv="streaming", window=8, draft_vocab=40)
    assert torch.equal(gen.drafter.vocab, frequent_tokens(tok, 320, 40, sharegpt_path))
    assert gen.drafter.vocab_weight.shape == (40, 64)
    save_head(tiny_head(AutoModelForCausalLM.from_pretrained(tiny_target_dir), draft_vocab_size=200), tmp_path / "h")
    gen = SpeculativeGenerator.from_pretrained(tiny_target_dir, tmp_path / "h", tree="cpu", draft_vocab=30)
    assert gen.head.config.draft_vocab_size == 30 and gen.head.lm_head.weight.shape[0] == 30
    with pytest.raises(ValueError, match="draft_vocab applies to a head or to 'self', not to prompt_lookup"):
        SpeculativeGenerator.from_pretrained(tiny_target_dir, "prompt-lookup", draft_vocab=10)
