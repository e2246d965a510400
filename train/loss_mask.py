"""Assistant-only loss masks derived by rendering the tokenizer's own chat template.

For assistant message i, the template is rendered for the prefix messages[:i] (with the generation prompt:
where the assistant starts writing) and for messages[:i+1] (where its turn ends). The assistant's characters
are its content plus the first special token after it (the end-of-turn token: <|im_end|>, <|eot_id|>, ...);
the template's role header and anything after the end-of-turn token (e.g. a newline) are not. Characters are
mapped to tokens with the tokenizer's offset_mapping: a token is masked when it starts inside an assistant span.
No template-specific offsets anywhere.
"""

from __future__ import annotations

from typing import Any


class TemplateError(ValueError):
    """The chat template does not render a conversation prefix-consistently (spans cannot be derived)."""


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _special_texts(tokenizer: Any) -> list[str]:
    """Text of every special / added-special token (candidates for the end-of-turn token)."""
    texts = set(tokenizer.all_special_tokens)
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(token, "special", False):
            texts.add(str(token.content))
    return sorted((t for t in texts if t), key=len, reverse=True)


def assistant_spans(tokenizer: Any, messages: list[dict], text: str | None = None) -> list[tuple[int, int]]:
    """Character spans [start, end) of `text` (the full rendering) written by the assistant, end-of-turn included."""
    text = _render(tokenizer, messages) if text is None else text
    specials = _special_texts(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        turn = _render(tokenizer, messages[: i + 1])
        if not text.startswith(turn):
            raise TemplateError(f"rendering of the first {i + 1} messages is not a prefix of the whole conversation")
        turn_end = len(turn)
        try:
            opened = _render(tokenizer, messages[:i], generation_prompt=True)
        except Exception:  # some templates refuse an empty message list
            opened = ""
        content = message["content"]
        if opened and turn.startswith(opened):
            start = len(opened)  # the assistant starts writing right after its generation prompt
            body = content if turn.startswith(content, start) else content.strip()  # templates may trim
            if not turn.startswith(body, start):
                raise TemplateError(f"assistant message {i} is not rendered right after its generation prompt")
        else:  # the prefix renders differently (e.g. a default system prompt only once messages exist)
            body = content if content in turn else content.strip()
            start = turn.rfind(body) if body else -1
            if start < 0:
                raise TemplateError(f"assistant message {i} cannot be located in its rendered turn")
        content_end = start + len(body)
        suffix = text[content_end:turn_end]
        hits = [(suffix.find(s), s) for s in specials if s in suffix]
        end = content_end
        if hits:
            pos, special = min(hits, key=lambda h: (h[0], -len(h[1])))
            end = content_end + pos + len(special)
        spans.append((start, end))
    return spans


def tokenize_with_mask(tokenizer: Any, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and the assistant loss mask (one bool per token)."""
    text = _render(tokenizer, messages)
    spans = assistant_spans(tokenizer, messages, text)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = []
    k = 0  # spans and tokens are both in text order
    for tok_start, tok_end in enc["offset_mapping"]:
        while k < len(spans) and tok_start >= spans[k][1]:
            k += 1
        mask.append(k < len(spans) and spans[k][0] <= tok_start < spans[k][1] and tok_end > tok_start)
    return list(enc["input_ids"]), mask
