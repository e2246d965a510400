"""A GGUF target's own quantized blocks (Q8_0, Q6_K, Q5_0, Q4_0, Q4_1, Q4_K) in the decoding steps
(inference/cpu/gguf_weights.py): the kernel equals the float32 kernel on the dequantized weights bit for bit, and
greedy decoding of the quantized model equals the dequantized model's and transformers' generate (tiny Llama and
Qwen2, and the real SmolLM2 Q4_1 file)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from inference import SpeculativeGenerator
from inference.cpu.kernels import avx2_kernels_available, kernels_available
from tiny import tiny_head, tiny_model

gguf = pytest.importorskip("gguf")
Q8_0, Q6_K, Q5_0, Q4_0, Q4_1, Q4_K = (getattr(gguf.GGMLQuantizationType, t)
                                      for t in ("Q8_0", "Q6_K", "Q5_0", "Q4_0", "Q4_1", "Q4_K"))
K_QUANTS = (Q4_K, Q6_K)  # 256-weight super-blocks, which gguf's numpy code does not quantize
needs_avx2 = pytest.mark.skipif(not avx2_kernels_available(), reason="the AVX2 kernels need a CPU with AVX2")
needs_bf16 = pytest.mark.skipif(not kernels_available(), reason="the bf16 kernels need a CPU with AVX512-BF16")


def quantized_blocks(values: np.ndarray, qtype, rng: np.random.Generator) -> np.ndarray:
    """(N, bytes) GGUF blocks of `qtype` for a (N, K) float32 matrix: gguf's own quantization (Q8_0, Q5_0, Q4_0,
    Q4_1); for Q4_K and Q6_K, which gguf does not quantize, random super-blocks (every scale and minimum, every q) of
    about the values' spread."""
    if qtype not in K_QUANTS:
        return gguf.quants.quantize(values, qtype)
    n, k = values.shape
    blocks = rng.integers(0, 256, (n, k // 256, 144 if qtype == Q4_K else 210), dtype=np.uint8)
    spread = float(np.abs(values).max())
    # Q4_K's d: scale x q reaches 63 x 15, its dmin: the minimum reaches 63; Q6_K's d (last): scale x q 128 x 32
    for at, top in ((0, 63 * 15), (2, 63)) if qtype == Q4_K else ((208, 128 * 32),):
        half = (rng.uniform(0.5, 1.5, (n, k // 256, 1)) * spread / top).astype(np.float16)
        blocks[..., at: at + 2] = half.view(np.uint8)
    return blocks.reshape(n, -1)


@needs_avx2
@pytest.mark.parametrize("qtype", [Q8_0, Q6_K, Q5_0, Q4_0, Q4_1, Q4_K], ids=lambda t: t.name)
def test_quantized_kernel_is_the_float32_kernel_on_the_dequantized_weight(qtype):
    from inference.cpu.gguf_weights import pack_gguf_tensor

    rng = np.random.default_rng(0)
    # K past the kernel's 256-wide chunks, and a partial last chunk (K-quants: K in 256-weight super-blocks)
    for n, k in ((48, 256), (160, 768)) if qtype in K_QUANTS else ((48, 64), (160, 576)):
        blocks = quantized_blocks(rng.standard_normal((n, k)).astype(np.float32), qtype, rng)
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


@needs_bf16
@pytest.mark.parametrize("qtype", [Q8_0, Q6_K, Q5_0, Q4_0, Q4_1, Q4_K], ids=lambda t: t.name)
def test_bf16_quantized_kernel_multiplies_the_exact_dequantized_weight(qtype):
    """bf16 activations times the blocks (gguf_linear_bf16.cpp): within float32 summation of the exact product, nearer
    to it than bf16-rounded weights get, and each row's result independent of the rows beside it."""
    from inference.cpu.gguf_weights import pack_gguf_tensor

    rng = np.random.default_rng(0)
    n, k = (160, 512) if qtype in K_QUANTS else (160, 576)
    blocks = quantized_blocks(rng.standard_normal((n, k)).astype(np.float32), qtype, rng)
    w = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy()).double()
    packed, params = pack_gguf_tensor(qtype, blocks)
    bias = torch.randn(n)
    for rows in (1, 3, 8, 9, 16, 20):  # each path: several blocks a pass, one, and pieces converted once (> 16)
        x = torch.randn(rows, k).bfloat16()
        got = torch.ops.drafthead_kernels.small_linear_q(x, packed, params, bias)
        exact = x.double() @ w.T + bias.double()
        rounded = (x.double() @ w.bfloat16().double().T + bias.double()).bfloat16().double()
        error, rounding = (got.double() - exact).abs(), (rounded - exact).abs()
        assert (error <= exact.abs() / 2**8 + 1e-5 * (x.double().abs() @ w.abs().T)).all(), (qtype, rows)
        assert error.mean() < 0.8 * rounding.mean(), (qtype, rows, error.mean(), rounding.mean())
        for i in (0, rows - 1):
            assert torch.equal(torch.ops.drafthead_kernels.small_linear_q(x[i:i + 1], packed, params, bias)[0],
                               got[i]), (qtype, rows, i)
    got = torch.ops.drafthead_kernels.small_linear_q(x.view(4, 5, k), packed, params, None, torch.tensor(2))
    assert torch.equal(got[:2], torch.ops.drafthead_kernels.small_linear_q(x[:10], packed, params, None).view(2, 5, n))
    assert not got[2:].any()  # entries past the live ones are zeros


def quantize_into_gguf(model: torch.nn.Module, path) -> int:
    """Quantize every linear of `model` (Q8_0 for the output layer, Q4_K and Q6_K in turn where the inputs come in
    256s, Q4_1, Q5_0 and Q4_0 in turn for the others), write the blocks to a GGUF file at `path` (the first tensor's
    rows reversed, as llama.cpp reorders q/k rows), and set each weight to its dequantization, as transformers loads
    a GGUF file. Returns how many linears were quantized."""
    writer = gguf.GGUFWriter(path, "llama")
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    rng = np.random.default_rng(0)
    for i, (name, module) in enumerate(linears):
        qtype = Q8_0 if name == "lm_head" else K_QUANTS[i % 2] if module.in_features % 256 == 0 else \
            (Q4_1, Q5_0, Q4_0)[i % 3]
        blocks = quantized_blocks(module.weight.detach().numpy(), qtype, rng)
        module.weight.data = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy())
        writer.add_tensor(name, blocks[::-1].copy() if i == 0 else blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return len(linears)


@needs_avx2
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_target_decodes_as_its_dequantized_model(tmp_path, arch):
    """Llama: Q4_1, Q5_0, Q4_0 and Q8_0 linears; Qwen2 (q/k/v with biases): its 256-wide MLP's down projections in
    Q4_K and Q6_K."""
    from inference.cpu.gguf_weights import use_gguf_weights

    dequantized = tiny_model(arch, **({"intermediate_size": 256} if arch == "qwen2" else {}))
    count = quantize_into_gguf(dequantized, tmp_path / "tiny.gguf")
    quantized = copy.deepcopy(dequantized)
    assert use_gguf_weights(quantized, tmp_path / "tiny.gguf") == count  # every linear, the reordered one too
    head = tiny_head(dequantized)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (1, n), generator=g) for n in (5, 9, 13)]
    for tree in ("none", "2,2,4"):
        reference = SpeculativeGenerator(dequantized, copy.deepcopy(head).attach_target(dequantized), tree=tree)
        gen = SpeculativeGenerator(quantized, copy.deepcopy(head).attach_target(quantized), tree=tree)
        assert gen.runner.quantized and gen.runner.small_rows
        for ids in prompts:
            out = gen.generate(ids, max_new_tokens=24).sequences
            assert torch.equal(out, reference.generate(ids, max_new_tokens=24).sequences)
            assert torch.equal(out, dequantized.generate(ids, do_sample=False, max_new_tokens=24))
        gen.close()
        reference.close()


@needs_bf16
def test_tiny_gguf_target_in_bf16_speculates_exactly_as_it_decodes(tmp_path):
    """A bf16 model of a GGUF file keeps its blocks too (its rows matched in bf16), and its trees' greedy output is
    its plain decoding's, token for token."""
    from inference.cpu.gguf_weights import use_gguf_weights

    dequantized = tiny_model("llama")
    count = quantize_into_gguf(dequantized, tmp_path / "tiny.gguf")
    model = copy.deepcopy(dequantized).to(torch.bfloat16)
    assert use_gguf_weights(model, tmp_path / "tiny.gguf") == count
    head = tiny_head(dequantized).to(torch.bfloat16)
    plain, gen = (SpeculativeGenerator(model, copy.deepcopy(head).attach_target(model), tree=tree)
                  for tree in ("none", "2,2,4"))
    assert gen.runner.quantized and gen.runner.small_rows
    g = torch.Generator().manual_seed(0)
    for n in (5, 9, 13):
        ids = torch.randint(3, 320, (1, n), generator=g)
        assert torch.equal(gen.generate(ids, max_new_tokens=24).sequences,
                           plain.generate(ids, max_new_tokens=24).sequences), n
    gen.close()
    plain.close()


@pytest.mark.real
def test_smollm2_q4_1_file_keeps_its_blocks_in_the_default_dtype(smollm2_path):
    """A GGUF target's default ('fast') dtype is a folder's: bf16 on a CPU with native bf16, where its blocks multiply
    bf16 activations (gguf_linear_bf16.cpp), else float32; its 210 Q4_1 linears and Q8_0 output layer keep them."""
    from conftest import asset
    from drafthead.hardware import auto_dtype

    gen = SpeculativeGenerator.from_pretrained(asset("models/SmolLM2-135M-Instruct.Q4_1.gguf"), None, tree="none",
                                               compile=False)
    assert next(gen.target.parameters()).dtype == auto_dtype("cpu")
    kernels = kernels_available() if auto_dtype("cpu") == torch.bfloat16 else avx2_kernels_available()
    assert sum(getattr(m, "qpacked", None) is not None for m in gen.target.modules()) == (211 if kernels else 0)
    ids = gen.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    assert gen.tokenizer.decode(gen.generate(ids, max_new_tokens=8).sequences[0, ids.shape[1]:]).strip()
    gen.close()


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
