"""The static runner: in-place KV buffers, bucket padding, compiled steps without recompiles, attention kernel,
and the eager fallback for architectures it cannot run."""

from __future__ import annotations


import pytest
import torch
from test_inference_greedy import near_bigram_target, oracle_head, prompts
from tiny import tiny_model

from inference import Accepted, DraftTree, SpeculativeGenerator, TreeOptions
from inference.runners import EagerRunner
from inference.runners.attention import matmul_attention
from inference.runners.static import StaticRunner

torch.set_num_threads(1)


def chain(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-row chain's (tokens, depths, ancestors) as the runners take them."""
    tree = DraftTree.chain(torch.tensor(tokens[:1]), torch.tensor([tokens[1:]], dtype=torch.long))
    return tree.tokens, tree.depths, tree.ancestors


def keep(path: list[int], n: int) -> Accepted:
    """One row's accepted tree indices, as the loop hands them to runner.commit."""
    return Accepted.from_host([path], [path], n, torch.device("cpu"))


def test_verify_and_commit_match_the_eager_runner():
    """Same logits and features for a padded tree; after commit the cache holds exactly the accepted path."""
    target = tiny_model("llama")
    static = StaticRunner(target, [1, 3], buckets=(1, 8))
    eager = EagerRunner(target, [1, 3])
    prompt = prompts(1, 320, seed=1)[0]
    for runner in (static, eager):
        runner.reset(1, prompt.shape[1] + 16)
        runner.prefill(prompt)
    address = static.cache.layers[0].keys.data_ptr()
    parents = torch.tensor([-1, 0, 0, 1, 3])  # root, two children, a chain under the first
    depths = torch.tensor([[0, 1, 1, 2, 3]])
    anc = torch.eye(5, dtype=torch.bool)
    for i in range(1, 5):
        anc[i] |= anc[int(parents[i])]
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    (ls, fs, gs), (le, fe, ge) = static.verify(tokens, depths, anc[None]), eager.verify(tokens, depths, anc[None])
    assert ls.shape == le.shape == (1, 5, 320) and fs.shape == fe.shape
    assert torch.equal(gs, ge) and torch.equal(gs, ls.argmax(-1))
    torch.testing.assert_close(ls, le, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fs, fe, rtol=1e-4, atol=1e-4)
    for runner in (static, eager):
        runner.commit(keep([0, 1, 3, 4], 5))
    assert static.lengths == eager.length.tolist() == [prompt.shape[1] + 4]
    # the next step sees the compacted path: same logits as the eager reference, which crops by slicing
    (ls, _, _), (le, _, _) = static.verify(*chain([5])), eager.verify(*chain([5]))
    torch.testing.assert_close(ls, le, rtol=1e-4, atol=1e-4)
    assert static.cache.layers[0].keys.data_ptr() == address  # written in place, never reallocated


def test_buffers_grow_for_long_sequences_and_refuse_overflow():
    target = tiny_model("llama")
    runner = StaticRunner(target, [1], buckets=(1, 4))
    runner.reset(1, 16)
    assert runner.capacity == 256  # at least MIN_CAPACITY
    runner.reset(1, 300)
    assert runner.capacity == 384  # 300 + the largest bucket + a scratch slot, rounded up to a multiple of 128
    runner.prefill(torch.randint(3, 320, (1, 300)))
    with pytest.raises(RuntimeError, match="the KV buffers"):
        for _ in range(60):  # 4 tokens a step: 300 -> 380, then the next step does not fit
            runner.verify(*chain([5, 6, 7, 8]))
            runner.commit(keep([0, 1, 2, 3], 4))
    assert runner.lengths == [380]


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

    target = tiny_model("llama")  # float32
    kernel = kernel_op(torch.float32) is not None
    compiled = "drafthead_kernel" if kernel else "drafthead_matmul"
    assert StaticRunner(target, [], compile=True).attention == compiled
    assert StaticRunner(target, []).attention == ("drafthead_kernel" if kernel else None)


def test_sliding_window_target_falls_back_to_eager(capsys):
    """A sliding-window target runs on the eager runner (exact while the sequence fits the window)."""
    target = tiny_model("mistral", sliding_window=64)
    gen = SpeculativeGenerator(target, oracle_head(target).attach_target(target), tree="chain")
    ids = prompts(1, 320, seed=2)[0]
    ref = target.generate(ids, do_sample=False, max_new_tokens=12)
    assert torch.equal(gen.generate(ids, max_new_tokens=12).sequences, ref)
    assert isinstance(gen.runner, EagerRunner)
    assert "sliding-window" in capsys.readouterr().err
    with pytest.raises(NotImplementedError, match="sliding-window"):
        SpeculativeGenerator(target, None, tree="none", runner="static").runner
    with pytest.raises(NotImplementedError, match="sliding window"):
        gen.generate(ids, max_new_tokens=70)


@pytest.mark.slow
@pytest.mark.parametrize("compiled", ["plain", "verify"])
def test_compiled_runner_is_lossless_without_recompiles(compiled):
    """The target's compiled verify step, one case each: plain decoding (the one-token bucket, with inductor's GEMM
    templates) and a tree (the 8-token bucket). Greedy output identical to generate, and a second round of prompts
    of other lengths compiles nothing new, and torch's compiler settings are as they were. One-layer targets: what compiles is one layer's code, and each graph
    costs less to build."""
    import torch._inductor.config
    from torch._dynamo.utils import counters

    settings = torch._dynamo.config.get_config_copy(), torch._inductor.config.get_config_copy()
    target = near_bigram_target("llama", num_layers=1)
    head = oracle_head(target).attach_target(target)
    tree = TreeOptions(depth=2, top_k=2, total_tokens=4)
    if compiled == "plain":
        runner = StaticRunner(target, [], compile=True, buckets=(1,))
        gen = SpeculativeGenerator(target, None, tree="none", runner=runner)
    else:
        runner = StaticRunner(target, head.config.aux_layer_ids, compile=True, buckets=(8,))
        gen = SpeculativeGenerator(target, head, tree=tree, runner=runner)
    g = torch.Generator().manual_seed(4)
    batch = prompts(6, 320, seed=3) + [torch.randint(3, 320, (1, n), generator=g) for n in (40, 150)]
    gen.warmup(192)  # compiles the step for buffers that hold every prompt below
    assert {size for _, _, size in runner.shapes} == {runner.buckets[0]}
    graphs = counters["stats"]["unique_graphs"]
    for ids in batch:
        ref = target.generate(ids, do_sample=False, max_new_tokens=20)
        assert torch.equal(gen.generate(ids, max_new_tokens=20).sequences, ref), ids.tolist()
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile while generating
    if compiled != "plain":
        assert gen.generate(batch[0], max_new_tokens=20).stats.mean_accepted > 1.5
    # the compiler settings our steps need held only inside them: a user's own torch.compile sees its own settings
    assert (torch._dynamo.config.get_config_copy(), torch._inductor.config.get_config_copy()) == settings


def test_warmup_builds_only_the_buckets_a_drafter_can_use():
    """A head's trees always hold all their nodes: warmup builds their bucket alone (each bucket is a compiled graph,
    ~40 s on a GPU), and the one-token bucket too where plain steps may run (speculate="auto")."""
    target = near_bigram_target("llama", num_layers=1)
    head = oracle_head(target).attach_target(target)
    tree = TreeOptions(depth=2, top_k=2, total_tokens=5)  # 6 tokens with the root
    for speculate, built in (("always", [8]), ("auto", [1, 8])):
        runner = StaticRunner(target, head.config.aux_layer_ids, buckets=(1, 4, 8, 16))
        gen = SpeculativeGenerator(target, head, tree=tree, runner=runner, speculate=speculate)
        assert sorted(gen.warmup(32)) == built, speculate
        ids = prompts(1, 320, seed=2)[0]
        assert torch.equal(gen.generate(ids, max_new_tokens=12).sequences,
                           target.generate(ids, do_sample=False, max_new_tokens=12))
    assert sorted(SpeculativeGenerator(target, head, tree="none", hybrid=True, runner=runner).warmup(32)) == [1, 4, 8, 16]


def test_a_rows_buckets_share_one_compiled_graph_on_a_cpu():
    """On a CPU, one row's verify buckets (their linears on the small-row kernel), the one-token bucket included,
    share one compiled graph with the tree's size dynamic: one compile instead of one per bucket, and plain steps
    and trees of every size then verify through it losslessly, without another compile."""
    from torch._dynamo.utils import counters

    # (head_dim 32: the attention kernel's; up to 16 tokens: past them the kernel gives way, another graph)
    target = near_bigram_target("llama", num_layers=1, head_dim=32)
    runner = StaticRunner(target, [], compile=True, buckets=(1, 8, 12, 16))
    gen = SpeculativeGenerator(target, None, tree="none", hybrid=True, lookup_tokens=15, runner=runner)
    graphs = counters["stats"]["unique_graphs"]
    assert sorted(gen.warmup(96)) == [1, 8, 12, 16]
    assert counters["stats"]["unique_graphs"] == graphs + 1
    sizes = set()
    base = prompts(1, 320, seed=5)[0]
    repeated = torch.cat([target.generate(base, do_sample=False, max_new_tokens=24), base], dim=1)  # lookups hit
    for ids in (base, repeated):
        out = gen.generate(ids, max_new_tokens=24)
        assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=24)), ids.tolist()
        sizes.update(out.stats.accept_lengths)
    assert min(sizes) == 1 and max(sizes) > 1 and counters["stats"]["unique_graphs"] == graphs + 1


def test_a_stored_verify_step_is_loaded_not_traced_again(tmp_path):
    """A runner with a step store (tree="auto"'s) keeps its compiled verify step in a file; a later runner of the
    same model and buffers loads it instead of tracing the step again, and verifies through it losslessly. A
    damaged file costs a warning and a compile, which stores the step again."""
    from torch._dynamo.utils import counters

    target = near_bigram_target("llama", num_layers=1, head_dim=32)  # (the kernels' path: an unfrozen step)
    base = prompts(1, 320, seed=5)[0]
    repeated = torch.cat([target.generate(base, do_sample=False, max_new_tokens=20), base], dim=1)  # lookups hit

    def run() -> None:
        runner = StaticRunner(target, [], compile=True, buckets=(1, 8))
        runner.step_store = tmp_path
        gen = SpeculativeGenerator(target, None, tree="none", hybrid=True, lookup_tokens=7, runner=runner)
        gen.warmup(96)
        for ids in (base, repeated):
            out = gen.generate(ids, max_new_tokens=20)
            assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=20))
        assert max(out.stats.accept_lengths) > 1
        runner.close()

    run()
    files = list(tmp_path.iterdir())
    assert [f.name.split("-")[0] for f in files] == ["verify1xshared"]  # (its buffers' size and code digest after)
    graphs = counters["stats"]["unique_graphs"]
    run()
    assert counters["stats"]["unique_graphs"] == graphs  # loaded: nothing traced
    files[0].write_bytes(b"damaged")
    with pytest.warns(UserWarning, match="unreadable"):
        run()
    assert counters["stats"]["unique_graphs"] > graphs
    graphs = counters["stats"]["unique_graphs"]
    run()
    assert counters["stats"]["unique_graphs"] == graphs


def test_stored_drafting_steps_follow_their_buffers(tmp_path):
    """The head drafter's stored steps: one file per KV buffer shape (a longer prompt grows the buffers), each
    lossless; a later drafter loads them instead of tracing them again."""
    from torch._dynamo.utils import counters

    from inference.drafters.eagle import HeadDrafter

    target = near_bigram_target("llama", num_layers=1, head_dim=32)
    head = oracle_head(target).attach_target(target)
    longer = torch.randint(3, 320, (1, 300), generator=torch.Generator().manual_seed(7))

    def run() -> None:
        drafter = HeadDrafter(head, TreeOptions(depth=2, top_k=2, total_tokens=4), compile=True)
        runner = StaticRunner(target, head.config.aux_layer_ids)
        runner.step_store = tmp_path  # (the drafter keeps its steps in its runner's store)
        gen = SpeculativeGenerator(target, drafter, runner=runner)
        for ids in (prompts(1, 320, seed=6)[0], longer):
            out = gen.generate(ids, max_new_tokens=20)
            assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=20))
            assert out.stats.mean_accepted > 1.5

    run()
    assert len({f.name.split(".")[0] for f in tmp_path.glob("draft2_2_4-*.pt2")}) == 2
    graphs = counters["stats"]["unique_graphs"]
    run()
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_compiled_drafting_step_is_lossless_without_recompiles():
    """The head drafter's steady step (feed the accepted pairs, expand every depth, select) as one compiled graph
    beside an eager-verifying static runner: greedy output identical to generate, the prompt's feed eager (prompts
    of other lengths compile nothing new once warm), the graph used on every step after the first."""
    from torch._dynamo.utils import counters

    from inference.drafters.eagle import HeadDrafter

    target = near_bigram_target("llama", num_layers=1)
    head = oracle_head(target).attach_target(target)
    drafter = HeadDrafter(head, TreeOptions(depth=2, top_k=2, total_tokens=4), compile=True)
    calls = []
    gen = SpeculativeGenerator(target, drafter, runner=StaticRunner(target, head.config.aux_layer_ids))
    gen.warmup(192)
    step = drafter._step  # (the step of the buffers warmup() sized)
    drafter._step = lambda roots: calls.append(1) or step(roots)
    graphs = counters["stats"]["unique_graphs"]
    for ids in prompts(3, 320, seed=6) + [torch.randint(3, 320, (1, 77), generator=torch.Generator().manual_seed(7))]:
        calls.clear()
        ref = target.generate(ids, do_sample=False, max_new_tokens=20)
        out = gen.generate(ids, max_new_tokens=20)
        assert torch.equal(out.sequences, ref), ids.tolist()
        assert out.stats.mean_accepted > 1.5 and len(calls) == out.stats.target_forwards - 2  # all but the first
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_compiled_verify_steps_follow_their_buffers_when_they_grow():
    """The compiled steps skip the guards on the KV buffers (compile_step's `unguarded`): a sequence longer than
    the warmed-up buffers grows them, and the target's compiled steps are rebuilt for the new buffers (still equal
    to generate). One 8-token bucket: the small buckets' GEMM templates are the lossless test's subject."""
    target = near_bigram_target("llama", num_layers=2)
    head = oracle_head(target).attach_target(target)
    runner = StaticRunner(target, head.config.aux_layer_ids, compile=True, buckets=(8,))
    gen = SpeculativeGenerator(target, head, tree=TreeOptions(depth=3, top_k=2, total_tokens=6), runner=runner)
    gen.warmup(32)
    small = runner.capacity
    ids = torch.randint(3, 320, (1, 500), generator=torch.Generator().manual_seed(5))
    ref = target.generate(ids, do_sample=False, max_new_tokens=24)
    out = gen.generate(ids, max_new_tokens=24)
    assert runner.capacity > small and torch.equal(out.sequences, ref) and out.stats.mean_accepted > 1.5
    assert runner.cache.layers[0].keys[0, :, ids.shape[1] - 1].abs().sum() > 0  # the new buffer holds the prompt
    assert len({capacity for _, capacity, _ in runner.shapes}) == 2


def test_compiled_steps_write_in_place_only_into_inputs_of_fixed_address(monkeypatch):
    """On CUDA, inductor skips the CUDA graph of a step that writes in place into an input without a fixed, aligned
    address (a static input), and the step then pays every kernel launch. The same property checked on CPU, from
    AOTAutograd's metadata of every compiled step: the target's verify steps and the head's drafting step (two
    layers: the second layer's write position is where a misaligned view showed)."""
    import torch._guards
    from torch._dynamo.backends.common import aot_autograd

    import inference.runners.compile as compile_module

    graphs, loose = [], []

    def inspect(gm, example_inputs):
        meta = torch._guards.TracingContext.try_get().fw_metadata
        assert len(meta.input_info) == len(example_inputs)  # the graph's inputs are the step's, one for one
        graphs.append(gm)
        # a CUDA graph keeps a fixed address only for an aligned input (16 bytes): a misaligned one is copied
        loose.extend(i for i, (info, x) in enumerate(zip(meta.input_info, example_inputs)) if info.mutates_data and (
            i not in meta.static_input_indices or x.storage_offset() * x.element_size() % 16))
        return gm

    real = torch.compile

    def compile_inspected(fn, **kwargs):
        kwargs.pop("options", None)
        return real(fn, backend=aot_autograd(fw_compiler=inspect), **kwargs)

    monkeypatch.setattr(compile_module.torch, "compile", compile_inspected)
    target = near_bigram_target("llama", num_layers=2)
    head = oracle_head(target).attach_target(target)
    gen = SpeculativeGenerator(target, head, tree="chain", compile=True)
    gen.warmup(64)
    for ids in prompts(2, 320, seed=4):
        assert torch.equal(gen.generate(ids, max_new_tokens=12).sequences,
                           target.generate(ids, do_sample=False, max_new_tokens=12))
    assert len(graphs) >= 2 and loose == []


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
    """A frozen graph bakes in its weights and an unfrozen one (steps on the small-row kernels) reads them as inputs
    of a graph cached by its code alone: two targets compiled in one process must each run their own weights.
    (Two-layer targets, one 8-token verify bucket: inductor's GEMM templates of the small buckets, costly to tune,
    are test_compiled_runner_is_lossless_without_recompiles' subject.)"""
    a, b = tiny_model("llama", seed=0, num_layers=2), tiny_model("llama", seed=1, num_layers=2)
    prompt = prompts(1, 320, seed=7)[0]
    for model in (a, b):
        runner = StaticRunner(model, [], compile=True, buckets=(8,))
        runner.reset(1, 32)
        with torch.inference_mode():
            runner.prefill(prompt[:, :-1])
            logits, _, _ = runner.verify(*chain(prompt[0, -1:].tolist()))
            ref = model(prompt).logits[:, -1:]
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


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
from inference import DraftTree
from inference.runners.static import StaticRunner
assert not hasattr(torch.ops.drafthead_kernels, "small_linear")
target = tiny_model("llama", num_layers=2)
ids = torch.randint(3, 320, (1, 12), generator=torch.Generator().manual_seed(0))
logits = {}
for compile in (False, True):
    runner = StaticRunner(target, [0, 1], compile=compile, buckets=(8,))
    with runner.session(), torch.inference_mode():
        runner.reset(1, 16)
        runner.prefill(ids[:, :8])
        tree = DraftTree.chain(ids[:, 8], ids[:, 9:])
        logits[compile] = runner.verify(tree.tokens, tree.depths, tree.ancestors)[0]
assert torch.allclose(logits[False], logits[True], atol=1e-4), (logits[False] - logits[True]).abs().max()
"""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}:{root / 'tests'}"}
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
