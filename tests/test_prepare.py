"""train.prepare: reading (ShareGPT / OpenAI / datasets), malformed lines, id-root split, arrow output."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from drafthead.errors import DataError
from train.conversations import BadRecord, read_conversations
from train.prepare import id_root, is_validation, prepare


def sharegpt(cid: str, reply: str = "the quick brown fox", user: str = "hello world") -> dict:
    return {"id": cid, "conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": reply}]}


def write_jsonl(path, records) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def recipe(target, conversations, out, **data) -> dict:
    return {"target": str(target),
            "data": {"conversations": str(conversations), "prepared_dir": str(out), "max_length": 64,
                     "max_conversations": None, "validation_fraction": 0.5, "skip_bad": False, "seed": 0,
                     "num_proc": 1, **data}}


def test_formats_and_roles(tmp_path):
    path = tmp_path / "mixed.jsonl"
    write_jsonl(path, [
        {"id": "a", "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "u"},
                                      {"from": "bing", "value": "?"}, {"from": "gpt", "value": "g"}]},
        {"id": "b", "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "g"}]},
    ])
    stats = Counter()
    convs = read_conversations(path, stats=stats)
    assert [c["id"] for c in convs] == ["a", "b"]
    assert [m["role"] for m in convs[0]["messages"]] == ["system", "user", "assistant"]
    assert convs[1]["messages"] == [{"role": "user", "content": "u"}, {"role": "assistant", "content": "g"}]
    assert stats["skipped_turns_role_bing"] == 1
    assert len(read_conversations(path, limit=1)) == 1

    from datasets import Dataset

    folder = tmp_path / "ds"
    Dataset.from_list([sharegpt("x_0"), sharegpt("x_1")]).save_to_disk(str(folder))
    assert [c["id"] for c in read_conversations(folder)] == ["x_0", "x_1"]


@pytest.mark.parametrize("bad, why", [("{not json", "invalid JSON"), ('{"id": "q"}', "no 'conversations'"),
                                      ('{"conversations": [{"from": "gpt", "value": 3}]}', "must be a string")])
def test_malformed_line_names_file_and_line(tmp_path, bad, why):
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, [sharegpt("a_0"), "", bad, sharegpt("b_0")])  # the bad record is on line 3
    with pytest.raises(BadRecord, match=rf"{path}:3: .*{why}"):
        read_conversations(path)
    stats = Counter()
    assert [c["id"] for c in read_conversations(path, skip_bad=True, stats=stats)] == ["a_0", "b_0"]
    assert stats["skipped_bad_records"] == 1


def test_id_root_split_is_deterministic_and_keeps_chats_together():
    assert id_root("QWJhYvA_12") == "QWJhYvA" and id_root("a_b_0") == "a_b" and id_root("plain") == "plain"
    ids = [f"chat{n}_{k}" for n in range(200) for k in range(3)]
    split = {i: is_validation(i, 0.3) for i in ids}
    for n in range(200):
        assert split[f"chat{n}_0"] == split[f"chat{n}_1"] == split[f"chat{n}_2"]
    assert 0.2 < sum(split.values()) / len(ids) < 0.4
    assert split == {i: is_validation(i, 0.3) for i in ids}
    assert split != {i: is_validation(i, 0.3, seed=1) for i in ids}


def test_prepare_end_to_end(tmp_path, tiny_target_dir):
    from datasets import load_from_disk

    path = tmp_path / "convs.jsonl"
    records = [sharegpt(f"c{n}_{k}", reply="the lazy dog " * (n % 3 + 1)) for n in range(12) for k in range(2)]
    records += [
        {"id": "nouser_0", "conversations": [{"from": "human", "value": "hello"}]},  # no assistant turn
        sharegpt("long_0", user="hello world " * 60),  # the reply is cut off by max_length=64
        "[1, 2]",  # malformed (line 27)
    ]
    write_jsonl(path, records)
    out = tmp_path / "prepared"
    with pytest.raises(DataError, match=rf"{path}:27.*data.skip_bad=true"):
        prepare(recipe(tiny_target_dir, path, out))
    assert not out.exists()

    stats = prepare(recipe(tiny_target_dir, path, out, skip_bad=True))
    assert stats["skipped_bad_records"] == 1
    assert stats["dropped_no_assistant_turn"] == 1
    assert stats["dropped_no_assistant_token_after_truncation"] == 1
    assert stats["kept"] == 24 == stats["train_conversations"] + stats["validation_conversations"]
    assert 0 < stats["masked_fraction"] < 1

    data = load_from_disk(str(out))
    assert set(data) == {"train", "validation"} and len(data["train"]) and len(data["validation"])
    for split in data.values():
        assert split.features["input_ids"].feature.dtype == "int32"
        assert split.features["loss_mask"].feature.dtype == "bool"
        assert split.features["id"].dtype == "string"
    roots = {name: {id_root(i) for i in split["id"]} for name, split in data.items()}
    assert not roots["train"] & roots["validation"]

    from train.target import load_tokenizer

    tok = load_tokenizer(tiny_target_dir)
    row = data["train"][0]
    masked = tok.decode([i for i, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert masked.startswith("the lazy dog") and masked.endswith("<|im_end|>")

    # re-running replaces the folder atomically; max_conversations takes the first N
    stats = prepare(recipe(tiny_target_dir, path, out, max_conversations=4))
    again = load_from_disk(str(out))
    assert stats["kept"] == 4 and len(again["train"]) + len(again["validation"]) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["convs.jsonl", "prepared"]


def test_regenerate_replaces_assistant_turns_and_resumes(tmp_path, tiny_target_dir):
    from train.regenerate import generate_replies, regenerate, replier
    from train.target import load_target, load_tokenizer

    path = tmp_path / "convs.jsonl"
    convs = [{"id": f"r{n}", "conversations": [{"from": "human", "value": "hello world " * (3 - n)},
                                               {"from": "gpt", "value": "old"}, {"from": "human", "value": "fox"},
                                               {"from": "gpt", "value": "old"}]} for n in range(3)]
    write_jsonl(path, convs)
    out = tmp_path / "regen.jsonl"
    r = recipe(tiny_target_dir, path, tmp_path / "unused", max_length=256)
    r.update(device="cpu", dtype="float32")
    r["data"]["regenerate"] = {"output": str(out), "max_new_tokens": 5, "batch_size": 1, "chunk_conversations": 2}
    assert regenerate(r) == out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["id"] for row in rows] == ["r0", "r1", "r2"]
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert all(m["content"] != "old" for row in rows for m in row["messages"])

    # r1's first reply (one row decoding, r1 waiting for it in the queue: prefilled apart, then admitted into the
    # row r2 freed) equals transformers' own greedy reply to that prompt alone, and the engine's reply alone
    model, tok = load_target(tiny_target_dir, "cpu", "float32"), load_tokenizer(tiny_target_dir)
    ids = tok.apply_chat_template(rows[1]["messages"][:1], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    hf = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert rows[1]["messages"][1]["content"] == tok.decode(hf[0, ids.shape[1]:], skip_special_tokens=True).strip()
    alone, _ = generate_replies(replier(model, tok), tok, [rows[1]["messages"][:1]], max_new_tokens=5)
    assert rows[1]["messages"][1]["content"] == alone[0]
    assert read_conversations(out)[2]["messages"] == rows[2]["messages"]  # usable as data.conversations

    chunks = sorted((tmp_path / "regen.jsonl.chunks").iterdir())
    assert len(chunks) == 2
    # processed shortest prompt first (r2, r1 | r0), joined in the input's order
    assert [[json.loads(line)["id"] for line in c.read_text().splitlines()] for c in chunks] == [["r2", "r1"], ["r0"]]
    stamps = [c.stat().st_mtime_ns for c in chunks]
    chunks[1].unlink()  # as if killed during the second chunk
    regenerate(r)
    assert chunks[0].stat().st_mtime_ns == stamps[0] and chunks[1].exists()
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows  # greedy: same result
    r["data"]["regenerate"]["max_new_tokens"] = 3  # another plan: its own chunks, none of the old ones reused
    regenerate(r)
    assert len(list((tmp_path / "regen.jsonl.chunks").iterdir())) == 4
    assert all(len(m["content"]) < 40 for row in read_conversations(out) for m in row["messages"][1::2])
