"""Which examples go into which shard, and in which batches: the cache job's work list.

Shard s of a split holds dataset indices [s * shard_size, (s + 1) * shard_size). Inside a
shard, examples are batched longest first (less padding), always the same way, so a shard
recomputed after a crash is bit-identical. Rank r of W owns the shards with s % W == r:
the union over ranks is complete and non-overlapping for any W, and needs no coordination.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from distill.cache.format import data_fingerprint, example_hash, shard_path
from distill.core.constants import IGNORE_INDEX


@dataclass
class SplitInfo:
    """Per-example facts of one tokenized split, computed in one pass over its Arrow data."""

    example_ids: list[str]
    hashes: list[str]
    lengths: np.ndarray  # (n,) tokens
    tokens: np.ndarray  # (n,) trained (shifted) positions

    @property
    def fingerprint(self) -> str:
        return data_fingerprint(self.example_ids, self.hashes)


def describe(ds) -> SplitInfo:
    """Hash every example of a tokenized split (input_ids, labels, example_id columns)."""
    ids, hashes, lengths, tokens = [], [], [], []
    for tbl in ds.with_format("arrow").iter(batch_size=1024):
        inp, lab = tbl.column("input_ids").combine_chunks(), tbl.column("labels").combine_chunks()
        inp_off, lab_off = inp.offsets.to_numpy(), lab.offsets.to_numpy()
        inp_val, lab_val = inp.values.to_numpy(), lab.values.to_numpy()
        for i, eid in enumerate(tbl.column("example_id").to_pylist()):
            x = inp_val[inp_off[i]:inp_off[i + 1]]
            y = lab_val[lab_off[i]:lab_off[i + 1]]
            ids.append(eid)
            hashes.append(example_hash(x, y))
            lengths.append(len(x))
            tokens.append(int((y[1:] != IGNORE_INDEX).sum()))
    if len(set(ids)) != len(ids):
        raise ValueError("example ids are not unique: the cache aligns examples by id "
                         "(give every data source a distinct name)")
    return SplitInfo(ids, hashes, np.asarray(lengths, np.int64), np.asarray(tokens, np.int64))


@dataclass
class ShardBatch:
    split: str
    shard: int
    indices: list[int]
    first: bool
    last: bool


@dataclass
class Plan:
    shard_size: int
    batch_size: int
    splits: dict[str, SplitInfo] = field(default_factory=dict)

    def n_shards(self, split: str) -> int:
        return -(-len(self.splits[split].example_ids) // self.shard_size)

    def summary(self) -> dict:
        return {"shard_size": self.shard_size, "batch_size": self.batch_size,
                "splits": {s: {"examples": len(i.example_ids), "shards": self.n_shards(s)}
                           for s, i in self.splits.items()}}

    def shards(self):
        for split in self.splits:
            for shard in range(self.n_shards(split)):
                yield split, shard

    def batches(self, split: str, shard: int) -> list[ShardBatch]:
        info = self.splits[split]
        lo = shard * self.shard_size
        idx = np.arange(lo, min(lo + self.shard_size, len(info.example_ids)))
        idx = idx[np.argsort(-info.lengths[idx], kind="stable")]  # longest first
        parts = [idx[i:i + self.batch_size].tolist() for i in range(0, len(idx),
                                                                   self.batch_size)]
        return [ShardBatch(split, shard, p, i == 0, i == len(parts) - 1)
                for i, p in enumerate(parts)]

    def examples(self, split: str, shard: int) -> int:
        n = len(self.splits[split].example_ids)
        return min(self.shard_size, n - shard * self.shard_size)

    def pending(self, root, rank: int, world: int, intact=None) -> list[ShardBatch]:
        """This rank's batches, for the shards it owns that are missing or, by
        `intact(split, shard) -> bool`, damaged."""
        out = []
        for i, (split, shard) in enumerate(self.shards()):
            if i % world != rank:
                continue
            done = shard_path(root, split, shard).exists() and (intact is None
                                                                or intact(split, shard))
            if not done:
                out += self.batches(split, shard)
        return out


class ShardBatches(torch.utils.data.Dataset):
    """Item i is a whole collated batch plus where it goes (use with batch_size=None)."""

    def __init__(self, datasets: dict, plan: Plan, batches: list[ShardBatch], collate):
        self.datasets, self.plan, self.batches, self.collate = datasets, plan, batches, collate

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        b = self.batches[i]
        ds, info = self.datasets[b.split], self.plan.splits[b.split]
        batch = self.collate([ds[j] for j in b.indices])
        batch.update(cache_split=b.split, cache_shard=b.shard, cache_first=b.first,
                     cache_last=b.last, token_hash=[info.hashes[j] for j in b.indices],
                     example_id=[info.example_ids[j] for j in b.indices])
        return batch
