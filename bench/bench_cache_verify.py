"""What checking a cache shard costs: `python bench/bench_cache_verify.py [--mb 256]`.

Writes one synthetic shard of about --mb MB (K=64 fp16 log-probs of random distributions,
2048 trained tokens per example) and times, from a warm page cache: reading it (Arrow
stream -> numpy); its sha256 (what training checks on a shard's first use); the caching
job's full check before it skips a shard (`shard_problem`: sha256 + structure + values);
and the value check training runs on every batch it serves (16 x 1024 trained positions).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

if importlib.util.find_spec("distill") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout, not installed

import numpy as np
import pyarrow as pa
import torch

from distill.cache.format import SCHEMA
from distill.cache.verify import file_sha256, shard_problem, value_problem

K, TOKENS, VOCAB = 64, 2048, 128256


def write_shard(path: Path, mb: int) -> dict:
    examples = max(1, (mb << 20) // (TOKENS * K * 6))
    n = examples * TOKENS
    lps = torch.log_softmax(4 * torch.randn(n, K), -1).half()  # a top-64 of a K-way softmax
    ids = torch.randint(0, VOCAB, (n, K), dtype=torch.int32)
    offsets = pa.array(np.arange(examples + 1, dtype=np.int32) * TOKENS * K)
    tbl = pa.Table.from_arrays([
        pa.array([f"x:{i}" for i in range(examples)]), pa.array(range(examples), pa.uint64()),
        pa.ListArray.from_arrays(offsets, pa.array(ids.numpy().reshape(-1))),
        pa.ListArray.from_arrays(offsets, pa.array(lps.view(torch.int16).numpy()
                                                   .view(np.uint16).reshape(-1))),
    ], schema=SCHEMA)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, SCHEMA) as stream:
        stream.write_table(tbl)
    return {"sha256": file_sha256(path), "bytes": path.stat().st_size}


def read(path: Path) -> None:
    with pa.memory_map(str(path)) as src:
        tbl = pa.ipc.open_stream(src).read_all()
        tbl.column("logprobs_bits").combine_chunks().values.to_numpy().sum()


def timed(fn, reps: int = 3) -> float:
    fn()  # warm the page cache
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard-00000.arrow"
        record = write_shard(path, args.mb)
        mb = record["bytes"] / 2**20
        rows = {
            "read (Arrow -> numpy, touch every log-prob)": lambda: read(path),
            "sha256": lambda: file_sha256(path),
            "full check (sha256 + structure + values)": lambda: shard_problem(
                path, record, top_k=K, vocab=VOCAB, dtype="float16"),
        }
        print(f"shard: {mb:.0f} MB, K={K}, torch threads {torch.get_num_threads()}")
        for name, fn in rows.items():
            s = timed(fn)
            print(f"  {name:45s} {s * 1e3:8.1f} ms  {mb / s:8.0f} MB/s")
        ids = torch.randint(0, VOCAB, (16 * 1024, K), dtype=torch.int32).numpy()
        lps = torch.log_softmax(4 * torch.randn(16 * 1024, K), -1).half().float()
        s = timed(lambda: value_problem(ids, lps, VOCAB, "float16"))
        print(f"  {'value check of one batch (16384 x K)':45s} {s * 1e3:8.1f} ms")
        assert shard_problem(path, record, top_k=K, vocab=VOCAB, dtype="float16") is None


if __name__ == "__main__":
    main()
