"""Offline feature store: bf16 safetensors shards of target hidden states, with a manifest.

Layout of a feature folder:
    manifest.json                 target name + config hash + weights fingerprint, the prepared data's fingerprint,
                                  aux ids, dtype, sizes, and the FINISHED shards
    shard-00000.safetensors       many sequences concatenated on the token axis:
        input_ids   int32 (N,)            loss_mask  bool (N,)
        offsets     int64 (n+1,)          sequence j is tokens offsets[j]:offsets[j+1]
        aux_hidden  bf16  (N, k·H)        outputs of the aux layers, concatenated in manifest order
        last_hidden bf16  (N, H)          output of the last decoder layer, before the final norm

Shard i always holds sequences [i·S, (i+1)·S) of the prepared data (S = shard_sequences), so a killed run
re-plans the same shards and writes only the missing ones. A shard file is written to a temp name and
renamed; the manifest is rewritten (also atomically) only after that, so it never lists a partial shard.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from drafthead.errors import DataError
from drafthead.utils import atomic_save_safetensors, atomic_write_json
from train.fingerprint import differences

FORMAT = "drafthead-features/1"
MANIFEST = "manifest.json"
# what a manifest's features were made from: a folder is only ever extended by a run with the same values
CHECKED = ("target_config_hash", "target_weights", "target_dtype", "data_fingerprint", "aux_layer_ids",
           "last_layer_id", "shard_sequences", "num_sequences_planned")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def config_hash(config: Any) -> str:
    """A stable hash of a target's config (so features are never mixed across targets)."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    values = {k: v for k, v in values.items() if not k.startswith("_") and k not in ("transformers_version",)}
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class Sequence:
    """One collected sequence (CPU tensors)."""

    input_ids: torch.Tensor  # (T,) int
    loss_mask: torch.Tensor  # (T,) bool
    aux_hidden: torch.Tensor  # (T, k·H) bf16
    last_hidden: torch.Tensor  # (T, H) bf16


class FeatureWriter:
    """Writes shards and keeps the manifest in step. `header` holds target/aux/dtype/size fields."""

    def __init__(self, folder: str | Path, header: dict):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / MANIFEST
        if path.exists():
            manifest = json.loads(path.read_text())
            changed = differences(manifest, {key: header[key] for key in CHECKED if key in header})
            if changed:
                raise DataError(f"{self.folder} holds features of other inputs ({'; '.join(changed)}): collect "
                                "into another features.dir, or delete that folder to collect again")
        else:
            manifest = {"format": FORMAT, **header, "shards": []}
        self.manifest = manifest

    def done(self, index: int) -> bool:
        """True if shard `index` is listed in the manifest and its file exists."""
        return any(s["index"] == index for s in self.manifest["shards"]) and (self.folder / shard_name(index)).exists()

    def write_shard(self, index: int, sequences: list[Sequence]) -> None:
        lengths = [len(s.input_ids) for s in sequences]
        offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        tensors = {
            "input_ids": torch.cat([s.input_ids for s in sequences]).to(torch.int32).contiguous(),
            "loss_mask": torch.cat([s.loss_mask for s in sequences]).to(torch.bool).contiguous(),
            "offsets": offsets,
            "aux_hidden": torch.cat([s.aux_hidden for s in sequences]).to(torch.bfloat16).contiguous(),
            "last_hidden": torch.cat([s.last_hidden for s in sequences]).to(torch.bfloat16).contiguous(),
        }
        name = shard_name(index)
        atomic_save_safetensors(self.folder / name, tensors)
        shards = [s for s in self.manifest["shards"] if s["index"] != index]
        shards.append({"index": index, "file": name, "num_sequences": len(sequences), "num_tokens": int(offsets[-1])})
        shards.sort(key=lambda s: s["index"])
        self.manifest["shards"] = shards
        self.manifest["num_sequences"] = sum(s["num_sequences"] for s in shards)
        self.manifest["num_tokens"] = sum(s["num_tokens"] for s in shards)
        atomic_write_json(self.folder / MANIFEST, self.manifest)


class FeatureDataset(torch.utils.data.Dataset):
    """Random access to the sequences of every finished shard listed in a manifest.

    Item: dict(input_ids int64 (T,), loss_mask bool (T,), aux_hidden bf16 (T, k·H), last_hidden bf16 (T, H)).
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        if not path.exists():
            raise FileNotFoundError(f"no {MANIFEST} in {self.folder}: run `python -m train.collect RECIPE` first")
        self.manifest = json.loads(path.read_text())
        self.index: list[tuple[str, int]] = []  # global sequence -> (shard file, local sequence)
        self.offsets: dict[str, torch.Tensor] = {}
        for shard in self.manifest["shards"]:
            with safe_open(str(self.folder / shard["file"]), framework="pt") as f:
                self.offsets[shard["file"]] = f.get_tensor("offsets")
            self.index += [(shard["file"], j) for j in range(shard["num_sequences"])]
        self._handles: dict[str, Any] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.index)

    def _handle(self, file: str):
        """An open safetensors handle, opened lazily in each process (a forked DataLoader worker opens its own)."""
        if self._pid != os.getpid():
            self._handles, self._pid = {}, os.getpid()
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.folder / file), framework="pt")
        return self._handles[file]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        file, j = self.index[i]
        start, end = (int(x) for x in self.offsets[file][j : j + 2])
        f = self._handle(file)
        return {
            "input_ids": f.get_slice("input_ids")[start:end].long(),
            "loss_mask": f.get_slice("loss_mask")[start:end].bool(),
            "aux_hidden": f.get_slice("aux_hidden")[start:end],
            "last_hidden": f.get_slice("last_hidden")[start:end],
        }

    def token_arrays(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, loss_mask) of every shard, all its sequences concatenated; hidden states are not read."""
        for shard in self.manifest["shards"]:
            f = self._handle(shard["file"])
            yield f.get_tensor("input_ids"), f.get_tensor("loss_mask")

    def lengths(self) -> list[int]:
        """Token count of every sequence (for length-bucketed batching)."""
        out = []
        for file, j in self.index:
            o = self.offsets[file]
            out.append(int(o[j + 1] - o[j]))
        return out

    def __getstate__(self):  # safetensors handles do not pickle (DataLoader workers)
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state
