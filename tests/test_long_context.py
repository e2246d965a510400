"""Long-context prompts from real ShareGPT text: exact token lengths, distinct, ending in the generation prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.bench.long_context import INSTRUCTIONS, long_documents, long_prompts


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def generation_prompt_ids(tok) -> list[int]:
    """The tokens the chat template appends for add_generation_prompt=True (e.g. "<|im_start|>assistant\\n")."""
    messages = [{"role": "user", "content": "hi"}]
    with_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    without = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert with_prompt.startswith(without)
    return tok(with_prompt[len(without):], add_special_tokens=False).input_ids


@pytest.mark.real
@pytest.mark.parametrize("context", [2048, 8192])
def test_long_prompts_exact_distinct(smollm2_tokenizer, sharegpt_path, context):
    tok = smollm2_tokenizer
    prompts = long_prompts(tok, context, 4, path=sharegpt_path)
    assert len(prompts) == 4
    assert all(len(p) == context for p in prompts)
    assert len({tuple(p) for p in prompts}) == 4
    tail = generation_prompt_ids(tok)
    for p in prompts:
        assert p[-len(tail):] == tail
        assert INSTRUCTIONS["continue"] in tok.decode(p[-64:])
    assert long_prompts(tok, context, 4, path=sharegpt_path) == prompts  # deterministic


@pytest.mark.real
def test_summarise_task(smollm2_tokenizer, sharegpt_path):
    prompts = long_prompts(smollm2_tokenizer, 2048, 2, path=sharegpt_path, task="summarise")
    assert [len(p) for p in prompts] == [2048, 2048]
    assert INSTRUCTIONS["summarise"] in smollm2_tokenizer.decode(prompts[0][-64:])
    with pytest.raises(ValueError, match="task"):
        long_prompts(smollm2_tokenizer, 2048, 1, path=sharegpt_path, task="translate")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def conversation(text: str) -> dict:
    return {"id": text[:8], "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]}


def test_malformed_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [conversation("a" * 50), "", '{"id": "x", "conversations": [}'])
    with pytest.raises(ValueError, match=rf"{path.name}:3"):
        long_documents(path, min_chars=10)
    path = write_jsonl(tmp_path / "shape.jsonl", [conversation("a" * 50), {"id": "y"}])
    with pytest.raises(ValueError, match=rf"{path.name}:2"):
        long_documents(path, min_chars=10)


def test_documents_joined_distinct_and_ordered(tmp_path):
    rows = [conversation("x" * 500), conversation("short"), conversation("b" * 100), conversation("c" * 100),
            conversation("x" * 500), conversation("d" * 900)]
    docs = long_documents(write_jsonl(tmp_path / "c.jsonl", rows), min_chars=200)
    assert docs[0].startswith("User: " + "d" * 900) and docs[1].startswith("User: " + "x" * 500)  # longest first
    assert len(docs) == 3 and len(set(docs)) == 3  # the repeated conversation is used once
    assert "b" * 100 in docs[2] and "c" * 100 in docs[2] and "short" not in docs[2]  # short ones joined in order
    assert long_documents(tmp_path / "c.jsonl", min_chars=200, limit=1) == docs[:1]
