"""The real SmolLM2-135M-Instruct target (fp32) with an untrained head: output == plain greedy decoding."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drafthead import DraftHead, HeadConfig, save_head
from inference import SpeculativeGenerator

torch.set_num_threads(1)
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def greedy(smollm2):
    """Plain greedy decoding of the fp32 target, computed once per prompt and length for the whole module."""
    done = {}

    def reference(ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        key = (tuple(ids[0].tolist()), max_new_tokens)
        if key not in done:
            done[key] = smollm2.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        return done[key]

    return reference


@pytest.fixture(scope="module")
def head_dir(smollm2, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.from_target_config(smollm2.config, draft_vocab_size=4096))  # d2t = identity
    path = tmp_path_factory.mktemp("head")
    save_head(head, path)
    return path


@pytest.mark.real
def test_smollm2_greedy_lossless(smollm2, smollm2_path, head_dir, greedy, runner):
    gen = SpeculativeGenerator.from_pretrained(smollm2, head_dir, tree="cpu", runner=runner)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        ref = greedy(ids, 32)
        out = gen.generate(ids, max_new_tokens=32)
        assert torch.equal(out.sequences, ref), (prompt, tok.decode(out.sequences[0]), tok.decode(ref[0]))
        assert out.stats.target_forwards >= 2 and out.stats.new_tokens == ref.shape[1] - ids.shape[1]


@pytest.mark.real
def test_cli_streams(smollm2_path, head_dir):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "inference.generate", "--target", str(smollm2_path), "--draft", str(head_dir),
           "--prompt", "Say hello.", "--chat", "--max-new-tokens", "12", "--dtype", "float32", "--threads", "1",
           "--tree", "cpu"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, run.stderr[-2000:]
    stats = re.search(r"\[tau (\d+\.\d\d) \| (\d+) tokens in .* tok/s \| target forwards (\d+) \|", run.stderr)
    assert stats, run.stderr[-2000:]
    # the CLI streams and reports what the library computes for the same request
    gen = SpeculativeGenerator.from_pretrained(str(smollm2_path), head_dir, dtype="float32", tree="cpu")
    ids = gen.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    out = gen.generate(ids, max_new_tokens=12)
    text = gen.tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    assert run.stdout.strip() == text.strip()
    assert stats.groups() == (f"{out.stats.mean_accepted:.2f}", str(out.stats.new_tokens),
                              str(out.stats.target_forwards))



def shallow_copy_of(model, layers: int):
    """A real smaller draft model sharing the target's tokenizer: its first `layers` decoder layers, its embedding,
    final norm and lm_head."""
    import copy

    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:layers]
    return draft


@pytest.mark.real
@pytest.mark.parametrize("drafter", ["prompt_lookup", "hybrid", "draft_model"])
def test_smollm2_every_drafter_greedy_lossless(smollm2, smollm2_path, head_dir, greedy, drafter):
    """Each drafter on the real target through the static runner, the one decoding uses (each drafter on the eager
    runner: the tiny-model tests of test_drafters.py; the real target on the eager runner: the head's test above)."""
    from transformers import AutoTokenizer

    from inference.drafters.draft_model import DraftModelDrafter

    runner = "static"

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    if drafter == "prompt_lookup":
        gen = SpeculativeGenerator.from_pretrained(smollm2, "prompt-lookup", runner=runner)
    elif drafter == "hybrid":
        gen = SpeculativeGenerator.from_pretrained(smollm2, head_dir, tree="cpu", runner=runner, hybrid=True)
    else:
        draft = DraftModelDrafter(shallow_copy_of(smollm2, 8), smollm2.config.vocab_size, gamma=3, runner=runner)
        gen = SpeculativeGenerator(smollm2, draft, tok, runner=runner)
    accepted = 0
    for prompt in PROMPTS + ["Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox"]:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        ref = greedy(ids, 32)
        out = gen.generate(ids, max_new_tokens=32)
        assert torch.equal(out.sequences, ref), (drafter, prompt, tok.decode(out.sequences[0]), tok.decode(ref[0]))
        accepted += sum(n - 1 for n in out.stats.accept_lengths)
    assert accepted > 0  # drafts were accepted, so multi-token paths and the drafter's bookkeeping were exercised


@pytest.mark.real
def test_smollm2_batch_greedy_lossless(smollm2, smollm2_path, head_dir):
    """fp32, 4 chat prompts of different lengths in one left-padded batch: plain batched decoding, head trees (full
    and windowed KV), StreamingLLM self-speculation (drafting with its own weights, and with int8 copies, also
    with the prompt-lookup branch), prompt lookup alone and a draft model each give every row exactly its own
    greedy output."""
    from test_batch import left_padded
    from transformers import AutoTokenizer

    from inference.drafters.draft_model import DraftModelDrafter
    from inference.drafters.lookup import prompt_lookup
    from inference.drafters.self_draft import StreamingSelfDrafter

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = PROMPTS + ["Explain in one sentence why the sky is blue, for a child who is five years old."]
    rows = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)["input_ids"] for p in prompts]
    assert len({r.shape[1] for r in rows}) > 1
    refs = [smollm2.generate(r, do_sample=False, max_new_tokens=24)[0, r.shape[1]:].tolist() for r in rows]
    ids, mask = left_padded(rows, pad=tok.pad_token_id or 0)
    gens = {"plain": SpeculativeGenerator(smollm2, None, tree="none"),
            "self": SpeculativeGenerator(smollm2, StreamingSelfDrafter(smollm2, sink=4, window=16, gamma=3)),
            "self_int8": SpeculativeGenerator(smollm2, StreamingSelfDrafter(smollm2, sink=4, window=16, gamma=3,
                                                                            weights="int8")),
            "self_int8_lookup": SpeculativeGenerator(
                smollm2, StreamingSelfDrafter(smollm2, sink=4, window=16, gamma=3, weights="int8"), hybrid=True,
                lookup_tokens=4, lookup_nodes=1),
            "lookup": SpeculativeGenerator(smollm2, prompt_lookup(4)),
            "draft_model": SpeculativeGenerator(smollm2, DraftModelDrafter(shallow_copy_of(smollm2, 8),
                                                                           smollm2.config.vocab_size, gamma=3))}
    for kv in ("full", "streaming"):
        gens[f"head_{kv}"] = SpeculativeGenerator.from_pretrained(smollm2, head_dir, tree="4,4,8", draft_kv=kv,
                                                                  window=16)
    outs = {name: gen.generate(ids, attention_mask=mask, max_new_tokens=24) for name, gen in gens.items()}
    for name, out in outs.items():
        for i, ref in enumerate(refs):
            n = out.stats.rows_new_tokens[i]
            assert out.sequences[i, ids.shape[1]: ids.shape[1] + n].tolist() == ref, (name, i)
    for name in ("self", "self_int8"):
        assert outs[name].stats.mean_accepted > 1.5, name
