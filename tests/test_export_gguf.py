"""Export to llama.cpp's GGUF: the file equals what llama.cpp's own converter wrote for the same tiny head
(tests/data/eagle3_gguf_manifest.json, recorded by scripts/record_gguf_manifest.py), and its tensors are the head's.

Real-marked: the target's tokenizer is SmolLM2's (llama.cpp names only real tokenizers); its weights are not read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import state_sha256, tiny_gguf_case, tiny_head, tiny_model

from drafthead.export import export_head, main
from drafthead.export_gguf import gguf_manifest, read_gguf

MANIFEST = json.loads((Path(__file__).parent / "data" / "eagle3_gguf_manifest.json").read_text())
RERECORD = "re-record tests/data/eagle3_gguf_manifest.json with scripts/record_gguf_manifest.py"
pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def case(smollm2_path, tmp_path_factory):
    return tiny_gguf_case(tmp_path_factory.mktemp("gguf"), smollm2_path)


def llama_cpp_rows(n_head: int, rows: int) -> torch.Tensor:
    """Where llama.cpp's q/k row i comes from: within each head, row 2j is HF row j and row 2j+1 is HF row j+d/2."""
    d = rows // n_head
    within = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], dim=1).reshape(d)
    return (torch.arange(n_head)[:, None] * d + within).reshape(rows)


@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_gguf_equals_llama_cpp_converter(case, tmp_path, outtype):
    head_dir, target_dir, head = case
    assert state_sha256(head) == MANIFEST["head_sha256"], f"the tiny head changed: {RERECORD}"
    out = tmp_path / "head.gguf"
    assert main([str(head_dir), str(out), "--format", "gguf", "--target", str(target_dir), "--outtype", outtype]) == 0
    ours, theirs = gguf_manifest(out), MANIFEST["outputs"][outtype]
    assert list(ours["metadata"]) == list(theirs["metadata"])  # same keys, in the converter's order
    for key, field in theirs["metadata"].items():
        assert ours["metadata"][key] == field, key
    assert ours["tensors"] == theirs["tensors"]  # names, order, shapes, types and bytes
    assert ours["metadata"]["eagle3.target_layers"]["value"] == [k + 1 for k in head.config.aux_layer_ids]

    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64}
    tensors = {name: torch.frombuffer(bytearray(raw), dtype=dtypes[kind]).reshape(shape[::-1]).float()
               if kind != "I64" else torch.frombuffer(bytearray(raw), dtype=torch.int64)
               for name, (shape, kind, raw) in read_gguf(out)[1].items()}
    state = {k: v.detach().float() for k, v in head.saved_state_dict().items()}
    cfg = head.config
    q, k = state["midlayer.self_attn.q_proj.weight"], state["midlayer.self_attn.k_proj.weight"]
    expected = {
        "fc.weight": state["fc.weight"],
        "output.weight": state["lm_head.weight"],
        "output_norm.weight": state["norm.weight"],
        "blk.0.attn_norm.weight": state["midlayer.input_layernorm.weight"],
        "blk.0.attn_norm_2.weight": state["midlayer.hidden_norm.weight"],
        "blk.0.ffn_norm.weight": state["midlayer.post_attention_layernorm.weight"],
        "blk.0.attn_q.weight": q[llama_cpp_rows(cfg.num_attention_heads, len(q))],
        "blk.0.attn_k.weight": k[llama_cpp_rows(cfg.num_key_value_heads, len(k))],
        "blk.0.attn_v.weight": state["midlayer.self_attn.v_proj.weight"],
        "blk.0.attn_output.weight": state["midlayer.self_attn.o_proj.weight"],
        "blk.0.ffn_gate.weight": state["midlayer.mlp.gate_proj.weight"],
        "blk.0.ffn_up.weight": state["midlayer.mlp.up_proj.weight"],
        "blk.0.ffn_down.weight": state["midlayer.mlp.down_proj.weight"],
    }
    assert set(tensors) == set(expected) | {"d2t"}  # t2d is left out
    for name, value in expected.items():
        if outtype == "bf16" and value.dim() == 2:
            value = value.bfloat16().float()
        assert torch.equal(tensors[name], value), name
    d2t = state["d2t"].long()
    assert torch.equal(tensors["d2t"], d2t + torch.arange(len(d2t)))  # absolute target ids
    assert torch.equal(head.t2d.nonzero().flatten(), tensors["d2t"].sort().values)


def test_gguf_export_refusals(case, tmp_path, capsys):
    head_dir, target_dir, _ = case
    out = tmp_path / "head.gguf"
    assert main([str(head_dir), str(out), "--format", "gguf"]) == 1
    assert "needs --target" in capsys.readouterr().err
    assert main([str(head_dir), str(out), "--format", "gguf", "--target", str(head_dir.parent / "none")]) == 1
    assert "--target must be the target's model folder" in capsys.readouterr().err
    out.write_bytes(b"")
    assert main([str(head_dir), str(out), "--format", "gguf", "--target", str(target_dir)]) == 1
    assert "--force" in capsys.readouterr().err
    eagle1 = export_head(tiny_head(tiny_model("llama"), "eagle1"), tmp_path / "eagle1")
    assert main([str(eagle1), str(out), "--format", "gguf", "--target", str(target_dir), "--force"]) == 1
    assert "EAGLE-3 heads only" in capsys.readouterr().err
    assert not list(tmp_path.glob(".head.gguf*"))  # no temp file left behind
