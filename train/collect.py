"""Collect target features: one target forward per prepared sequence, hidden states written as bf16 shards.

    python -m train.collect configs/smollm2-135m-eagle3.yaml [features.batch_tokens=8192 ...]
    accelerate launch --num_processes 2 -m train.collect RECIPE     # rank r takes shards i with i % W == r

The "train" split goes to features.dir and "validation" to features.validation_dir (default
features.dir/validation). Shard i holds sequences [i·S, (i+1)·S) of the split in their prepared order. Within a
shard, sequences are sorted by length and packed into right-padded batches of at most features.batch_tokens
padded tokens. Right padding needs no attention mask: attention is causal, so a real token never sees a pad.
One forward of the base model (no lm_head) with HiddenStateCapture records the aux layers and the last decoder
layer (pre-norm) together. A finished shard is listed in the manifest only after its file is renamed into
place, so re-running the same command skips it; a killed run redoes only the shard it was writing. The manifest
records what the features were made from (the prepared split's content, the target's config and weights, its
dtype, the aux layers): a folder holding features of other inputs is refused, never extended or reused.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm import tqdm

from drafthead.capture import HiddenStateCapture, decoder_layers
from drafthead.config import default_aux_layer_ids
from drafthead.errors import DataError, PathNotFound
from drafthead.hardware import resolve_device
from drafthead.utils import atomic_write_json, dtype_name
from train.features import MANIFEST, FeatureWriter, Sequence, shard_name
from train.fingerprint import split_fingerprint, weights_fingerprint
from train.recipe import Recipe, parse_recipe
from train.recipe_help import recipe_main
from train.target import load_target, target_config_hash, target_name

FEATURE_DTYPE = torch.bfloat16


def rank_and_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the launcher's environment (accelerate launch / torchrun set them)."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)))


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped into batches, sorted by length, each with (batch size × longest) <= batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda j: (lengths[j], j))
    batches: list[list[int]] = []
    current: list[int] = []
    for j in order:  # ascending lengths: the newest member is the longest
        if current and (len(current) + 1) * lengths[j] > batch_tokens:
            batches.append(current)
            current = []
        current.append(j)
    if current:
        batches.append(current)
    return batches


@torch.no_grad()
def forward_features(
    model: Any, batch: list[list[int]], aux_layer_ids: list[int], last_layer_id: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One forward over right-padded `batch`; per sequence yields (aux_hidden (T, k·H), last_hidden (T, H)), bf16, CPU."""
    longest = max(len(ids) for ids in batch)
    input_ids = torch.zeros(len(batch), longest, dtype=torch.long)  # (B, T), pad id 0: never attended (causal)
    for b, ids in enumerate(batch):
        input_ids[b, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    with HiddenStateCapture(model, aux_layer_ids + [last_layer_id]) as cap:
        model.get_decoder()(input_ids=input_ids.to(device), use_cache=False)  # base model: no lm_head logits
    aux = cap.stacked(aux_layer_ids).to(device="cpu", dtype=FEATURE_DTYPE)  # (B, T, k·H)
    last = cap.outputs[last_layer_id].to(device="cpu", dtype=FEATURE_DTYPE)  # (B, T, H)
    for b, ids in enumerate(batch):
        yield aux[b, : len(ids)], last[b, : len(ids)]


def shard_tokens(split: Any, index: int, shard_sequences: int) -> int:
    """Token count of shard `index`, read from the arrow list lengths (no Python lists of ids)."""
    import pyarrow.compute as pc

    rows = split.with_format("arrow")[index * shard_sequences : (index + 1) * shard_sequences]
    return int(pc.sum(pc.list_value_length(rows["input_ids"])).as_py() or 0)


@contextmanager
def manifest_lock(folder: Path):
    """Exclusive file lock, so ranks sharing a features folder update the manifest one at a time."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".manifest.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _reload(writer: FeatureWriter) -> None:
    """Pick up shards other ranks have finished since this writer read the manifest."""
    path = writer.folder / MANIFEST
    if path.exists():
        writer.manifest["shards"] = json.loads(path.read_text())["shards"]


def collect_split(
    model: Any, split: Any, folder: str | Path, header: dict, aux_layer_ids: list[int], shard_sequences: int,
    batch_tokens: int, device: torch.device, rank: int = 0, world: int = 1, desc: str = "collect",
) -> dict:
    """Write every shard of `split` (a datasets split with input_ids, loss_mask) owned by this rank into `folder`."""
    folder = Path(folder)
    last_layer_id = len(decoder_layers(model)) - 1
    num = len(split)
    num_shards = math.ceil(num / shard_sequences)
    header = {**header, "aux_layer_ids": list(aux_layer_ids), "last_layer_id": last_layer_id,
              "dtype": dtype_name(FEATURE_DTYPE), "shard_sequences": shard_sequences, "num_sequences_planned": num}
    with manifest_lock(folder):
        for stale in folder.glob(f".{MANIFEST}.*.tmp"):  # a run killed mid-write; under the lock no one else writes it
            stale.unlink(missing_ok=True)
        writer = FeatureWriter(folder, header)
        _reload(writer)
        if num_shards == 0 and rank == 0 and not (folder / MANIFEST).exists():
            atomic_write_json(folder / MANIFEST, writer.manifest)  # an empty split still gets a manifest
    mine = [i for i in range(num_shards) if i % world == rank and not writer.done(i)]
    skipped = sum(1 for i in range(num_shards) if i % world == rank) - len(mine)
    for i in mine:  # temp files a killed run left behind (only this rank's shards: others may be writing)
        for stale in folder.glob(f".{shard_name(i)}.*.tmp"):
            stale.unlink(missing_ok=True)
    total = sum(shard_tokens(split, i, shard_sequences) for i in mine)
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc=f"{desc} rank {rank}", disable=total == 0)
    for i in mine:
        rows = split[i * shard_sequences : (i + 1) * shard_sequences]
        ids, masks = rows["input_ids"], rows["loss_mask"]
        out: list[Sequence | None] = [None] * len(ids)
        for batch in length_batches([len(x) for x in ids], batch_tokens):
            feats = forward_features(model, [ids[j] for j in batch], aux_layer_ids, last_layer_id, device)
            for j, (aux, last) in zip(batch, feats):
                out[j] = Sequence(torch.as_tensor(ids[j], dtype=torch.int32),
                                  torch.as_tensor(masks[j], dtype=torch.bool), aux, last)
                bar.update(len(ids[j]))
        with manifest_lock(folder):
            _reload(writer)
            writer.write_shard(i, out)  # shard file renamed into place first, then the manifest
    bar.close()
    return {"shards_written": len(mine), "shards_skipped": skipped, "tokens": total}


def collect(recipe: Recipe | dict) -> dict:
    """Collect the splits named by features.splits (default train and validation) of data.prepared_dir."""
    from datasets import load_from_disk

    recipe = parse_recipe(recipe)
    feats = recipe.features
    rank, world, local_rank = rank_and_world()
    device = resolve_device(recipe.device, local_rank)
    prepared = Path(recipe.data.prepared_dir)
    if not prepared.exists():
        raise PathNotFound(f"{prepared} not found: run `python -m train.prepare RECIPE` first")
    data = load_from_disk(str(prepared))
    # features are stored bf16 either way; 'auto' computes them in bf16 only where the hardware is native bf16
    model = load_target(recipe.target, device=device, dtype=feats.target_dtype or recipe.dtype)
    print(f"[collect] device={device} dtype={dtype_name(model.dtype)} target={recipe.target} rank {rank}/{world}",
          flush=True)
    aux = recipe.head.aux_layer_ids or default_aux_layer_ids(len(decoder_layers(model)))
    header = {"target": target_name(recipe.target), "target_config_hash": target_config_hash(recipe.target),
              "target_weights": weights_fingerprint(recipe.target),
              "hidden_size": int(model.config.get_text_config().hidden_size),
              "target_dtype": dtype_name(model.dtype)}
    results = {}
    for name in feats.splits or ["train", "validation"]:
        if name not in data:
            raise DataError(f"{prepared} has no split {name!r} (it has {list(data)}): check features.splits")
        results[name] = collect_split(
            model, data[name], feats.split_dir(name), {**header, "data_fingerprint": split_fingerprint(data[name])},
            list(aux),
            feats.shard_sequences, feats.batch_tokens, device, rank, world, desc=name,
        )
        print(f"{name}: {results[name]}")
    return results


if __name__ == "__main__":
    recipe_main(collect, __doc__)
