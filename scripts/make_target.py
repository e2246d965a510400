"""A target model folder of a known shape with random weights, for speed and memory measurements only.

    python scripts/make_target.py --shape llama-3.1-8b --out /tmp/llama8b --device cuda     # 16 GB of bf16
    python scripts/make_target.py --shape tiny --out /tmp/tiny-llama                         # the CPU rehearsal's

The shapes are Hugging Face Llama configs: `llama-3.1-8b` has Llama-3.1-8B's dimensions (32 layers, hidden 4096,
GQA 32/8, MLP 14336, vocabulary 128,256, llama3 RoPE); `tiny` is the same architecture with small dimensions and
the same vocabulary, so the draft-vocabulary path is the one the large shape takes. Nothing is downloaded: the
weights are the model's own random initialisation, made on --device (a GPU makes 8 B parameters in seconds) and
saved as safetensors in --dtype. The folder has no tokenizer; the tools that time training and decoding with it
feed token ids.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                   rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000,
                   eos_token_id=128009,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192))
SHAPES = {
    "llama-3.1-8b": LLAMA_31_8B,
    # 8 layers: the default aux layers (1, N/2-1, N-4) are three distinct layers
    "tiny": {**LLAMA_31_8B, "hidden_size": 64, "intermediate_size": 224, "num_hidden_layers": 8,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
}


def make_target(shape: str, out: Path, device: str = "cpu", dtype: str = "bfloat16", seed: int = 0) -> dict:
    """Write a random-weight LlamaForCausalLM of `shape` to `out`; returns what was made (parameters, bytes, s)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if shape not in SHAPES:
        raise SystemExit(f"unknown --shape {shape!r}; choose from {', '.join(SHAPES)}")
    torch_dtype = getattr(torch, dtype)
    config = LlamaConfig(**SHAPES[shape])
    start = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(device):  # made in its dtype where it will run: no float32 copy of 8 B parameters
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(out)
    info = {"shape": shape, "parameters": sum(p.numel() for p in model.parameters()),
            "bytes": sum(p.numel() * p.element_size() for p in model.parameters()), "dtype": dtype,
            "device": device, "seconds": round(time.perf_counter() - start, 1)}
    (out / "made_by.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b", help=f"one of {', '.join(SHAPES)}")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    info = make_target(args.shape, args.out, args.device, args.dtype, args.seed)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
