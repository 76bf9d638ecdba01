"""The teacher-logit cache on disk: layout, row schema, hashes, metadata, atomic writes.

A cache is a folder:

    metadata.json                      what was cached and how (checked by training)
    train/shard-00000.arrow ...        Arrow IPC stream files, one row per example
    train/shard-00000.arrow.sum ...    its sha256 and size, written just before it
    val/shard-00000.arrow ...

A shard holds a fixed range of `shard_size` examples of its split (by dataset index), so
its content depends only on the data and the teacher: a rerun skips the shards that exist
and rewrites the others, and the result is identical. A shard only ever appears under its
final name by an atomic rename, so a file named `shard-*.arrow` is always complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from distill.core.constants import IGNORE_INDEX

FORMAT = "distill-teacher-cache"
VERSION = 2  # 2: a sha256 per shard (distill.cache.verify)
VALUE_DTYPES = ("float16", "bfloat16")

# One row per example. Lists are flat: `ids` and `logprobs_bits` hold n * K values
# (row-major) for the example's n trained positions in order (trained_positions), so a
# trained token costs 6K bytes plus ~30 bytes per example. The positions themselves are
# not stored: they follow from the labels, which the token hash pins down.
SCHEMA = pa.schema([
    ("example_id", pa.string()),
    ("token_hash", pa.uint64()),  # example_hash(input_ids, labels): checked by training
    ("ids", pa.list_(pa.int32())),  # (n, K) top-k token ids, by falling probability
    ("logprobs_bits", pa.list_(pa.uint16())),  # (n, K) fp16/bf16 bit patterns (metadata dtype)
])

# Fields that say what a cache *is*; a rerun or a training run must agree on all of them.
IDENTITY = ("format", "version", "teacher", "tokenizer", "vocab", "max_length", "top_k",
            "temperature", "dtype", "data", "plan")


class CacheMismatch(ValueError):
    """The cache was written for something else; `field` names what differs."""

    def __init__(self, field: str, cached, expected, where: str, hint: str):
        self.field = field
        super().__init__(f"teacher cache {where}: {field} differs (cache: {cached!r}, this "
                         f"run: {expected!r}). {hint}")


def shard_path(root: Path, split: str, shard: int) -> Path:
    return Path(root) / split / f"shard-{shard:05d}.arrow"


def tmp_path(final: Path) -> Path:
    # never matches shard-*.arrow, so a half-written file is never read
    return final.with_name(final.name + ".tmp")


def example_hash(input_ids, labels) -> int:
    """64-bit hash of an example's tokens and trained mask (int32 ids, then the mask)."""
    ids = np.asarray(input_ids, dtype=np.int32)
    mask = (np.asarray(labels) != IGNORE_INDEX).astype(np.uint8)
    digest = hashlib.blake2b(ids.tobytes() + mask.tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def trained_positions(labels) -> np.ndarray:
    """Shifted positions t whose next token is trained (labels[t + 1] != -100), int32."""
    labels = np.asarray(labels)
    return np.flatnonzero(labels[1:] != IGNORE_INDEX).astype(np.int32)


def data_fingerprint(example_ids, hashes) -> str:
    """Order-free fingerprint of a split: the set of (example id, token hash) pairs."""
    h = hashlib.sha256()
    for eid, th in sorted(zip(example_ids, hashes)):
        h.update(f"{eid}\0{th:016x}\n".encode())
    return f"{len(hashes)}:{h.hexdigest()[:32]}"


def tokenizer_hash(tokenizer) -> str:
    """The vocabulary and special tokens (what makes token ids mean the same thing)."""
    blob = json.dumps({"vocab": sorted(tokenizer.get_vocab().items()),
                       "special": sorted(tokenizer.all_special_tokens)})
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def write_json_atomic(path: Path, obj: dict) -> None:
    path = Path(path)
    tmp = tmp_path(path)
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    publish(tmp, path)


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished temp file to its final name, durably (file, then directory)."""
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_metadata(root: Path) -> dict | None:
    path = Path(root) / "metadata.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


def identity(meta: dict) -> dict:
    return {k: meta.get(k) for k in IDENTITY}


def first_difference(cached: dict, expected: dict) -> tuple[str, object, object] | None:
    """The first identity field that differs (nested dicts name their key: data.train)."""
    for key in IDENTITY:
        a, b = cached.get(key), expected.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            for sub in sorted(set(a) | set(b)):
                if a.get(sub) != b.get(sub):
                    return f"{key}.{sub}", a.get(sub), b.get(sub)
        elif a != b:
            return key, a, b
    return None


def content_hash(root: Path, meta: dict) -> str:
    """sha256 over every shard's bytes, in split and shard order."""
    h = hashlib.sha256()
    for split, info in sorted(meta["plan"]["splits"].items()):
        for shard in range(info["shards"]):
            h.update(f"{split}/{shard}\n".encode())
            with open(shard_path(root, split, shard), "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()
