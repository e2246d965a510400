"""The real SmolLM2-135M-Instruct target with a TRAINED head on 5 MT-bench prompts: lossless in fp32, and in bf16
every divergence from plain greedy decoding is an exact near-tie of the target's top-2 logits.

The head is trained by the real trainer (`python -m train`) on the target's own greedy answers to those prompts,
so it predicts them well: most verifications accept several tokens, deep into the tree. That exercises the
paths an untrained head never reaches (multi-token acceptance, cache compaction after long paths, the bonus token
after a fully accepted branch), which is where a speculative engine's bugs live.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_trainer import REPO, env

from inference import SpeculativeGenerator

NEW_TOKENS = 48
# bf16 runs ~8x slower than float32 on an AVX2-only CPU: three prompts and 32 tokens still reach deep accepts
BF16_PROMPTS, BF16_NEW_TOKENS = 3, 32


@pytest.fixture(scope="module")
def prompts(smollm2_path, mt_bench_path) -> list[torch.Tensor]:
    """The first 5 MT-bench first turns in the target's chat template, as the benchmark builds them."""
    from transformers import AutoTokenizer

    from inference.bench import chat_ids, load_prompts

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    return [chat_ids(tokenizer, p, torch.device("cpu")) for p in load_prompts(str(mt_bench_path), 5)]


@pytest.fixture(scope="module")
def references(smollm2, prompts) -> list[torch.Tensor]:
    """Plain greedy decoding of the fp32 target: (1, prompt + NEW_TOKENS) each."""
    return [smollm2.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS) for ids in prompts]


@pytest.fixture(scope="module")
def trained_head(smollm2, smollm2_path, prompts, references, tmp_path_factory) -> Path:
    """Features of prompt + greedy answer (loss on the answer only), then the real trainer, 1 process, fp32."""
    from drafthead.capture import decoder_layers
    from drafthead.config import default_aux_layer_ids
    from train.collect import forward_features
    from train.features import FeatureWriter, Sequence
    from train.target import target_config_hash

    tmp = tmp_path_factory.mktemp("trained_head")
    layers = len(decoder_layers(smollm2))
    aux = default_aux_layer_ids(layers)
    writer = FeatureWriter(tmp / "features", {"target": smollm2_path.name, "aux_layer_ids": aux,
                                              "target_config_hash": target_config_hash(smollm2_path),
                                              "shard_sequences": 5, "num_sequences_planned": 5})
    sequences = []
    with torch.inference_mode():
        for ids, ref in zip(prompts, references):
            (aux_h, last_h), = forward_features(smollm2, [ref[0].tolist()], aux, layers - 1, torch.device("cpu"))
            mask = torch.zeros(ref.shape[1], dtype=torch.bool)
            mask[ids.shape[1]:] = True
            sequences.append(Sequence(ref[0].to(torch.int32), mask, aux_h, last_h))
    writer.write_shard(0, sequences)
    recipe = {
        "target": str(smollm2_path), "dtype": "float32", "features": {"dir": str(tmp / "features")},
        "head": {"kind": "eagle3", "draft_vocab_size": 1024, "aux_layer_ids": aux},
        "train": {"output_dir": str(tmp / "out"), "max_steps": 30, "save_every": 30, "eval_every": 1000,
                  "batch_size": 5, "grad_accum": 1, "lr": 3e-3, "warmup_steps": 3, "max_grad_norm": 1.0,
                  "ttt_steps": 3, "mixed_precision": "fp32", "max_length": 256, "online": False, "seed": 0,
                  # the same head, sooner: compiling the loss costs more than it saves in 30 steps, and a loader
                  # worker process more than it saves on 5 sequences (41 s against 57 for the run, one core)
                  "compile_loss": False, "num_workers": 0},
    }
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    proc = subprocess.run([sys.executable, "-m", "train", str(tmp / "recipe.yaml")], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return tmp / "out" / "final"


@pytest.mark.real
# every tree shape on the static runner (the one decoding uses); the eager reference runner with the default tree
@pytest.mark.parametrize("tree,runner", [("chain", "static"), ("cpu", "static"), ("gpu", "static"), ("cpu", "eager")])
def test_trained_head_fp32_lossless(smollm2, trained_head, prompts, references, tree, runner):
    gen = SpeculativeGenerator.from_pretrained(smollm2, trained_head, tree=tree, runner=runner)
    lengths = []
    for ids, ref in zip(prompts, references):
        out = gen.generate(ids, max_new_tokens=NEW_TOKENS)
        assert torch.equal(out.sequences, ref), (tree, out.sequences[0, ids.shape[1]:], ref[0, ids.shape[1]:])
        lengths += out.stats.accept_lengths
    tau = sum(lengths) / len(lengths)
    # the head really drafts: most steps accept several tokens (an untrained head gives tau = 1)
    assert tau > 2.5 and max(lengths) >= 4, (tree, tau, lengths)


@pytest.fixture(scope="module")
def bf16_references(smollm2_path, prompts):
    """The bf16 target and its plain greedy decoding of the prompts, computed once for both runners (bf16 is the
    slow dtype on an AVX2-only CPU)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.bfloat16).eval()
    return target, [target.generate(ids, do_sample=False, max_new_tokens=BF16_NEW_TOKENS)
                    for ids in prompts[:BF16_PROMPTS]]


@pytest.mark.real
def test_trained_head_bf16_divergences_are_near_ties(smollm2, bf16_references, trained_head, prompts, runner):
    """bf16: a tree forward and a one-token forward round differently; outputs may part only at near-ties
    (judged against the float32 target, inference.bench.ties)."""
    from inference.bench.ties import explain_divergence

    target, references = bf16_references
    gen = SpeculativeGenerator.from_pretrained(target, trained_head, tree="cpu", runner=runner)
    matches, lengths = 0, []
    for ids, ref in zip(prompts, references):
        out = gen.generate(ids, max_new_tokens=BF16_NEW_TOKENS)
        lengths += out.stats.accept_lengths
        if torch.equal(out.sequences, ref):
            matches += 1
            continue
        div = explain_divergence(target, out.sequences, ref, reference=smollm2)
        assert div is not None and div.is_near_tie, f"real bf16 mismatch (not a near-tie): {div}"
    print(f"bf16 greedy match {matches}/{len(references)}, tau {sum(lengths) / len(lengths):.2f}")
    assert sum(lengths) / len(lengths) > 2.0  # the trained head is exercised in bf16 too
