"""The real offline assets: SmolLM2-135M-Instruct (Q4_1, dequantized) loads, tokenizes and generates English."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, cache_dir

pytestmark = pytest.mark.real

COMMON_WORDS = {"the", "a", "and", "to", "of", "in", "is", "you", "for", "with", "your", "that", "on", "as", "are",
                "it", "this", "be", "i", "we", "an", "or", "from", "at", "by", "my", "our", "can"}


def test_smollm2_config(smollm2_path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(smollm2_path)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert json.loads((smollm2_path / "config.json").read_text())["rope_theta"] == 100000.0


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "  two leading spaces\nand a newline\ttab", "def f(x):\n    return x ** 2  # code",
     "Ünïcödé — “quotes”, emoji 🚀 and 中文", "The quick brown fox. 1234567890"],
)
def test_tokenizer_round_trip(smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert smollm2_tokenizer.decode(ids) == text


def test_chat_template_has_no_extra_bos(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and ids[1] != im_start  # one <|im_start|>, no extra BOS in front
    assert ids == tok(text, add_special_tokens=False).input_ids == tok(text).input_ids


@torch.no_grad()
def test_greedy_generation_is_english(smollm2, smollm2_tokenizer, mt_bench_path):
    tok = smollm2_tokenizer
    question = json.loads(mt_bench_path.read_text().splitlines()[0])["turns"][0]  # Hawaii travel blog
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
    out = smollm2.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tok.eos_token_id)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    words = [w.strip(".,!?:;\"'()").lower() for w in answer.split()]
    assert len(words) >= 15, answer
    assert len(COMMON_WORDS.intersection(words)) >= 4, answer
    assert "\ufffd" not in answer
    topical = {"hawaii", "hawaiian", "oahu", "maui", "kauai", "honolulu", "island", "aloha"}
    assert topical.intersection(words), answer  # it answers the question asked


def test_fetch_assets_second_run_is_fast():
    env = dict(os.environ, DRAFTHEAD_CACHE=str(cache_dir()))
    start = time.perf_counter()
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "fetch_assets.py")], capture_output=True,
                         text=True, env=env, timeout=60)
    elapsed = time.perf_counter() - start
    assert run.returncode == 0, run.stderr
    assert "fetching" not in run.stdout  # nothing was downloaded again
    assert elapsed < 2.0, f"second fetch took {elapsed:.1f} s"
