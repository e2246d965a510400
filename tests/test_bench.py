"""inference.bench on a tiny target: the JSON a user quotes, and bf16 divergences that are all explained."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_head

from conftest import save_tiny_target, stub_tree_search
from drafthead import save_head
from drafthead.hardware import auto_dtype


def test_bench_json_and_bf16_divergences(tmp_path):
    from transformers import AutoModelForCausalLM

    from inference.bench import main

    target_dir = save_tiny_target(tmp_path / "target")
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    save_head(tiny_head(target, draft_vocab_size=200), tmp_path / "head")
    words = ["alpha beta gamma", "one two three four", "red green blue", "sun moon star", "up down left right"]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": w}) + "\n" for w in words))
    out = tmp_path / "bench.json"
    torch.manual_seed(0)
    main(["--target", str(target_dir), "--draft", str(tmp_path / "head"), "--prompts", str(tmp_path / "prompts.jsonl"),
          "--max-new-tokens", "24", "--tree", "cpu", "--compare-tree", "gpu", "--dtype", "bfloat16",
          "--threads", "1", "--compile", "off", "--out", str(out)])
    result = json.loads(out.read_text())
    assert {"speedup", "tau", "tokens_per_s", "greedy_match", "prompts", "device", "dtype"} <= set(result)
    assert result["prompts"] == 5 and result["dtype"] == "bfloat16"
    assert set(result["tokens_per_s"]) == {"plain", "prompt_lookup", "engine_plain", "speculative_cpu",
                                           "speculative_gpu"}
    assert result["speedup_vs_engine_plain"] > 0 and result["runner"] == "StaticRunner"
    assert (tmp_path / "bench.png").exists()
    # tau is the mean accepted length (bonus token included) over every verification of every prompt, and the
    # histogram counts exactly those lengths
    lengths = [n for row in result["per_prompt"]["speculative_cpu"] for n in row["stats"]["accept_lengths"]]
    hist = {int(k): v for k, v in result["methods"]["speculative_cpu"]["accept_histogram"].items()}
    assert lengths and sorted(lengths) == sorted(n for n, count in hist.items() for _ in range(count))
    assert all(n >= 1 for n in lengths)
    assert result["tau"] == sum(lengths) / len(lengths)
    steps = result["methods"]["speculative_cpu"]["ms_per_step"]
    assert steps["verify"] > 0 and steps["draft"] > 0
    # every bf16 divergence from plain greedy decoding is a near-tie or vanishes when replayed in float32
    div = result["greedy_divergences"]
    assert div["real_mismatch"] == 0, div["details"]
    assert len(div["details"]) == div["near_tie"] + div["float32_replay_match"]


def test_bench_reports_after_every_prompt(tmp_path):
    """A long run killed part-way keeps its measurements: the summary is handed out after each prompt."""
    target_dir = save_tiny_target(tmp_path / "target")
    from transformers import AutoModelForCausalLM

    from inference.bench import build_parser, run_bench

    save_head(tiny_head(AutoModelForCausalLM.from_pretrained(target_dir), draft_vocab_size=200), tmp_path / "h")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": w}) + "\n" for w in ["a b", "c d e", "f"]))
    args = build_parser().parse_args(["--target", str(target_dir), "--draft", str(tmp_path / "h"), "--prompts",
                                      str(tmp_path / "p.jsonl"), "--max-new-tokens", "8", "--tree", "chain",
                                      "--compare-tree", "--no-pld", "--compile", "off", "--threads", "1"])
    partial = []
    run_bench(args, on_prompt=partial.append)
    assert [r["prompts"] for r in partial] == [1, 2, 3]
    assert all(len(r["per_prompt"]["engine_plain"]) == r["prompts"] for r in partial)


def test_bench_measures_every_drafter_in_one_run(tmp_path):
    """--methods: head tree, engine prompt lookup, hybrid and a draft model side by side, fp32 greedy-identical."""
    from transformers import AutoModelForCausalLM

    from inference.bench import build_parser, run_bench

    target_dir = save_tiny_target(tmp_path / "target")
    small_dir = save_tiny_target(tmp_path / "small", seed=3)
    save_head(tiny_head(AutoModelForCausalLM.from_pretrained(target_dir), draft_vocab_size=200), tmp_path / "h")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": w}) + "\n" for w in ["a b a b a", "c d e c d"]))
    args = build_parser().parse_args([
        "--target", str(target_dir), "--draft", str(tmp_path / "h"), "--draft-model", str(small_dir),
        "--methods", "engine_plain,speculative,engine_prompt_lookup,hybrid,draft_model", "--prompts",
        str(tmp_path / "p.jsonl"), "--max-new-tokens", "16", "--tree", "chain", "--dtype", "float32",
        "--compile", "off", "--threads", "1", "--gamma", "3", "--hybrid-tokens", "4"])
    result = run_bench(args)
    assert list(result["tokens_per_s"]) == ["plain", "engine_plain", "speculative_chain", "engine_prompt_lookup",
                                            "hybrid", "draft_model"]
    assert result["greedy_match"] == 1.0 and result["main_method"] == "speculative_chain"
    assert result["best_single_drafter"] in ("speculative_chain", "engine_prompt_lookup")
    assert result["hybrid_vs_best_single"] == pytest.approx(
        result["tokens_per_s"]["hybrid"] / result["tokens_per_s"][result["best_single_drafter"]])
    hybrid = result["methods"]["hybrid"]
    assert set(hybrid["acceptance_by_drafter"]) == {"head", "prompt_lookup"}
    assert all(0 <= v <= 1 for v in hybrid["acceptance_by_drafter"].values())
    assert max(int(k) for k in result["methods"]["draft_model"]["accept_histogram"]) <= 4  # gamma 3 + bonus


@pytest.mark.slow
def test_bench_measures_the_library_defaults_beside_its_own_methods(tmp_path, monkeypatch):
    """--methods api_default: SpeculativeGenerator.from_pretrained(target, head) with no other argument (the tree
    tuned, compiled and cached under DRAFTHEAD_CACHE), interleaved with the others and greedy-identical to generate
    where the defaults' dtype is the bench's float32 (bf16 outputs may differ at near-ties). The tuner's search is
    stubbed with a small tree (it is tested in test_inference_defaults.py and test_budget.py; here it would compile
    every trial shape), and so is the compile the defaults choose for a tuned tree (compiled steps are the subject
    of test_static_runner.py); the generator they configure runs for real."""
    from transformers import AutoModelForCausalLM

    from inference import engine
    from inference.bench import build_parser, run_bench
    from inference.tree import TreeOptions

    monkeypatch.setenv("DRAFTHEAD_CACHE", str(tmp_path / "cache"))
    calls = []
    stub_tree_search(monkeypatch, TreeOptions(2, 2, 3), calls)
    monkeypatch.setattr(engine, "compile_setting", lambda compile, device, tuned=False: False)
    target_dir = save_tiny_target(tmp_path / "target")
    save_head(tiny_head(AutoModelForCausalLM.from_pretrained(target_dir), draft_vocab_size=200), tmp_path / "h")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": w}) + "\n" for w in ["a b a b a", "c d e"]))
    args = build_parser().parse_args([
        "--target", str(target_dir), "--draft", str(tmp_path / "h"), "--methods", "speculative,api_default",
        "--prompts", str(tmp_path / "p.jsonl"), "--max-new-tokens", "12", "--tree", "chain", "--dtype", "float32",
        "--compile", "off", "--threads", "1", "--no-pld"])
    result = run_bench(args)
    assert list(result["tokens_per_s"]) == ["plain", "speculative_chain", "api_default"]
    api_rows = result["per_prompt"]["api_default"]
    assert len(api_rows) == 2
    if auto_dtype("cpu") == torch.float32:
        assert all(row["greedy_match"] for row in api_rows)
    assert len(calls) == 1 and list((tmp_path / "cache" / "tuning").glob("tree-*.json"))  # tuned once, and cached


def test_auto_lookup_branch_makes_the_speculative_method_hybrid(tmp_path):
    """When --tree auto kept the prompt-lookup branch, the main speculative method drafts with it (a hybrid
    drafter with --hybrid-tokens, or the fewer tokens the tuner measured) and tree_alone is the same tree without
    it; otherwise tree_alone is not run."""
    from transformers import AutoModelForCausalLM

    from inference.bench import build_methods, build_parser
    from inference.drafters.eagle import HeadDrafter
    from inference.drafters.lookup import LookupBranch
    from inference.runners.static import StaticRunner
    from inference.tree import TreeOptions

    target_dir = save_tiny_target(tmp_path / "target")
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    head = tiny_head(model, draft_vocab_size=200).attach_target(model)
    args = build_parser().parse_args(["--target", str(target_dir), "--draft", "unused", "--no-pld", "--compile", "off",
                                      "--methods", "engine_plain,speculative,tree_alone", "--hybrid-tokens", "5"])
    runner = StaticRunner(model, head.config.aux_layer_ids)
    tree = TreeOptions(depth=2, top_k=2, total_tokens=3)
    kept = build_methods(args, model, head, None, None, runner, tree, {"lookup_branch": True})
    assert [m.name for m in kept] == ["plain", "engine_plain", "speculative_auto", "tree_alone"]
    main, alone = kept[2].generator.drafter, kept[3].generator.drafter
    assert isinstance(main, LookupBranch) and main.tokens == 5 and main.drafter.opt == tree
    assert isinstance(alone, HeadDrafter) and alone.opt == tree
    capped = build_methods(args, model, head, None, None, runner, tree, {"lookup_branch": True, "lookup_tokens": 3})
    assert capped[2].generator.drafter.tokens == 3  # what the tuner measured, beside the tree
    dropped = build_methods(args, model, head, None, None, runner, tree, {"lookup_branch": False})
    assert [m.name for m in dropped] == ["plain", "engine_plain", "speculative_auto"]
    assert isinstance(dropped[2].generator.drafter, HeadDrafter)
