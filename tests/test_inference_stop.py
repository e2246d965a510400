"""Stop conditions landing inside an accepted path end exactly where plain greedy decoding ends."""

from __future__ import annotations

import torch
from test_inference_greedy import near_bigram_target, oracle_head, prompts
from tiny import tiny_tokenizer
from transformers import GenerationConfig, TextIteratorStreamer

from inference import SpeculativeGenerator

torch.set_num_threads(1)
MAX_NEW = 30


def setup(runner: str, vocab_size: int = 320, tokenizer=None):
    target = near_bigram_target("llama", vocab_size=vocab_size)
    gen = SpeculativeGenerator(target, oracle_head(target).attach_target(target), tokenizer=tokenizer,
                               tree="cpu", runner=runner)
    return target, gen


def cut_inside(stats) -> bool:
    """True when generation ended before the end of the last accepted path (prefill emits one token)."""
    return stats.new_tokens < 1 + sum(stats.accept_lengths)


def test_max_new_tokens_inside_path(runner):
    target, gen = setup(runner)
    ids = prompts(1, 320, seed=3)[0]
    inside = 0
    for n in range(1, 16):
        ref = target.generate(ids, do_sample=False, max_new_tokens=n, eos_token_id=None)
        out = gen.generate(ids, max_new_tokens=n, eos_token_id=[])
        assert torch.equal(out.sequences, ref) and out.stats.new_tokens == n
        inside += cut_inside(out.stats)
    assert inside > 0


def test_eos_inside_path(runner):
    target, gen = setup(runner)
    inside = 0
    for ids in prompts(4, 320, seed=4):
        free = target.generate(ids, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None)[0, ids.shape[1]:]
        for j in range(1, MAX_NEW, 3):
            eos = int(free[j])
            ref = target.generate(ids, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos)
            out = gen.generate(ids, max_new_tokens=MAX_NEW, eos_token_id=eos)
            assert torch.equal(out.sequences, ref), (ids.tolist(), eos)
            assert int(out.sequences[0, -1]) == eos
            inside += cut_inside(out.stats)
            # several eos ids, as a list
            out2 = gen.generate(ids, max_new_tokens=MAX_NEW, eos_token_id=[eos, 10_000])
            assert torch.equal(out2.sequences, ref)
    assert inside > 0


def test_stop_strings_inside_path(runner):
    tok = tiny_tokenizer()
    target, gen = setup(runner, vocab_size=len(tok))
    inside = checked = 0
    for ids in prompts(4, len(tok), seed=5):
        prompt_len = ids.shape[1]
        free = target.generate(ids, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None)[0, prompt_len:]
        free = free.tolist()
        for j in range(2, MAX_NEW, 4):
            piece = tok.decode(free[j : j + 2])
            stop = piece[1:4] if len(piece) > 3 else piece
            if not stop.strip() or "\ufffd" in stop:
                continue
            end = next(k for k in range(1, MAX_NEW + 1) if stop in tok.decode(free[:k]))  # plain decoding's stop
            out = gen.generate(ids, max_new_tokens=MAX_NEW, eos_token_id=[], stop_strings=[stop, "never-there"],
                               tokenizer=tok)
            assert out.sequences[0, prompt_len:].tolist() == free[:end], (stop, end)
            inside += cut_inside(out.stats)
            checked += 1
    assert checked >= 5 and inside > 0


def test_streamer_and_generation_config(runner):
    tok = tiny_tokenizer()
    target, gen = setup(runner, vocab_size=len(tok))
    ids = prompts(1, len(tok), seed=6)[0]
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    out = gen.generate(ids, generation_config=GenerationConfig(max_new_tokens=17, do_sample=False),
                       eos_token_id=[], tokenizer=tok, streamer=streamer)
    assert out.sequences.shape == (1, ids.shape[1] + 17)
    assert "".join(streamer) == tok.decode(out.sequences[0, ids.shape[1]:])
    ref = target.generate(ids, do_sample=False, max_new_tokens=17, eos_token_id=None)
    assert torch.equal(out.sequences, ref)


def test_tokenizer_output_is_taken_as_input(runner):
    """A tokenizer's BatchEncoding (what apply_chat_template(..., return_tensors="pt") returns in transformers 5)
    is read for its input_ids and attention_mask: the same output as the tensor itself."""
    from transformers import BatchEncoding

    target, gen = setup(runner)
    ids = prompts(1, 320, seed=7)[0]
    encoded = BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    out = gen.generate(encoded, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(out.sequences, gen.generate(ids, max_new_tokens=12, eos_token_id=[]).sequences)
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None))
