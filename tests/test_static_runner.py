"""The static runner: in-place KV buffers, bucket padding, compiled steps without recompiles, attention kernel,
and the eager fallback for architectures it cannot run."""

from __future__ import annotations

import copy

import pytest
import torch
from test_inference_greedy import near_bigram_target, oracle_head, prompts
from tiny import tiny_model

from drafthead import DraftHead, HeadConfig
from drafthead.masks import causal_allowed
from inference import SpeculativeGenerator, TreeDrafter, TreeOptions
from inference.head_runner import HeadRunner
from inference.runners.attention import matmul_attention
from inference.runner import TargetRunner
from inference.runners.static import StaticRunner

torch.set_num_threads(1)


def chain(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()


def test_verify_and_commit_match_the_eager_runner():
    """Same logits and features for a padded tree; after commit the cache holds exactly the accepted path."""
    target = tiny_model("llama")
    static = StaticRunner(target, [1, 3], buckets=(1, 8))
    eager = TargetRunner(target, [1, 3])
    prompt = prompts(1, 320, seed=1)[0]
    keys = static.cache.layers[0].keys
    address = keys.data_ptr()
    for runner in (static, eager):
        runner.reset(prompt.shape[1] + 16)
        runner.prefill(prompt)
    parents = torch.tensor([-1, 0, 0, 1, 3])  # root, two children, a chain under the first
    depths = torch.tensor([0, 1, 1, 2, 3])
    anc = torch.eye(5, dtype=torch.bool)
    for i in range(1, 5):
        anc[i] |= anc[int(parents[i])]
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    (ls, fs, gs), (le, fe, ge) = static.verify(tokens, depths, anc), eager.verify(tokens, depths, anc)
    assert ls.shape == le.shape == (1, 5, 320) and fs.shape == fe.shape
    assert torch.equal(gs, ge) and torch.equal(gs, ls.argmax(-1))
    torch.testing.assert_close(ls, le, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fs, fe, rtol=1e-4, atol=1e-4)
    keep = torch.tensor([0, 1, 3, 4])
    for runner in (static, eager):
        runner.commit(keep, 5)
    assert static.length == eager.length == prompt.shape[1] + 4
    # the next step sees the compacted path: same logits as the eager reference, which crops by slicing
    (ls, _, _), (le, _, _) = static.verify(tokens[:, :1], *chain(1)), eager.verify(tokens[:, :1], *chain(1))
    torch.testing.assert_close(ls, le, rtol=1e-4, atol=1e-4)
    assert static.cache.layers[0].keys.data_ptr() == address  # written in place, never reallocated


def test_buffers_grow_for_long_sequences_and_refuse_overflow():
    target = tiny_model("llama")
    runner = StaticRunner(target, [1], buckets=(1, 4), capacity=16)
    assert runner.capacity == 256  # at least MIN_CAPACITY
    runner.reset(300)
    assert runner.capacity == 384  # 300 + the largest bucket, rounded up to a multiple of 128
    runner.prefill(torch.randint(3, 320, (1, 300)))
    assert runner.capacity == 384
    with pytest.raises(RuntimeError, match="exceeds the KV buffers"):
        for _ in range(60):  # 4 tokens a step: 300 -> 384, then the next step does not fit
            runner.verify(torch.tensor([[5, 6, 7, 8]]), *chain(4))
            runner.commit(torch.arange(4), 4)
    assert runner.length == 384


def test_matmul_attention_matches_eager_attention():
    from transformers.models.llama.modeling_llama import eager_attention_forward

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 3, False
    q, k, v = torch.randn(1, 9, 5, 16), torch.randn(1, 3, 12, 16), torch.randn(1, 3, 12, 16)
    mask = torch.zeros(1, 1, 5, 12)
    mask[..., 9:] = torch.finfo(torch.float32).min
    ours, _ = matmul_attention(module, q, k, v, mask, scaling=0.25)
    ref, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("used", [10, 40])  # 4 queries: a short prefix is sliced, a long one reads the whole buffer
def test_matmul_attention_reads_only_the_used_prefix_of_a_buffer(used):
    """Slots after `drafthead_kv_length` hold stale values and are masked: the result is attention over the used
    prefix alone, whether the kernel slices the prefix or reads the whole buffer."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 3, False
    q, k, v = torch.randn(2, 9, 4, 16), torch.randn(2, 3, 48, 16), torch.randn(2, 3, 48, 16)
    k[:, :, used:], v[:, :, used:] = 1e4, -1e4  # stale, large: any leak shows
    mask = torch.zeros(2, 1, 4, 48)
    mask[..., used:] = torch.finfo(torch.float32).min
    mask[1, ..., :3] = torch.finfo(torch.float32).min  # a left-padded row
    ours, _ = matmul_attention(module, q, k, v, mask, scaling=0.25, drafthead_kv_length=torch.tensor(used))
    ref, _ = eager_attention_forward(module, q, k[:, :, :used], v[:, :, :used], mask[..., :used], scaling=0.25)
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("queries", [4, 20])  # traced inline / the opaque op (a prompt's chunk)
def test_compiled_matmul_attention_traces_short_query_blocks(queries):
    """Inside a compiled step short query blocks are traced (no opaque op in the graph), longer ones call the op;
    both give eager attention's result."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from inference.runners.attention import TRACED_MAX_QUERIES

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 3, False
    q, k, v = torch.randn(1, 9, queries, 16), torch.randn(1, 3, 48, 16), torch.randn(1, 3, 48, 16)
    mask = torch.zeros(1, 1, queries, 48)
    mask[..., 30:] = torch.finfo(torch.float32).min
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    attend = torch.compile(lambda *a: matmul_attention(module, *a, scaling=0.25)[0], backend=record, fullgraph=True)
    ours = attend(q, k, v, mask)
    ref, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(ours, ref)
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert any("prefix_attention" in t for t in targets) == (queries > TRACED_MAX_QUERIES), targets


def test_bf16_static_runner_uses_its_attention_kernel_and_restores_the_model():
    """bf16 on CPU: the AVX512-BF16 kernel where the CPU has it (test_prefix_attention.py), else the matmuls."""
    from inference.cpu.kernels import kernels_available

    target = tiny_model("llama", dtype=torch.bfloat16)
    gen = SpeculativeGenerator(target, oracle_head(target).to(torch.bfloat16).attach_target(target), tree="chain",
                               runner="static")
    before = target.config._attn_implementation
    gen.generate(prompts(1, 320)[0], max_new_tokens=8)
    assert gen.runner.attention == ("drafthead_kernel" if kernels_available() else "drafthead_matmul")
    assert target.config._attn_implementation == before  # switched only while decoding


def test_float32_cpu_runners_attend_through_the_avx2_kernel_else_the_matmul_kernel():
    """float32 on CPU: every runner (eager or compiled) and the head attend through prefix_attention_avx2.cpp where
    the CPU has AVX2 (test_prefix_attention.py); elsewhere compiled steps trace the matmul kernel (fused; faster
    than SDPA there in fp32 too) and eager steps keep SDPA."""
    from inference.runners.attention import kernel_op
    from inference.runners.static import StaticRunner
    from inference.head_runner import HeadRunner

    target = tiny_model("llama")  # float32
    kernel = kernel_op(torch.float32) is not None
    compiled = "drafthead_kernel" if kernel else "drafthead_matmul"
    assert StaticRunner(target, [], compile=True).attention == compiled
    assert StaticRunner(target, [], compile=True).attention == compiled
    assert StaticRunner(target, []).attention == ("drafthead_kernel" if kernel else None)
    head = oracle_head(target).attach_target(target)
    HeadRunner(head, compile=True)
    assert head.midlayer.self_attn.config._attn_implementation == compiled


def test_sliding_window_target_falls_back_to_eager(capsys):
    """A sliding-window target runs on the eager runner (exact while the sequence fits the window)."""
    target = tiny_model("mistral", sliding_window=64)
    gen = SpeculativeGenerator(target, oracle_head(target).attach_target(target), tree="chain")
    ids = prompts(1, 320, seed=2)[0]
    ref = target.generate(ids, do_sample=False, max_new_tokens=12)
    assert torch.equal(gen.generate(ids, max_new_tokens=12).sequences, ref)
    assert isinstance(gen.runner, TargetRunner)
    assert "sliding-window" in capsys.readouterr().err
    with pytest.raises(NotImplementedError, match="sliding-window"):
        SpeculativeGenerator(target, None, tree="none", runner="static").runner
    with pytest.raises(NotImplementedError, match="sliding window"):
        gen.generate(ids, max_new_tokens=70)


@pytest.mark.slow
@pytest.mark.parametrize("compiled", ["plain", "verify", "drafting"])
def test_compiled_runner_is_lossless_without_recompiles(compiled):
    """Each compiled part of decoding, one per case: the target's verify step for plain decoding (the one-token
    bucket, with inductor's GEMM templates) and for a tree (the 8-token bucket), each with the prompt-chunk graph,
    and the head's drafting step compiled whole. Greedy output identical to generate, and a second round of
    prompts compiles nothing new. The parts are proven apart: the output is the verify step's whatever the head
    drafts. One-layer targets: what compiles is one layer's code, and each graph costs less to build."""
    from torch._dynamo.utils import counters

    target = near_bigram_target("llama", num_layers=1)
    head = oracle_head(target).attach_target(target)
    tree = TreeOptions(depth=2, top_k=2, total_tokens=4)
    if compiled == "plain":
        runner = StaticRunner(target, [], compile=True, buckets=(1,))
        gen = SpeculativeGenerator(target, None, tree="none", runner=runner)
    else:
        runner = StaticRunner(target, head.config.aux_layer_ids, compile=compiled == "verify", buckets=(8,))
        gen = SpeculativeGenerator(target, head, tree=tree, runner=runner, compile=compiled == "drafting")
    g = torch.Generator().manual_seed(4)
    # short prompts (padded to one 17-row chunk) and longer ones (one 40-row chunk; two chunks of 75): one
    # prompt-chunk graph for all of them
    batch = prompts(6, 320, seed=3) + [torch.randint(3, 320, (1, n), generator=g) for n in (40, 150)]
    gen.warmup(192)  # the first round compiles the step and the prompt-chunk graph
    if compiled == "drafting":
        assert gen.drafter.runner.compiled and not runner.compiled
    else:
        assert set(runner.compile_s) == {runner.buckets[0], "prefill"}
    graphs = counters["stats"]["unique_graphs"]
    for ids in batch:
        ref = target.generate(ids, do_sample=False, max_new_tokens=20)
        assert torch.equal(gen.generate(ids, max_new_tokens=20).sequences, ref), ids.tolist()
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile while generating
    if compiled != "plain":
        assert gen.generate(batch[0], max_new_tokens=20).stats.mean_accepted > 1.5


def grow_past_warmed_buffers(compile_target: bool, tree: TreeOptions):
    """Warm a generator up on short sequences, then decode a 500-token prompt: both buffers grow, and the output
    still equals generate. Returns the generator and the prompt."""
    target = near_bigram_target("llama", num_layers=2)
    head = oracle_head(target).attach_target(target)
    runner = StaticRunner(target, head.config.aux_layer_ids, compile=compile_target, buckets=(8,))
    gen = SpeculativeGenerator(target, head, tree=tree, runner=runner, compile=not compile_target)
    gen.warmup(32)
    small = (runner.capacity, gen.drafter.runner.capacity)
    ids = torch.randint(3, 320, (1, 500), generator=torch.Generator().manual_seed(5))
    ref = target.generate(ids, do_sample=False, max_new_tokens=24)
    out = gen.generate(ids, max_new_tokens=24)
    assert runner.capacity > small[0] and gen.drafter.runner.capacity > small[1]
    assert torch.equal(out.sequences, ref)
    assert out.stats.mean_accepted > 1.5
    return gen, ids


@pytest.mark.slow
def test_compiled_verify_steps_follow_their_buffers_when_they_grow():
    """The compiled steps skip the guards on the KV buffers (compile_step's `unguarded`): a sequence longer than
    the warmed-up buffers grows them, and the target's compiled steps then read and write the new buffers (still
    equal to generate). One 8-token bucket: the small buckets' GEMM templates are the lossless test's subject."""
    gen, ids = grow_past_warmed_buffers(True, TreeOptions(depth=3, top_k=2, total_tokens=6))
    assert gen.runner.compiled and not gen.drafter.runner.compiled
    assert gen.runner.cache.layers[0].keys[0, :, ids.shape[1] - 1].abs().sum() > 0  # the new buffer holds the prompt


@pytest.mark.slow
def test_compiled_drafting_steps_follow_their_buffers_when_they_grow():
    """Likewise for the head's drafting step compiled whole (its own KV buffer grows with the sequence); a depth-1
    tree, the smallest whole step to compile."""
    gen, ids = grow_past_warmed_buffers(False, TreeOptions(depth=1, top_k=4, total_tokens=4))
    assert gen.drafter.runner.compiled and not gen.runner.compiled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_capture_is_lossless():
    import torch._inductor.config
    from torch._dynamo.utils import counters

    target = near_bigram_target("llama").cuda()
    head = oracle_head(target).cuda().attach_target(target)
    # caches off: a graph served from inductor's cache is not re-checked, so a skip would go uncounted
    with torch._inductor.config.patch(force_disable_caches=True):
        gen = SpeculativeGenerator(target, head, tree="chain", compile=True)
        skips = counters["inductor"]["cudagraph_skips"]
        gen.warmup(64)
        for ids in prompts(4, 320, seed=4):
            ids = ids.cuda()
            ref = target.generate(ids, do_sample=False, max_new_tokens=20)
            assert torch.equal(gen.generate(ids, max_new_tokens=20).sequences, ref)
    # every compiled step (the target's verify buckets and the head's drafting depths) ran as a CUDA graph: a KV
    # buffer written in place without a static address makes inductor skip the graph (and pay every launch)
    assert counters["inductor"]["cudagraph_skips"] == skips


@pytest.mark.slow
def test_compiled_runners_of_different_models_never_share_graphs():
    """Frozen weights are baked into a compiled graph: two targets (and two heads) compiled in one process must
    each run their own weights. (Two-layer targets, one 8-token verify bucket: inductor's GEMM templates of the
    small buckets, costly to tune, are test_compiled_runner_is_lossless_without_recompiles' subject.)"""
    a, b = tiny_model("llama", seed=0, num_layers=2), tiny_model("llama", seed=1, num_layers=2)
    prompt = prompts(1, 320, seed=7)[0]
    for model in (a, b):
        runner = StaticRunner(model, [], compile=True, buckets=(8,))
        runner.reset(32)
        with torch.inference_mode():
            runner.prefill(prompt[:, :-1])
            logits, _, _ = runner.verify(prompt[:, -1:], *chain(1))
            ref = model(prompt).logits[:, -1:]
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_compiled_heads_of_different_weights_never_share_graphs():
    """Likewise for the head: two heads of one target, each drafting step compiled whole, each drafts with its own
    weights (the tree of the eager step)."""
    a = tiny_model("llama", seed=0, num_layers=2)
    prompt = prompts(1, 320, seed=7)[0]
    heads = [oracle_head(a).attach_target(a), oracle_head(a).attach_target(a)]
    with torch.no_grad():
        heads[1].fc.weight.mul_(-1.0)
    options = TreeOptions(depth=2, top_k=2, total_tokens=4)
    trees = []
    for head in heads:  # the same tree from the eager step and the step compiled whole
        eager, compiled = (TreeDrafter(head, options, HeadRunner(head, compile=c)) for c in (False, True))
        feats = torch.randn(1, 6, head.config.feature_size, generator=torch.Generator().manual_seed(3))
        for drafter in (eager, compiled):
            drafter.begin(prompt[:, :6], feats, 32)
        with torch.inference_mode():
            ours, ref = compiled.propose(prompt[0, 6:7]), eager.propose(prompt[0, 6:7])
        assert torch.equal(ours.tokens, ref.tokens) and torch.equal(ours.parents, ref.parents)
        torch.testing.assert_close(ours.scores, ref.scores, rtol=1e-4, atol=1e-4)
        trees.append(ref)
    assert not torch.equal(trees[0].scores, trees[1].scores)  # the two heads do draft differently


@pytest.mark.parametrize("head_dim,length", [(16, 40), (32, 12)])
def test_bf16_head_runner_drafts_on_the_decoding_attention(head_dim, length):
    """On CPU in bf16 the head's drafting steps attend through the runners' attention kernel (AVX512-BF16 where the
    CPU has it, for up to 16 queries with head_dim 32/64/128; else the matmuls), with the outputs of its SDPA."""
    from inference.cpu.kernels import kernels_available

    target = tiny_model("llama", dtype=torch.bfloat16, head_dim=head_dim)
    head = DraftHead(HeadConfig.from_target_config(target.config, kind="eagle3")).to(torch.bfloat16).eval()
    reference = copy.deepcopy(head)
    runner, ref_runner = HeadRunner(head), HeadRunner(reference)
    expected = "drafthead_kernel" if kernels_available() else "drafthead_matmul"
    assert head.midlayer.self_attn.config._attn_implementation == expected
    reference.midlayer.self_attn.config._attn_implementation = "sdpa"
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.config.vocab_size, (1, length), generator=g)
    features = torch.randn(1, length, 3 * target.config.hidden_size, generator=g).to(torch.bfloat16)
    positions = torch.arange(length).unsqueeze(0)

    def feed(r):
        return r.passes(whole=True)[0](tokens, features, positions, r.mask(causal_allowed(length), 0),
                                       positions[0], torch.tensor([length - 1]), 4)

    ours, theirs = feed(runner), feed(ref_runner)
    torch.testing.assert_close(ours[0], theirs[0], atol=0.05, rtol=0.05)  # the last output hidden (1, 1, H)
    torch.testing.assert_close(ours[1], theirs[1], atol=0.05, rtol=0.05)  # its top-4 log-probs


def test_a_compiled_step_works_in_a_process_that_never_loaded_the_kernels():
    """compile_step's graph pass (small_gemm.FuseSiblingLinears) looks for the small-row kernel's calls; in a
    process that never built the kernels (fp32, or a CPU without AVX512-BF16) their op namespace is empty, and the
    pass must leave the graph alone instead of failing the compile. A fresh process, so nothing loaded them."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = """
import torch
from tiny import tiny_model
from drafthead.masks import causal_allowed
from inference.runners.static import StaticRunner
assert not hasattr(torch.ops.drafthead_kernels, "small_linear")
target = tiny_model("llama", num_layers=2)
ids = torch.randint(3, 320, (1, 12), generator=torch.Generator().manual_seed(0))
logits = {}
for compile in (False, True):
    runner = StaticRunner(target, [0, 1], compile=compile, buckets=(8,))
    with runner.session(), torch.inference_mode():
        runner.reset(16)
        runner.prefill(ids[:, :8])
        logits[compile] = runner.verify(ids[:, 8:], torch.arange(4), causal_allowed(4, 0, ids.device))[0]
assert torch.allclose(logits[False], logits[True], atol=1e-4), (logits[False] - logits[True]).abs().max()
"""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}:{root / 'tests'}"}
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
