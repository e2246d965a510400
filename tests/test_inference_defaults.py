"""The library's defaults and names: tree="auto" tuned once and cached on disk, dtype "fast" / "auto" (the
checkpoint's, as in transformers), device "auto", Hugging Face's names (stop_strings, branching apart from
sampling's top_k) with the old ones deprecated, the CLI's device/dtype line, and the slow-speculation warning."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from conftest import save_tiny_target, stub_tree_search
from test_inference_greedy import near_bigram_target, oracle_head, prompts
from tiny import tiny_head, tiny_tokenizer

from drafthead import save_head
from drafthead.hardware import auto_dtype
from drafthead.utils import atomic_write_json
from inference import SpeculativeGenerator, TreeOptions
from inference import generate as cli
from inference.tuning import auto

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny target folder (with its ChatML tokenizer) and a head folder for it."""
    root = tmp_path_factory.mktemp("defaults")
    target = save_tiny_target(root / "target")
    from transformers import AutoModelForCausalLM

    save_head(tiny_head(AutoModelForCausalLM.from_pretrained(target)), root / "head")
    return target, root / "head"


@pytest.fixture
def tuning_cache(tmp_path, monkeypatch):
    """The cache folder of this test (the tuning is cached under it), and a count of the tunings run."""
    monkeypatch.setenv("DRAFTHEAD_CACHE", str(tmp_path))
    calls = []
    tune = auto.auto_tree
    monkeypatch.setattr(auto, "auto_tree", lambda *a, **k: calls.append(1) or tune(*a, **k))
    return tmp_path, calls


def test_tree_auto_tunes_once_then_reads_the_cache(folders, tuning_cache, capsys):
    """The first generator tunes (saying so first, with an estimate) and writes the choice atomically; the next
    one (another process would do the same) reads it back without tuning and decodes with the same tree."""
    target, head = folders
    cache, calls = tuning_cache
    first = SpeculativeGenerator.from_pretrained(target, head, tree="auto", hybrid=False, compile=False)
    assert "tuning the draft tree for this machine once (about" in capsys.readouterr().err
    files = list((cache / "tuning").iterdir())
    assert len(calls) == 1 and len(files) == 1 and files[0].suffix == ".json"  # no temporary file left
    saved = json.loads(files[0].read_text())
    assert saved["key"]["dtype"] == str(auto_dtype("cpu")).removeprefix("torch.") and saved["key"]["machine"] == auto.machine(torch.device("cpu"))
    assert first.tuned is not None and saved["plain_tokens_per_s"] > 0
    assert (first.options is None) == first.plain == (saved["tree"] == "none")
    if first.options is not None:
        assert dataclasses.asdict(first.options) == saved["tree"]
    second = SpeculativeGenerator.from_pretrained(target, head, tree="auto", hybrid=False, compile=False)
    assert len(calls) == 1 and "tuning" not in capsys.readouterr().err
    assert second.options == first.options and second.plain == first.plain
    # a short request decodes on buffers as large as the tuning's, whose compiled steps inductor has cached
    assert saved["capacity"] == first.runner.capacity > 0
    second.generate(prompts(1, 8, seed=2)[0], max_new_tokens=4)
    assert second.runner.capacity == saved["capacity"]
    ids = prompts(1, 200, seed=1)[0]
    assert torch.equal(second.generate(ids, max_new_tokens=8).sequences,
                       first.generate(ids, max_new_tokens=8).sequences)


def test_tree_auto_compiles_on_a_cpu_and_other_trees_do_not(folders, tuning_cache, monkeypatch, capsys):
    """compile="auto" (the default) is the fast path: the tuned tree compiles on a CPU too, the tuning says so in
    its estimate; a fixed tree stays uncompiled there unless asked. (The tuning is stubbed: compiling it is slow,
    and the tuning itself is tested above.)"""
    target, head = folders
    cache, calls = tuning_cache
    stub_tree_search(monkeypatch, TreeOptions(2, 2, 3), calls)
    tuned = SpeculativeGenerator.from_pretrained(target, head, device="cpu", hybrid=False)
    assert "compiling its steps" in capsys.readouterr().err
    assert len(calls) == 1 and tuned.compile and tuned.runner.compiled and tuned.options == TreeOptions(2, 2, 3)
    assert json.loads(next((cache / "tuning").iterdir()).read_text())["key"]["compile"] is True
    fixed = SpeculativeGenerator.from_pretrained(target, head, device="cpu", tree="cpu")
    assert not fixed.compile and not fixed.runner.compiled
    assert SpeculativeGenerator.from_pretrained(target, head, device="cpu", tree="cpu", compile=True).compile
    for gen in (tuned, fixed):
        gen.close()


def test_tree_auto_takes_prompt_lookup_alone_where_it_beat_plain_decoding(folders, tuning_cache, monkeypatch,
                                                                           capsys):
    """A tuning that chose no tree but prompt lookup alone (stubbed: the tuner's own test covers the choice) gives a
    generator that drafts by prompt lookup only, says so, and decodes what plain decoding does."""
    target, head = folders
    report = {"lookup_branch": {"tokens": 3, "chosen": True, "tokens_per_s": {"with_lookup": 12.0,
                                                                              "tree_alone": 10.0}},
              "predicted": {"tokens_per_s": 0.0}, "predicted_plain": {"tokens_per_s": 10.0}}
    monkeypatch.setattr(auto, "auto_tree", lambda *a, **k: (None, report))
    gen = SpeculativeGenerator.from_pretrained(target, head, dtype="float32", compile=False)
    assert "drafting by prompt lookup alone (up to 3 tokens" in capsys.readouterr().err
    assert gen.options is None and not gen.plain and gen.drafter.name == "prompt_lookup"
    assert gen.drafter.tokens == 3 and gen.tuned.tokens_per_s == 12.0
    plain = SpeculativeGenerator.from_pretrained(target, None, tree="none", dtype="float32", compile=False)
    ids = torch.cat([prompts(1, 200, seed=2)[0]] * 3, dim=1)  # repeats: the lookup finds matches
    assert torch.equal(gen.generate(ids, max_new_tokens=16).sequences, plain.generate(ids, max_new_tokens=16).sequences)


def test_the_cache_key_tells_targets_heads_dtypes_and_draft_weights_apart(folders):
    from transformers import AutoModelForCausalLM

    from drafthead import load_head
    from inference.runners import make_runner

    target, head_dir = folders
    model = AutoModelForCausalLM.from_pretrained(target)
    head = load_head(head_dir, target=model)
    runner = make_runner(model, head.config.aux_layer_ids)
    key = auto.cache_key(model, head, runner, False, 0, auto.QUICK)
    assert auto.cache_key(model, head, runner, False, 0, auto.QUICK) == key
    other_head = tiny_head(model, seed=5)
    assert auto.cache_key(model, other_head, runner, False, 0, auto.QUICK)["head"] != key["head"]
    assert auto.cache_key(model, head, runner, True, 0, auto.QUICK) != key
    assert auto.cache_key(model, head, runner, False, 0, auto.QUICK, draft_weights="int8") != key
    bf16 = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16)
    changed = auto.cache_key(bf16, head, runner, False, 0, auto.QUICK)
    assert changed["dtype"] == "bfloat16" and changed["target"] != key["target"]
    runner.close()


def test_a_damaged_cache_file_is_tuned_again(tmp_path):
    key = {"format": auto.FORMAT, "target": "x"}
    path = tmp_path / "tree.json"
    path.write_text('{"key": ')  # a writer killed half way (an atomic write never leaves one)
    assert auto.read_cached(path, key) is None
    atomic_write_json(path, {"key": key, "tree": {"depth": 2, "top_k": 3, "total_tokens": 4},
                             "lookup_tokens": 0, "plain_tokens_per_s": 10.0, "tokens_per_s": 12.0})
    assert auto.read_cached(path, key).tree == TreeOptions(2, 3, 4)
    assert auto.read_cached(path, {**key, "target": "y"}) is None
    assert [p.name for p in tmp_path.iterdir()] == ["tree.json"]


def test_tree_auto_without_a_tokenizer_takes_the_cpu_preset(capsys):
    target = near_bigram_target("llama", vocab_size=320)
    gen = SpeculativeGenerator(target, oracle_head(target).attach_target(target), tree="auto")
    assert "needs the target's tokenizer" in capsys.readouterr().err
    assert gen.options == TreeOptions(5, 8, 24) and gen.tuned is None


def test_dtype_fast_auto_and_device_auto(folders):
    """dtype "fast" (and the default for a checkpoint) is the hardware's; "auto" the checkpoint's, with a warning
    where the two differ; device "auto" is CUDA when present."""
    target, _ = folders
    default = SpeculativeGenerator.from_pretrained(target, None, tree="none")
    fast = SpeculativeGenerator.from_pretrained(target, None, tree="none", dtype="fast")
    ref = next(default.target.parameters())
    assert ref.dtype == auto_dtype(ref.device) == next(fast.target.parameters()).dtype
    assert ref.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    from transformers import AutoModelForCausalLM

    bf16 = target.parent / "target_bf16"
    AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).save_pretrained(bf16)
    tiny_tokenizer().save_pretrained(bf16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = SpeculativeGenerator.from_pretrained(bf16, None, tree="none", device="cpu", dtype="auto")
    assert next(kept.target.parameters()).dtype == torch.bfloat16
    changed = auto_dtype("cpu") != torch.bfloat16
    assert any(issubclass(w.category, FutureWarning) and "dtype='fast'" in str(w.message) for w in caught) == changed


def test_old_names_still_work_with_a_deprecation_warning(folders):
    target, head = folders
    with pytest.warns(DeprecationWarning, match="branching="):
        gen = SpeculativeGenerator.from_pretrained(target, head, tree="cpu", top_k=3)
    assert gen.options.top_k == 3
    assert SpeculativeGenerator.from_pretrained(target, head, tree="cpu", branching=2).options.top_k == 2
    tok = gen.tokenizer
    ids = tok("hello there", return_tensors="pt")["input_ids"]
    free = gen.generate(ids, max_new_tokens=12, eos_token_id=[]).sequences[0, ids.shape[1]:].tolist()
    stop = tok.decode(free[3:5])[:2]
    if not stop.strip():
        pytest.skip("no printable stop string in this generation")
    new = gen.generate(ids, max_new_tokens=12, eos_token_id=[], stop_strings=stop).sequences
    with pytest.warns(DeprecationWarning, match="stop_strings="):
        old = gen.generate(ids, max_new_tokens=12, eos_token_id=[], stop=[stop]).sequences
    assert torch.equal(new, old) and new.shape[1] - ids.shape[1] < 12 and stop in tok.decode(new[0, ids.shape[1]:])
    with pytest.raises(ValueError, match="stop_strings= only"):
        gen.generate(ids, stop=[stop], stop_strings=[stop])


def test_slower_than_plain_decoding_warns_once_when_no_step_shape_was_new(folders):
    target, head = folders
    gen = SpeculativeGenerator.from_pretrained(target, head, tree="2,2,3")
    gen.tuned = auto.TunedTree(gen.options, 0, plain_tokens_per_s=1e9, tokens_per_s=2e9)  # plain "measured" faster
    short = prompts(1, 200, seed=2)[0]
    long = torch.randint(3, 200, (1, 400), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # new step shapes (compiled or loaded in a compiled generator): not judged; the long prompt needs new buffers
        gen.generate(short, max_new_tokens=40, eos_token_id=[])
        gen.generate(long, max_new_tokens=40, eos_token_id=[])
    with pytest.warns(RuntimeWarning, match="below the .* plain decoding measured"):
        gen.generate(long, max_new_tokens=40, eos_token_id=[])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen.generate(long, max_new_tokens=40, eos_token_id=[])  # once a generator


def test_cli_prints_device_dtype_and_tree(folders, capsys):
    target, head = folders
    cli.main(["--target", str(target), "--draft", str(head), "--prompt", "hi", "--max-new-tokens", "4",
              "--tree", "chain", "--branching", "1"])
    err = capsys.readouterr().err
    dtype = str(auto_dtype("cpu")).removeprefix("torch.")
    # an instruct model's tokenizer has a chat template: the prompt goes through it without --chat
    assert f"[drafthead] cpu, {dtype}, eagle drafter, tree depth 5, branching 1, 5 tokens, prompt in the chat " \
           "template" in err
    cli.main(["--target", str(target), "--draft", str(head), "--prompt", "hi", "--max-new-tokens", "4",
              "--tree", "chain", "--no-chat"])
    assert "prompt as raw text" in capsys.readouterr().err
