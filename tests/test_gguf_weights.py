"""A GGUF target's own Q8_0 / Q4_1 blocks in the decoding steps (inference/cpu/gguf_weights.py): the kernel equals the
float32 kernel on the dequantized weights bit for bit, and greedy decoding of the quantized model equals the
dequantized model's and transformers' generate (tiny Llama, and the real SmolLM2 Q4_1 file)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from inference import SpeculativeGenerator
from inference.cpu.kernels import avx2_kernels_available
from tiny import tiny_head, tiny_model

gguf = pytest.importorskip("gguf")
Q8_0, Q4_1 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1
needs_avx2 = pytest.mark.skipif(not avx2_kernels_available(), reason="the AVX2 kernels need a CPU with AVX2")


@needs_avx2
@pytest.mark.parametrize("qtype", [Q8_0, Q4_1], ids=["Q8_0", "Q4_1"])
def test_quantized_kernel_is_the_float32_kernel_on_the_dequantized_weight(qtype):
    from inference.cpu.gguf_weights import pack_gguf_tensor

    rng = np.random.default_rng(0)
    for n, k in ((48, 64), (160, 576)):  # K past the kernel's 256-wide chunks, and a partial last chunk
        blocks = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
        dequantized = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy())
        packed, params = pack_gguf_tensor(qtype, blocks)
        reference = torch.ops.drafthead_avx2.pack_weight(dequantized)
        bias = torch.randn(n)
        for rows in (1, 3, 4, 5, 16):
            x = torch.randn(rows, k)
            expected = torch.ops.drafthead_avx2.small_linear(x, reference, bias)
            assert torch.equal(torch.ops.drafthead_avx2.small_linear_q(x, packed, params, bias), expected), (n, k, rows)
        live = torch.tensor(2)  # only the first 2 entries still decoding: the rest are zeros, as small_linear's
        x = torch.randn(4, 1, k)
        got = torch.ops.drafthead_avx2.small_linear_q(x, packed, params, None, live)
        assert torch.equal(got, torch.ops.drafthead_avx2.small_linear(x, reference, None, live))


def quantize_into_gguf(model: torch.nn.Module, path) -> int:
    """Quantize every linear of `model` (Q8_0 for the output layer, Q4_1 for the others), write the blocks to a GGUF
    file at `path` (the first tensor's rows reversed, as llama.cpp reorders q/k rows), and set each weight to its
    dequantization, as transformers loads a GGUF file. Returns how many linears were quantized."""
    writer = gguf.GGUFWriter(path, "llama")
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for i, (name, module) in enumerate(linears):
        qtype = Q8_0 if name == "lm_head" else Q4_1
        blocks = gguf.quants.quantize(module.weight.detach().numpy(), qtype)
        module.weight.data = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy())
        writer.add_tensor(name, blocks[::-1].copy() if i == 0 else blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return len(linears)


@needs_avx2
def test_tiny_gguf_target_decodes_as_its_dequantized_model(tmp_path):
    from inference.cpu.gguf_weights import use_gguf_weights

    dequantized = tiny_model("llama")
    count = quantize_into_gguf(dequantized, tmp_path / "tiny.gguf")
    quantized = copy.deepcopy(dequantized)
    assert use_gguf_weights(quantized, tmp_path / "tiny.gguf") == count  # every linear, the reordered one too
    head = tiny_head(dequantized)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (1, n), generator=g) for n in (5, 9, 13)]
    for tree in ("none", "2,2,4"):
        reference = SpeculativeGenerator(dequantized, copy.deepcopy(head).attach_target(dequantized), tree=tree)
        gen = SpeculativeGenerator(quantized, copy.deepcopy(head).attach_target(quantized), tree=tree)
        assert gen.runner.quantized and gen.runner.kernel_rows[0] == 1
        for ids in prompts:
            out = gen.generate(ids, max_new_tokens=24).sequences
            assert torch.equal(out, reference.generate(ids, max_new_tokens=24).sequences)
            assert torch.equal(out, dequantized.generate(ids, do_sample=False, max_new_tokens=24))
        gen.close()
        reference.close()


def test_a_gguf_file_runs_in_float32_where_fast_would_be_bf16():
    """Its blocks are multiplied in float32: on a CPU the default ('fast') dtype of a GGUF target is float32, that
    of a model folder the hardware's."""
    from drafthead.hardware import auto_dtype, resolve_dtype
    from inference.loading import is_gguf

    assert is_gguf("models/SmolLM2-135M-Instruct.Q4_1.gguf") and not is_gguf("models/SmolLM2-135M-Instruct")
    assert resolve_dtype("fast", "cpu", gguf=True) == auto_dtype("cpu", gguf=True) == torch.float32
    assert resolve_dtype("fast", "cpu") == auto_dtype("cpu")


@needs_avx2
@pytest.mark.real
def test_smollm2_q4_1_file_decodes_as_the_dequantized_target(smollm2, smollm2_path):
    """The Q4_1 GGUF the SmolLM2 asset is dequantized from, loaded as a file: its 210 Q4_1 linears and the Q8_0
    output layer keep their blocks, and greedy output equals the dequantized target's (the asset folder) and
    transformers' generate."""
    from conftest import asset
    from inference.loading import load_causal_lm

    path = asset("models/SmolLM2-135M-Instruct.Q4_1.gguf")
    model, tokenizer = load_causal_lm(path, torch.float32, what="target")
    assert sum(getattr(m, "qpacked", None) is not None for m in model.modules()) == 211
    gen = SpeculativeGenerator(model, None, tokenizer, tree="none")
    reference = SpeculativeGenerator(smollm2, None, tokenizer, tree="none")
    for prompt in ("What is the capital of France?", "Write a haiku about the sea."):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        out = gen.generate(ids, max_new_tokens=32).sequences
        assert torch.equal(out, reference.generate(ids, max_new_tokens=32).sequences), prompt
        assert torch.equal(out, smollm2.generate(ids, do_sample=False, max_new_tokens=32)), prompt
    gen.close()
    reference.close()
