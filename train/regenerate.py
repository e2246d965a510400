"""Regenerate the assistant turns of a conversation set with the target's own responses.

    python -m train.regenerate configs/smollm2-135m-eagle3.yaml [data.regenerate.temperature=0.7 ...]

A draft head learns the target's distribution best from text the target itself wrote. Every assistant turn is
replaced, turn by turn, by the target's reply to the conversation so far (the user turns are kept); with
data.max_assistant_turns=1 only first turns are kept and regenerated. Generation runs on the decoding engine's batched
runner (inference.SpeculativeGenerator.generate_many, plain decoding: static KV buffers, one forward per token for
the whole batch, continuous batching: a row whose reply is done takes the next prompt), greedy (temperature 0) or
sampled. Conversations are processed in order of prompt length (less padding), in chunks; each finished chunk is
written atomically to <output>.chunks/chunk-NNNNN-of-MMMMM-<plan>.jsonl and skipped on re-run, and the chunks are
joined (in the input's order) into <output> (OpenAI `messages` JSONL, usable as data.conversations) when all are done.
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

from drafthead.utils import atomic_write_text, dtype_name
from train.conversations import read_conversations
from train.recipe import Recipe, RegenerateSection, parse_recipe
from train.recipe_help import recipe_main
from train.target import load_target, load_tokenizer


def replier(model: Any, tokenizer: Any) -> Any:
    """The decoding engine's plain batched decoding of `model` (inference.SpeculativeGenerator, tree="none"):
    preallocated KV buffers written in place, every row in one forward per token, a finished row takes the next prompt.
    Greedy output equals transformers' generate token for token (fp32); it is several times cheaper per token."""
    from inference import SpeculativeGenerator  # the engine generates the data; inference never imports train

    return SpeculativeGenerator(model, None, tokenizer, tree="none")


@torch.inference_mode()
def generate_replies(engine: Any, tokenizer: Any, prompts: list[list[dict]], max_new_tokens: int,
                     temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None,
                     batch_size: int = 32) -> tuple[list[str], int]:
    """The target's replies to conversations (each ending with a user turn), `batch_size` decoding at once with
    continuous batching (a finished row takes the next prompt); also the new-token count. `engine`: replier()."""
    ids = [tokenizer.apply_chat_template(p, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
           for p in prompts]
    sample = temperature > 0
    out = engine.generate_many(ids, max_new_tokens=max_new_tokens, batch_size=batch_size, do_sample=sample,
                               temperature=temperature if sample else None, top_p=top_p if sample else None,
                               generator=generator)
    replies = tokenizer.batch_decode(out.new_tokens, skip_special_tokens=True)
    return [r.strip() for r in replies], out.stats.new_tokens


def regenerate_chunk(engine: Any, tokenizer: Any, conversations: list[dict], cfg: RegenerateSection,
                     max_length: int, bar: tqdm, generator: torch.Generator | None = None) -> list[dict]:
    """Replace every assistant turn of `conversations`, turn by turn across the chunk: each turn's prompts in order
    of length through one queue (continuous batching, cfg.batch_size rows)."""
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
        waiting.sort()  # shortest prompts first: the rows of a batch, and of a prefill group, about as long
        queue = [c for _, c in waiting]
        replies, n = generate_replies(engine, tokenizer, [done[c] for c in queue], cfg.max_new_tokens,
                                      cfg.temperature, cfg.top_p, generator, cfg.batch_size)
        for c, reply in zip(queue, replies):
            done[c].append({"role": "assistant", "content": reply})
            cursor[c] += 1
        tokens += n
        if queue:
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

    Conversations are processed in order of their first prompt's length, so that the prompts prefilled together
    are about as long as each other: a group is prefilled left-padded to its longest prompt, and a mixed batch
    spends up to half of its prefill on padding (ShareGPT first turns in file order, batches of 32: ~50 % in the
    longest batch). The
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
        model = load_target(recipe.target, device=recipe.device, dtype=recipe.dtype)
        print(f"[regenerate] device={model.device} dtype={dtype_name(model.dtype)} target={recipe.target}", flush=True)
        engine = replier(model, tokenizer)
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
