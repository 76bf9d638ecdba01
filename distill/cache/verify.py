"""Shard integrity: a sha256 per shard recorded when it is written, checked before it is used,
and value checks on the log-probs the loss receives.

The writer records each shard's sha256 and size in a sidecar (`shard-NNNNN.arrow.sum`)
before it publishes the shard; the seal copies them into `metadata.json`. Training checks
every shard's size when it opens the cache (a truncated file fails before step 0), its
sha256 the first time a batch reads from it (one pass over its bytes; see docs/cache.md),
and the values of every batch it serves. The caching job checks all three before it skips
a shard, and rewrites a damaged one.

Value bounds (log-probs rounded to fp16/bf16 with unit roundoff u): rounding keeps the sign,
so every log-prob is <= 0; and the rounded top-k mass sum p_i^(1 - u) (each p_i = e^lp_i
at relative error u on lp_i) is at most K^u, reached at the uniform distribution.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import torch

from distill.cache.format import publish, tmp_path

VALUE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
LOGPROB_MAX = 6e-8  # fp16's smallest subnormal: a log-prob of 0 stays 0 once rounded
MASS_SLACK = 1e-5  # fp32 rounding of top - logsumexp in the writer and of the check


class CacheDamaged(RuntimeError):
    """A shard is missing, truncated, altered or holds impossible values; `path` names it."""

    def __init__(self, path: Path, why: str, repair: str):
        self.path = Path(path)
        super().__init__(f"teacher cache shard {path} is damaged: {why}. Repair it: {repair}")


def repair_hint(root: Path, meta: dict | None) -> str:
    """The caching job's recorded command, aimed at the cache where it is now (a moved
    cache's command named the folder it was written in)."""
    import shlex

    recorded_command = (meta or {}).get("command")
    if recorded_command:
        words = [w for w in shlex.split(recorded_command)
                 if not w.lstrip("+~").startswith("cache.dir=")]
        command = " ".join(shlex.quote(w) for w in words)
    else:
        command = "distill-cache <the experiment and overrides of this cache>"
    return (f"{command} cache.dir={shlex.quote(str(root))} (the caching job checks every "
            "shard and rewrites the damaged ones)")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sum_path(shard: Path) -> Path:
    return shard.with_name(shard.name + ".sum")


def record_and_publish(tmp: Path, final: Path) -> None:
    """Record the finished temp file's checksum next to `final`, then publish the shard."""
    record = {"sha256": file_sha256(tmp), "bytes": tmp.stat().st_size}
    side = sum_path(final)
    side_tmp = tmp_path(side)
    side_tmp.write_text(json.dumps(record) + "\n")
    publish(side_tmp, side)
    publish(tmp, final)


def recorded(meta: dict | None, shard: Path, split: str, index: int) -> dict | None:
    """{sha256, bytes} of a shard: from the sealed metadata, else from the writer's sidecar."""
    rows = ((meta or {}).get("shards") or {}).get(split) or []
    if index < len(rows) and rows[index].get("sha256"):
        return rows[index]
    side = sum_path(shard)
    try:
        return json.loads(side.read_text())
    except (OSError, ValueError):
        return None


def file_problem(shard: Path, expected: dict | None, checksum: bool = True) -> str | None:
    """Why the file is not the shard that was written (None when it is)."""
    if not shard.exists():
        return "the file is missing"
    if expected is None:
        return "no checksum was recorded for it"
    size = shard.stat().st_size
    if size != expected["bytes"]:
        return (f"it holds {size} bytes, {expected['bytes']} were written (truncated or "
                "overwritten)")
    if checksum and file_sha256(shard) != expected["sha256"]:
        return "its sha256 differs from the one recorded when it was written (altered bytes)"
    return None


def decode(bits: np.ndarray, dtype: str) -> torch.Tensor:
    """uint16 bit patterns -> fp32 log-probs."""
    raw = torch.from_numpy(np.ascontiguousarray(bits).view(np.int16).copy())
    return raw.view(VALUE_DTYPES[dtype]).float()


def value_problem(ids: np.ndarray, logprobs: torch.Tensor, vocab: int, dtype: str) -> str | None:
    """Why (n, K) top-k ids / log-probs cannot be a teacher's (None when they can)."""
    if ids.size == 0:
        return None
    if ids.min() < 0 or ids.max() >= vocab:
        return f"token ids outside [0, {vocab})"
    top, bottom = float(logprobs.max()), float(logprobs.min())
    if not (math.isfinite(top) and math.isfinite(bottom)):
        return "NaN or infinite log-probs"
    if top > LOGPROB_MAX:
        return f"a log-prob of {top:+.4g} (a probability above 1; log-probs are <= 0)"
    k = logprobs.shape[-1]
    bound = math.exp(UNIT_ROUNDOFF[dtype] * math.log(max(k, 1))) + MASS_SLACK
    # torch sums pairwise: fp32 error ~log2(K) * 6e-8, inside the slack
    mass = float(torch.exp(logprobs).sum(-1).max())
    if mass > bound:
        return (f"top-{k} probabilities summing to {mass:.6f} (at most {bound:.6f} after "
                f"{dtype} rounding)")
    return None


def shard_problem(shard: Path, expected: dict | None, *, top_k: int, vocab: int, dtype: str,
                  examples: int | None = None) -> str | None:
    """The full check of one shard: bytes, Arrow structure, row count, values."""
    import pyarrow as pa

    why = file_problem(shard, expected)
    if why is not None:
        return why
    try:
        with pa.memory_map(str(shard)) as src:
            tbl = pa.ipc.open_stream(src).read_all()
            if examples is not None and tbl.num_rows != examples:
                return f"it holds {tbl.num_rows} examples, the plan has {examples}"
            ids = tbl.column("ids").combine_chunks()
            bits = tbl.column("logprobs_bits").combine_chunks()
            if ids.offsets != bits.offsets or len(ids.values) % top_k:
                return f"its ids and log-probs do not pair up in rows of K={top_k}"
            ids, bits = ids.values.to_numpy(), bits.values.to_numpy()
            return value_problem(ids.reshape(-1, top_k), decode(bits, dtype).reshape(-1, top_k),
                                 vocab, dtype)
    except (OSError, ValueError, pa.ArrowException) as err:
        return f"it does not read as a cache shard ({type(err).__name__}: {err})"
