"""Tiny randomly initialised Hugging Face models and a small chat tokenizer, built offline in seconds."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_VOCAB = 320
ARCHS = ("llama", "qwen2", "mistral")


def tiny_config(arch: str = "llama", vocab_size: int = TINY_VOCAB, num_layers: int = 8, **overrides):
    """An 8-layer, 64-wide config of the given architecture (GQA 4 heads / 2 KV heads)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
    if arch == "qwen2":
        return Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **common)
    if arch == "mistral":
        common.setdefault("sliding_window", None)
        return MistralConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
    raise ValueError(f"unknown tiny arch {arch!r}; choose from {ARCHS}")


def tiny_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny random causal LM in eval mode. Weights are scaled up so greedy decoding is not degenerate."""
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    config.initializer_range = 0.2
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (vocab ≤ 300) with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["hello world, the quick brown fox jumps over the lazy dog. user assistant system"] * 4
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_head(target, kind: str = "eagle3", draft_vocab_size: int = 200, seed: int = 0, aux_layer_ids=None):
    """A draft head for `target` with random (non-default) weights and, for EAGLE-3, a random draft vocabulary."""
    from drafthead import DraftHead, HeadConfig
    from drafthead.vocab import build_draft_vocab

    config = HeadConfig.from_target_config(target.config, kind=kind, draft_vocab_size=draft_vocab_size,
                                           aux_layer_ids=aux_layer_ids)
    torch.manual_seed(seed)
    head = DraftHead(config).attach_target(target)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))  # norms away from 1, so a swapped tensor changes the logits
        if kind == "eagle3":
            counts = torch.randint(0, 1000, (config.vocab_size,))
            d2t, t2d = build_draft_vocab(counts, config.draft_vocab_size)
            head.d2t.copy_(d2t)
            head.t2d.copy_(t2d)
    return head.eval()


SMOLLM2_VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_gguf_case(folder, smollm2_dir):
    """A tiny EAGLE-3 head exported to `folder`/tiny-eagle3-head and its target `folder`/tiny-target: a tiny Llama
    config of SmolLM2's vocabulary with SmolLM2's tokenizer files (llama.cpp's GGUF converter knows only real
    tokenizers). Returns (head folder, target folder, head); tests/data/eagle3_gguf_manifest.json is made from it."""
    import shutil
    from pathlib import Path

    from drafthead.export import export_head

    folder, smollm2_dir = Path(folder), Path(smollm2_dir)
    target = tiny_model("llama", vocab_size=SMOLLM2_VOCAB)
    head = tiny_head(target, "eagle3")
    target.config.save_pretrained(folder / "tiny-target")
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_dir / name, folder / "tiny-target" / name)
    export_head(head, folder / "tiny-eagle3-head")
    return folder / "tiny-eagle3-head", folder / "tiny-target", head


def state_sha256(head) -> str:
    """sha256 of a head's saved tensors (names and bytes): tells a changed tiny head from a changed writer."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(head.saved_state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
