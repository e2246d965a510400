"""Assistant loss masks derived from rendered chat templates: ChatML, Llama-3 style, Qwen2 style, real SmolLM2."""

from __future__ import annotations

import pytest

from tiny import tiny_tokenizer
from train.loss_mask import assistant_spans, tokenize_with_mask

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen2-style: a default system prompt when the conversation has none (fails on an empty message list, like Qwen2.5)
QWEN2_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CONVERSATION = [
    {"role": "user", "content": "hello world, the quick brown fox"},
    {"role": "assistant", "content": "jumps over the lazy dog."},
    {"role": "user", "content": "user assistant system"},
    {"role": "assistant", "content": "the assistant\nsays hello"},  # its content contains a role name
    {"role": "user", "content": "bye"},
    {"role": "assistant", "content": ""},  # an empty reply: only its end-of-turn token is learned
]


def chatml():
    return tiny_tokenizer()


def llama3():
    tok = tiny_tokenizer()
    tok.add_special_tokens({"bos_token": "<|begin_of_text|>",
                            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def qwen2():
    tok = tiny_tokenizer()
    tok.chat_template = QWEN2_TEMPLATE
    return tok


def masked_text(tok, messages) -> str:
    ids, mask = tokenize_with_mask(tok, messages)
    assert len(ids) == len(mask)
    return tok.decode([i for i, m in zip(ids, mask) if m])


@pytest.mark.parametrize("make, eot", [(chatml, "<|im_end|>"), (llama3, "<|eot_id|>"), (qwen2, "<|im_end|>")])
@pytest.mark.parametrize("system", [False, True])
def test_mask_is_exactly_the_assistant_text_plus_end_of_turn(make, eot, system):
    tok = make()
    messages = ([{"role": "system", "content": "be brief"}] if system else []) + CONVERSATION
    expected = "".join(m["content"] + eot for m in messages if m["role"] == "assistant")
    assert masked_text(tok, messages) == expected
    # the tokens right after each end-of-turn (template newline / next header) are not masked
    ids, mask = tokenize_with_mask(tok, messages)
    eot_id = tok.convert_tokens_to_ids(eot)
    for j, (i, m) in enumerate(zip(ids, mask)):
        if m and i == eot_id and j + 1 < len(ids):
            assert not mask[j + 1]
    assert mask[-1] == (ids[-1] == eot_id)


def test_template_differences_are_handled_by_rendering():
    # the Qwen2-style template injects a system prompt: same messages, different prefixes, same masked text
    a, b = tokenize_with_mask(chatml(), CONVERSATION), tokenize_with_mask(qwen2(), CONVERSATION)
    assert len(a[0]) < len(b[0])
    assert sum(a[1]) == sum(b[1])


def test_spans_point_at_the_rendered_text():
    tok = llama3()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  hello world  "}]
    text = tok.apply_chat_template(messages, tokenize=False)
    (start, end), = assistant_spans(tok, messages, text)
    assert text[start:end] == "hello world<|eot_id|>"  # the template trims the content: the mask follows it


def test_no_assistant_turn_gives_no_mask():
    ids, mask = tokenize_with_mask(chatml(), [{"role": "user", "content": "hello"}])
    assert ids and not any(mask)


@pytest.mark.real
def test_real_smollm2_tokenizer(smollm2_path):
    from train.target import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    for messages in (CONVERSATION, [{"role": "system", "content": "You answer in French."}] + CONVERSATION[:4]):
        expected = "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")
        assert masked_text(tok, messages) == expected
    ids, _ = tokenize_with_mask(tok, CONVERSATION)
    assert ids == tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]


@pytest.mark.parametrize("make", [chatml, qwen2])
def test_conversation_opening_with_the_assistant(make):
    # messages[:0] is empty: Qwen2-style cannot render it at all, so the span is located inside the rendered turn
    messages = [{"role": "assistant", "content": "hello"}] + CONVERSATION
    expected = "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")
    assert masked_text(make(), messages) == expected
