"""Regenerate the assistant turns of a conversation set with the target's own responses.

    python -m train.regenerate configs/smollm2-135m-eagle3.yaml [data.regenerate.temperature=0.7 ...]

A draft head learns the target's distribution best from text the target itself wrote. Every assistant turn is
replaced, turn by turn, by the target's reply to the conversation so far (the user turns are kept); with
data.max_assistant_turns=1 only first turns are kept and regenerated. Generation runs on the decoding engine's batched
runner (inference.SpeculativeGenerator, plain decoding: static KV buffers, one forward per token for the whole
batch), left-padded, greedy (temperature 0) or sampled. Conversations are processed in order of prompt length
(less padding), in chunks; each finished chunk is written atomically to
<output>.chunks/chunk-NNNNN-of-MMMMM-<plan>.jsonl and skipped on re-run, and the chunks are joined (in the input's
order) into <output> (OpenAI `messages` JSONL, usable as data.conversations) when all are done.
A conversation stops at the first assistant turn whose prompt + max_new_tokens would exceed data.max_length.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from drafthead.utils import atomic_write_text
from train.conversations import read_conversations
from train.recipe import Recipe, RegenerateSection, parse_recipe, recipe_main
from train.target import load_target, load_tokenizer


def replier(model: Any, tokenizer: Any) -> Any:
    """The decoding engine's plain batched decoding of `model` (inference.SpeculativeGenerator, tree="none"):
    preallocated KV buffers written in place, every row in one forward per token, finished rows leave the batch.
    Greedy output equals transformers' generate token for token (fp32); it is several times cheaper per token."""
    from inference import SpeculativeGenerator  # the engine generates the data; inference never imports train

    return SpeculativeGenerator(model, None, tokenizer, tree="none")


@torch.inference_mode()
def generate_replies(engine: Any, tokenizer: Any, prompts: list[list[dict]], max_new_tokens: int,
                     temperature: float = 0.0, top_p: float = 1.0,
                     generator: torch.Generator | None = None) -> tuple[list[str], int]:
    """The target's replies to a batch of conversations (each ending with a user turn); also the new-token count.
    `engine`: replier(model, tokenizer)."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt").to(engine.device)
    sample = temperature > 0
    out = engine.generate(enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=max_new_tokens,
                          do_sample=sample, temperature=temperature if sample else None,
                          top_p=top_p if sample else None, generator=generator)
    width = enc["input_ids"].shape[1]
    lengths = out.stats.rows_new_tokens or [out.stats.new_tokens]  # a batch of one runs the single-row path
    new = [out.sequences[i, width: width + n] for i, n in enumerate(lengths)]
    replies = tokenizer.batch_decode(new, skip_special_tokens=True)
    return [r.strip() for r in replies], sum(lengths)


def regenerate_chunk(engine: Any, tokenizer: Any, conversations: list[dict], cfg: RegenerateSection,
                     max_length: int, bar: tqdm, generator: torch.Generator | None = None) -> list[dict]:
    """Replace every assistant turn of `conversations`, turn by turn across the chunk, in length-sorted batches."""
    done = [[] for _ in conversations]  # regenerated message lists so far
    cursor = [0] * len(conversations)  # index of the next original message to consume
    alive = set(range(len(conversations)))
    tokens, start = 0, time.perf_counter()
    while alive:
        waiting = []  # conversations whose next assistant turn must be generated now
        for c in sorted(alive):
            messages = conversations[c]["messages"]
            while cursor[c] < len(messages) and messages[cursor[c]]["role"] != "assistant":
                done[c].append(messages[cursor[c]])
                cursor[c] += 1
            if cursor[c] >= len(messages) or not done[c]:
                alive.discard(c)
                continue
            length = len(tokenizer.apply_chat_template(done[c], tokenize=True, add_generation_prompt=True,
                                                       return_dict=True)["input_ids"])
            if length + cfg.max_new_tokens > max_length:  # no room left for another reply
                alive.discard(c)
                continue
            waiting.append((length, c))
        waiting.sort()
        for b in range(0, len(waiting), cfg.batch_size):
            batch = [c for _, c in waiting[b : b + cfg.batch_size]]
            replies, n = generate_replies(engine, tokenizer, [done[c] for c in batch], cfg.max_new_tokens,
                                          cfg.temperature, cfg.top_p, generator)
            for c, reply in zip(batch, replies):
                done[c].append({"role": "assistant", "content": reply})
                cursor[c] += 1
            tokens += n
            bar.set_postfix(gen_tok_s=f"{tokens / (time.perf_counter() - start):.1f}")
    bar.update(len(conversations))
    return [{"id": conv["id"], "messages": msgs} for conv, msgs in zip(conversations, done)
            if any(m["role"] == "assistant" for m in msgs)]


def prompt_length(tokenizer: Any, conversation: dict) -> int:
    """Tokens of the prompt of a conversation's first assistant turn (0 when it has none)."""
    messages = conversation["messages"]
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), 0)
    if first == 0:
        return 0
    return len(tokenizer.apply_chat_template(messages[:first], tokenize=True, add_generation_prompt=True,
                                             return_dict=True)["input_ids"])


def regenerate(recipe: Recipe | dict) -> Path:
    """Run the regeneration described by recipe data.regenerate; returns the joined JSONL path.

    Conversations are processed in order of their first prompt's length, so that a batch's rows are about as long
    as each other: a batch is prefilled left-padded to its longest prompt, and a mixed batch spends up to half of
    its prefill on padding (ShareGPT first turns in file order, batches of 32: ~50 % in the longest batch). The
    joined output keeps the input's order. Chunk file names carry a hash of the plan (the conversations of each
    chunk and the generation settings): chunks of another plan are not reused."""
    recipe = parse_recipe(recipe)
    data_cfg, cfg = recipe.data, recipe.data.regenerate
    output = Path(cfg.output or Path(recipe.run_dir) / "regenerated.jsonl")
    chunks_dir = output.with_name(output.name + ".chunks")
    conversations = read_conversations(data_cfg.conversations, skip_bad=data_cfg.skip_bad,
                                       limit=data_cfg.max_conversations,
                                       max_assistant_turns=data_cfg.max_assistant_turns)
    tokenizer = load_tokenizer(recipe.target)
    lengths = [prompt_length(tokenizer, c) for c in tqdm(conversations, desc="prompt lengths", unit="conv",
                                                          disable=len(conversations) < 5000)]
    order = sorted(range(len(conversations)), key=lambda i: lengths[i])
    size = cfg.chunk_conversations
    chunks = [[conversations[i] for i in order[c : c + size]] for c in range(0, len(order), size)]
    plan = hashlib.sha256(json.dumps([[c["id"] for c in chunk] for chunk in chunks] + [
        dataclasses.asdict(cfg), data_cfg.max_length, Path(recipe.target).name]).encode()).hexdigest()[:10]
    paths = [chunks_dir / f"chunk-{i:05d}-of-{len(chunks):05d}-{plan}.jsonl" for i in range(len(chunks))]
    todo = [i for i, p in enumerate(paths) if not p.exists()]
    print(f"{len(conversations)} conversations, {len(chunks)} chunks, {len(chunks) - len(todo)} already done")
    if todo:
        engine = replier(load_target(recipe.target, device=recipe.device, dtype=recipe.dtype), tokenizer)
        bar = tqdm(total=sum(len(chunks[i]) for i in todo), unit="conv", desc="regenerate")
        for i in todo:
            generator = torch.Generator(engine.device).manual_seed(cfg.seed + i)  # reproducible chunk by chunk
            rows = regenerate_chunk(engine, tokenizer, chunks[i], cfg, data_cfg.max_length, bar, generator)
            atomic_write_text(paths[i], "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        bar.close()
    position = {}
    for i, conversation in enumerate(conversations):
        position.setdefault(conversation["id"], i)
    rows = [line for p in paths for line in p.read_text(encoding="utf-8").splitlines()]
    rows.sort(key=lambda line: position[json.loads(line)["id"]])  # the input's order
    atomic_write_text(output, "".join(line + "\n" for line in rows))
    print(f"wrote {output} ({len(rows)} conversations): use it with data.conversations={output}")
    return output


if __name__ == "__main__":
    recipe_main(regenerate, __doc__)
