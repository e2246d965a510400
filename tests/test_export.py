"""Export to the vLLM/SGLang layout: names, config, reload, the validator's specific errors, and the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import tiny_head, tiny_model

from drafthead import HeadMismatchError, load_head, save_head
from drafthead.export import export_head
from drafthead.validate import ExportValidationError, validate_export
from drafthead.vocab import build_draft_vocab

REPO = Path(__file__).resolve().parent.parent
LAYER = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj"]
EAGLE3_NAMES = (
    {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    | {f"midlayer.{m}.weight" for m in LAYER}
    | {f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
)
EAGLE1_NAMES = {"fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight"} | {
    f"layers.0.{m}.weight" for m in LAYER
}


@torch.no_grad()
def logits_of(head, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    cfg = head.config
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=gen)
    feats = torch.randn(2, 7, cfg.feature_size if cfg.kind == "eagle3" else cfg.hidden_size, generator=gen)
    return head.logits(head(ids, head.fuse(feats), torch.arange(7).expand(2, 7)))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_export_reload_identical_logits(tmp_path, arch, kind):
    target = tiny_model(arch)
    head = tiny_head(target, kind, aux_layer_ids=[0, 3, 6] if kind == "eagle3" else None)
    save_head(head, tmp_path / "native")
    export_head(tmp_path / "native", tmp_path / "serving")
    out = tmp_path / "serving"
    names = set(load_file(str(out / "model.safetensors")))
    assert names == (EAGLE3_NAMES if kind == "eagle3" else EAGLE1_NAMES)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["max_position_embeddings"] == target.config.max_position_embeddings
    assert cfg["rope_theta"] == target.config.rope_parameters["rope_theta"]
    assert cfg["vocab_size"] == target.config.vocab_size
    if kind == "eagle3":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 3, 6], "use_aux_hidden_state": True}
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 4, 7]
        assert cfg["draft_vocab_size"] == head.config.draft_vocab_size
        assert cfg["target_hidden_size"] == target.config.hidden_size
    else:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle"]
    reloaded = load_head(out, target=target, kind=kind)
    assert reloaded.config == head.config
    assert torch.equal(logits_of(reloaded), logits_of(head))
    # a folder without our own key (a third-party export) loads from the serving fields + the target
    del cfg["drafthead_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="pass the target"):
        load_head(out)
    foreign = load_head(out, target=target)
    assert foreign.config.aux_layer_ids == head.config.aux_layer_ids
    assert torch.equal(logits_of(foreign), logits_of(head))


def test_export_keeps_bf16(tmp_path):
    target = tiny_model("llama")
    head = tiny_head(target, "eagle3").to(torch.bfloat16)
    save_head(head, tmp_path / "native")
    export_head(tmp_path / "native", tmp_path / "serving")
    state = load_file(str(tmp_path / "serving" / "model.safetensors"))
    assert state["fc.weight"].dtype == torch.bfloat16 and state["d2t"].dtype == torch.int64
    cfg = json.loads((tmp_path / "serving" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["rope_scaling"] is None  # default rope: no scaling block
    assert (tmp_path / "serving" / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable by a server


def test_export_mismatched_target_refused(tmp_path):
    target = tiny_model("llama")
    export_head(tiny_head(target, "eagle3"), tmp_path / "serving")
    with pytest.raises(HeadMismatchError, match="vocab_size"):
        load_head(tmp_path / "serving", target=tiny_model("llama", vocab_size=400))


def test_export_refuses_wrong_format_and_overwrite(tmp_path):
    target = tiny_model("llama")
    head = tiny_head(target, "eagle1")
    with pytest.raises(ValueError, match="cannot be exported as eagle3"):
        export_head(head, tmp_path / "a", fmt="eagle3")
    assert not (tmp_path / "a").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temp folder left behind
    export_head(head, tmp_path / "a")
    with pytest.raises(FileExistsError, match="--force"):
        export_head(head, tmp_path / "a")
    export_head(tiny_head(target, "eagle3"), tmp_path / "a", force=True)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


# ------------------------------------------------------------------------------------------- validator
@pytest.fixture(scope="module")
def good_export(tmp_path_factory):
    target = tiny_model("llama")
    head = tiny_head(target, "eagle3")
    folder = tmp_path_factory.mktemp("export") / "good"
    export_head(head, folder)
    return folder, head


def _corrupt_tensors(folder: Path, change) -> None:
    state = load_file(str(folder / "model.safetensors"))
    change(state)
    save_file(state, str(folder / "model.safetensors"))


def _corrupt_config(folder: Path, change) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def _rename_layers(state):
    for k in [k for k in state if k.startswith("midlayer.")]:
        state["layers.0." + k[len("midlayer."):]] = state.pop(k)


def _out_of_range(state):
    state["d2t"][-1] += 1000


def _duplicate_target(state):
    state["d2t"][1] = state["d2t"][0] - 1  # draft ids 0 and 1 both map to the same target id


def _flip_t2d(state):
    state["t2d"][(~state["t2d"]).nonzero()[0]] = True


CASES = {
    "missing d2t": (lambda s: s.pop("d2t"), None, "missing 'd2t'"),
    "missing t2d": (lambda s: s.pop("t2d"), None, "missing 't2d'"),
    "layers.0 names": (_rename_layers, None, "layers.0.*; SGLang silently drops"),
    "unknown name": (lambda s: s.__setitem__("extra.weight", torch.zeros(2)), None, r"unknown tensor names.*extra"),
    "missing tensor": (lambda s: s.pop("norm.weight"), None, r"missing tensors: \['norm.weight'\]"),
    "wrong shape": (lambda s: s.__setitem__("fc.weight", s["fc.weight"][:, :-1].clone()), None,
                    r"fc.weight has shape \(64, 191\), config.json implies \(64, 192\)"),
    "d2t out of range": (_out_of_range, None, "d2t out of range: draft id 199"),
    "d2t duplicate": (_duplicate_target, None, "several draft ids map to the same target id"),
    "t2d inconsistent": (_flip_t2d, None, "d2t is inconsistent with t2d"),
    "missing key": (None, lambda c: c.pop("max_position_embeddings"), "missing key 'max_position_embeddings'"),
    "missing eagle_config": (None, lambda c: c.pop("eagle_config"), "missing key 'eagle_config'"),
    "draft vocab": (None, lambda c: c.__setitem__("draft_vocab_size", 100),
                    "draft_vocab_size 100 in config.json disagrees with lm_head.weight, which has 200 rows"),
    "aux shift": (None, lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids",
                                                c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
                  "aux layer ids disagree"),
    "architecture": (None, lambda c: c.__setitem__("architectures", ["LlamaForCausalLM"]), "architectures"),
    "own key": (None, lambda c: c["drafthead_config"].__setitem__("aux_layer_ids", [1, 2, 3]),
                "drafthead_config.aux_layer_ids disagrees"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_validator_rejects(good_export, tmp_path, case):
    good, head = good_export
    validate_export(good, head=head)  # the untouched export passes
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    tensors, config, message = CASES[case]
    if tensors:
        _corrupt_tensors(bad, tensors)
    if config:
        _corrupt_config(bad, config)
    with pytest.raises(ExportValidationError, match=message):
        validate_export(bad)


def test_validator_rejects_logit_mismatch(good_export):
    good, head = good_export
    other = tiny_head(tiny_model("llama"), "eagle3", seed=1)  # same shapes, different weights
    with pytest.raises(ExportValidationError, match="does not reproduce the head's logits"):
        validate_export(good, head=other)


def test_cli_exports_and_refuses_overwrite(tmp_path, capsys):
    save_head(tiny_head(tiny_model("qwen2"), "eagle3"), tmp_path / "native")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "drafthead.export", str(tmp_path / "native"), str(tmp_path / "out")]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "validated" in first.stdout
    validate_export(tmp_path / "out")
    from drafthead.export import main  # the same entry point in-process (a second subprocess costs ~10 s here)

    assert main([str(tmp_path / "native"), str(tmp_path / "out"), "--format", "eagle3"]) == 1
    assert "--force" in capsys.readouterr().err
    assert main([str(tmp_path / "native"), str(tmp_path / "out"), "--force"]) == 0


@pytest.mark.real
def test_export_smollm2_head_loads_on_the_real_target(smollm2, tmp_path):
    """A SmolLM2-shaped EAGLE-3 head (draft vocab 32000) exports, validates and reloads against the real target."""
    from drafthead import DraftHead, HeadConfig
    from drafthead.utils import place_module

    config = HeadConfig.from_target_config(smollm2.config, kind="eagle3", draft_vocab_size=32000)
    # placed as load_head places it (the rotary frequencies stay float32)
    head = place_module(DraftHead(config), dtype=torch.bfloat16).attach_target(smollm2)
    head.t2d.fill_(True)  # a t2d that disagrees with d2t must not be published
    with pytest.raises(ExportValidationError, match="inconsistent with t2d"):
        export_head(head, tmp_path / "serving")
    assert not (tmp_path / "serving").exists()
    d2t, t2d = build_draft_vocab(torch.randint(0, 1000, (config.vocab_size,)), config.draft_vocab_size)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    export_head(head, tmp_path / "serving")
    cfg = json.loads((tmp_path / "serving" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert (cfg["rope_theta"], cfg["max_position_embeddings"], cfg["target_hidden_size"]) == (100000.0, 8192, 576)
    loaded = load_head(tmp_path / "serving", target=smollm2, kind="eagle3", dtype=torch.bfloat16)
    assert torch.equal(logits_of(loaded.float()), logits_of(head.float()))
