"""Read a complete teacher-logit cache, check it against the run, and serve batches.

Examples are found by their id and checked by the hash of their tokens and trained mask,
never by position alone: a reordered dataset still lines up, a changed one fails loudly.
Shards are memory-mapped (they also open with `datasets.Dataset.from_file`).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from distill.cache.format import (
    FORMAT,
    VERSION,
    CacheMismatch,
    example_hash,
    read_metadata,
    shard_path,
    tokenizer_hash,
    trained_positions,
)
from distill.cache.verify import (
    VALUE_DTYPES,
    CacheDamaged,
    decode,
    file_problem,
    recorded,
    repair_hint,
    value_problem,
)

OPEN_SHARDS = 64
REBUILD = ("Rebuild it for this run (distill-cache with the same "
           "experiment and overrides) or point cache.dir at a matching cache.")


class TeacherCache:
    def __init__(self, root):
        self.root = Path(root)
        meta = read_metadata(self.root)
        if meta is None:
            raise FileNotFoundError(f"no teacher cache at {self.root} (no metadata.json): "
                                    "write it first with distill-cache and the same overrides as "
                                    "this run (python -m distill.run.cache)")
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise CacheMismatch("format", (meta.get("format"), meta.get("version")),
                                (FORMAT, VERSION), str(self.root), REBUILD)
        if not meta.get("complete"):
            raise RuntimeError(f"teacher cache {self.root} is incomplete (the caching job "
                               "stopped early): rerun it to finish; written shards are kept")
        self.meta = meta
        self.top_k = int(meta["top_k"])
        self.value_dtype = VALUE_DTYPES[meta["dtype"]]
        self._tables: OrderedDict[tuple[str, int], pa.Table] = OrderedDict()
        self._checked: set[tuple[str, int]] = set()  # shards verified in this process
        self.index: dict[str, tuple[str, int, int, int]] = {}  # id -> split, shard, row, hash
        for split, info in meta["plan"]["splits"].items():
            for shard in range(info["shards"]):
                tbl = self._open(split, shard)
                ids = tbl.column("example_id").to_pylist()
                hashes = tbl.column("token_hash").to_pylist()
                for row, (eid, th) in enumerate(zip(ids, hashes)):
                    self.index[eid] = (split, shard, row, th)

    def __getstate__(self):  # spawned workers / ranks map (and check) the shards themselves
        return {**self.__dict__, "_tables": OrderedDict(), "_checked": set()}

    def _table(self, split: str, shard: int) -> pa.Table:
        """A shard to serve from: its sha256 is checked on its first use in this process."""
        if (split, shard) not in self._checked:
            path = shard_path(self.root, split, shard)
            why = file_problem(path, recorded(self.meta, path, split, shard))
            if why is not None:
                raise CacheDamaged(path, why, repair_hint(self.root, self.meta))
            self._checked.add((split, shard))
        return self._open(split, shard)

    def _open(self, split: str, shard: int) -> pa.Table:
        key = (split, shard)
        if key in self._tables:
            self._tables.move_to_end(key)
            return self._tables[key]
        path = shard_path(self.root, split, shard)
        if key not in self._checked:  # cheap: a truncated or missing file fails at open
            why = file_problem(path, recorded(self.meta, path, split, shard), checksum=False)
            if why is not None:
                raise CacheDamaged(path, why, repair_hint(self.root, self.meta))
        try:
            src = pa.memory_map(str(path))
            self._tables[key] = pa.ipc.open_stream(src).read_all()  # zero-copy views
        except (OSError, pa.ArrowException) as err:
            raise CacheDamaged(path, f"it does not read as a cache shard ({err})",
                               repair_hint(self.root, self.meta)) from err
        if len(self._tables) > OPEN_SHARDS:  # bound the open files of a big cache
            self._tables.popitem(last=False)
        return self._tables[key]

    # --- checks -----------------------------------------------------------------
    def expect(self, field: str, value) -> None:
        """Raise CacheMismatch naming `field` unless the cache recorded `value` for it."""
        cached = self.meta.get(field)
        if cached != value:  # numbers compare by value: 1 == 1.0
            raise CacheMismatch(field, cached, value, str(self.root), REBUILD)

    def check_tokenizer(self, tokenizer) -> None:
        self.expect("tokenizer", tokenizer_hash(tokenizer))
        self.expect("vocab", len(tokenizer))

    def check_split(self, split: str, fingerprint: str) -> None:
        data = self.meta.get("data", {})
        if split not in data:
            raise CacheMismatch(f"data.{split}", None, fingerprint, str(self.root),
                                f"The cache has no {split!r} split. {REBUILD}")
        if data[split] != fingerprint:
            raise CacheMismatch(f"data.{split} (data fingerprint)", data[split], fingerprint,
                                str(self.root), REBUILD)

    # --- serving ------------------------------------------------------------------
    def example(self, example_id: str, input_ids, labels):
        """(positions (n,), ids (n, K) int32, logprobs (n, K) float32) of one example."""
        if example_id not in self.index:
            raise KeyError(f"example {example_id!r} is not in the teacher cache {self.root}: "
                           f"the data differs from what was cached. {REBUILD}")
        split, shard, row, th = self.index[example_id]
        if example_hash(input_ids, labels) != th:
            raise CacheMismatch(f"tokens of example {example_id!r}", th,
                                example_hash(input_ids, labels), str(self.root), REBUILD)
        tbl = self._table(split, shard)
        pos = trained_positions(labels)
        ids = tbl.column("ids")[row].values.to_numpy().reshape(-1, self.top_k)
        bits = tbl.column("logprobs_bits")[row].values.to_numpy().reshape(-1, self.top_k)
        lps = decode(bits, self.meta["dtype"])
        if len(ids) != len(pos):
            raise CacheMismatch(f"trained positions of example {example_id!r}", len(ids),
                                len(pos), str(self.root), REBUILD)
        return pos, torch.from_numpy(ids.copy()), lps

    def batch_targets(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """target_ids (N, K) int32 and target_logprobs (N, K) fp32 for the flattened shifted
        positions of a padded batch; untrained rows hold id 0, log-prob 0 (the loss drops
        them). Packed rows (`example_ids` per row, `position_ids`) take each document's
        targets at its own offset in the row."""
        packed = "example_ids" in batch
        if not packed and "example_id" not in batch:
            raise ValueError("a cached teacher needs batch['example_id'] (or, for packed "
                             "rows, 'example_ids') to find its targets")
        input_ids = batch["input_ids"].cpu()
        labels = batch["labels"].cpu()
        b, t = input_ids.shape
        ids = torch.zeros((b * (t - 1), self.top_k), dtype=torch.int32)
        lps = torch.zeros((b * (t - 1), self.top_k), dtype=torch.float32)
        served = []
        for i, (start, stop, eid) in enumerate_documents(batch):
            x, y = input_ids[i, start:stop].numpy(), labels[i, start:stop].numpy()
            pos, e_ids, e_lps = self.example(eid, x, y)
            rows = torch.from_numpy(pos.astype(np.int64)) + (i * (t - 1) + start)
            ids[rows], lps[rows] = e_ids, e_lps
            served.append((eid, rows))
        self.check_values(ids, lps, served)
        return ids, lps

    def check_values(self, ids: torch.Tensor, lps: torch.Tensor, served: list) -> None:
        """What the loss receives must be a teacher's top-k: ids in the vocabulary,
        log-probs <= 0, mass <= 1 (within rounding); else name the example and its shard."""
        if not served:
            return
        rows = torch.cat([r for _, r in served])
        vocab, dtype = int(self.meta["vocab"]), self.meta["dtype"]
        if value_problem(ids[rows].numpy(), lps[rows], vocab, dtype) is None:
            return
        for eid, r in served:  # the failure path: find the example
            why = value_problem(ids[r].numpy(), lps[r], vocab, dtype)
            if why is not None:
                split, shard, _, _ = self.index[eid]
                raise CacheDamaged(shard_path(self.root, split, shard),
                                   f"{why} in example {eid!r}", repair_hint(self.root, self.meta))


def enumerate_documents(batch: dict):
    """(row, (start, stop, example id)) of every example in a batch: one per padded row, or
    the documents of packed rows, told apart by where `position_ids` restart at 0."""
    mask = batch.get("attention_mask")
    t = batch["input_ids"].shape[1]
    lengths = (mask.cpu().sum(1).tolist() if mask is not None
               else [t] * len(batch["input_ids"]))
    if "example_ids" not in batch:
        for i, eid in enumerate(batch["example_id"]):
            yield i, (0, int(lengths[i]), eid)
        return
    pos = batch["position_ids"].cpu()
    for i, eids in enumerate(batch["example_ids"]):
        starts = (pos[i, :int(lengths[i])] == 0).nonzero().flatten().tolist()
        if len(starts) != len(eids):
            raise ValueError(f"packed row {i} holds {len(starts)} documents by its "
                             f"position_ids but lists {len(eids)} example_ids")
        for start, stop, eid in zip(starts, [*starts[1:], int(lengths[i])], eids):
            yield i, (start, stop, eid)
