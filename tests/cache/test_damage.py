"""A damaged cache is caught before the loss sees it, named with its path and the command
that repairs it, and the caching job repairs it."""

from __future__ import annotations

import json
import math
import random
import shutil

import numpy as np
import pyarrow as pa
import pytest
import torch

from distill.cache import CacheMismatch, TeacherCache, content_hash, read_metadata
from distill.cache.format import SCHEMA, shard_path
from distill.cache.verify import UNIT_ROUNDOFF, CacheDamaged, file_sha256, sum_path, value_problem
from distill.models.causal_lm import load_tokenizer
from distill.run.cache import cache_teacher_logits
from distill.train import train
from distill.training.teachers import CachedTeacher
from tests.fixtures import data_from

REPAIR = r"Repair it: distill-cache .*cache.dir="


@pytest.fixture
def copy(cache_k8, tmp_path):
    """A private copy of the K=8 cache to damage."""
    root = tmp_path / "cache"
    shutil.copytree(cache_k8[0], root)
    return root


def _column_bytes(path, column: str) -> tuple[int, int]:
    """(offset, length) in the file of a column's values buffer (the first record batch)."""
    data = path.read_bytes()
    with pa.memory_map(str(path)) as src:
        values = pa.ipc.open_stream(src).read_all().column(column).chunk(0).values
        raw = values.buffers()[1].to_pybytes()[: len(values) * values.type.bit_width // 8]
    offset = data.find(raw)
    assert offset > 0 and data.find(raw, offset + 1) == -1  # found, and only once
    return offset, len(raw)


def _flip_bits(path, column: str, n: int = 40) -> None:
    offset, length = _column_bytes(path, column)
    data = bytearray(path.read_bytes())
    for bit in random.Random(0).sample(range(length * 8), n):
        data[offset + bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(data))


def _rewrite_with_logprob(root, split: str, shard: int, value: float) -> None:
    """A well-formed shard (valid Arrow, checksum recorded) whose log-probs all equal value."""
    path = shard_path(root, split, shard)
    tbl = pa.ipc.open_stream(pa.BufferReader(path.read_bytes())).read_all()  # owns its bytes
    bits = tbl.column("logprobs_bits").combine_chunks()
    fake = np.full(len(bits.values), np.float16(value)).view(np.uint16)
    tbl = tbl.set_column(3, "logprobs_bits", pa.ListArray.from_arrays(bits.offsets,
                                                                      pa.array(fake)))
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, SCHEMA) as stream:
        stream.write_table(tbl)
    record = {"sha256": file_sha256(path), "bytes": path.stat().st_size}
    sum_path(path).write_text(json.dumps(record))
    meta = read_metadata(root)
    meta["shards"][split][shard].update(record)
    (root / "metadata.json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def batches(compose_train, cache_k8, tiny_assets, tmp_path_factory) -> list[dict]:
    """Every train and val batch of the cached data, as training collates them."""
    cfg = compose_train(cache_k8[0], "cache.top_k=8", out=tmp_path_factory.mktemp("o"))
    dm = data_from(cfg, load_tokenizer(str(tiny_assets["student"])))
    dm.setup("fit")
    return [*dm.train_dataloader(), *dm.val_dataloader()]


def _serve_all(root, batches) -> None:
    cache = TeacherCache(root)
    for batch in batches:
        cache.batch_targets(batch)


@pytest.mark.parametrize("column", ["logprobs_bits", "ids"])
def test_bit_flips_in_one_shard_are_caught_by_its_checksum(copy, column, batches):
    path = shard_path(copy, "train", 1)
    _flip_bits(path, column)
    TeacherCache(copy)  # same size: opening is fine, the first read checks the sha256
    with pytest.raises(CacheDamaged, match=f"shard {path} is damaged: its sha256 differs.*"
                       + REPAIR) as err:
        _serve_all(copy, batches)
    assert err.value.path == path and "tokenizer" not in str(err.value)


def test_training_from_a_bit_flipped_cache_stops_naming_the_shard(copy, compose_train,
                                                                   tmp_path):
    path = shard_path(copy, "train", 0)
    _flip_bits(path, "logprobs_bits")
    with pytest.raises(CacheDamaged, match=f"shard {path} is damaged"):
        train(compose_train(copy, "cache.top_k=8", "trainer.max_steps=20",
                            "data.batch_size=16", out=tmp_path / "out"))


def test_a_well_formed_shard_with_logprobs_of_plus_3_is_refused(copy, batches):
    _rewrite_with_logprob(copy, "train", 1, 3.0)
    path = shard_path(copy, "train", 1)
    with pytest.raises(CacheDamaged, match=f"shard {path} is damaged: a log-prob of \\+3 "
                       r"\(a probability above 1; log-probs are <= 0\) in example "
                       r"'demo_sft:\d+'\. " + REPAIR):
        _serve_all(copy, batches)


def test_a_truncated_shard_is_named_when_the_cache_opens(copy):
    path = shard_path(copy, "val", 0)
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2])
    with pytest.raises(CacheDamaged, match=f"shard {path} is damaged: it holds {size // 2} "
                       f"bytes, {size} were written \\(truncated.*" + REPAIR):
        TeacherCache(copy)


def test_the_job_checks_shards_and_rewrites_the_damaged_ones(copy, cache_k8, compose_cache,
                                                             batches, capsys):
    ref = content_hash(cache_k8[0], read_metadata(cache_k8[0]))
    _flip_bits(shard_path(copy, "train", 0), "logprobs_bits")
    truncated = shard_path(copy, "train", 2)
    truncated.write_bytes(truncated.read_bytes()[:100])
    _rewrite_with_logprob(copy, "val", 0, 3.0)
    summary = cache_teacher_logits(compose_cache(copy, "cache.top_k=8"))
    out = capsys.readouterr().out
    assert summary["shards_repaired"] == 3 and summary["shards_written"] == 3
    for path in (shard_path(copy, "train", 0), truncated, shard_path(copy, "val", 0)):
        assert f"[cache] shard {path} is damaged" in out
    assert content_hash(copy, read_metadata(copy)) == ref  # byte-identical to the original
    _serve_all(copy, batches)  # and every shard now passes the checks training makes


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("k", [1, 8, 1271])
def test_value_bounds_hold_for_real_distributions_and_catch_excess_mass(dtype, k):
    """Rounded log-probs of any distribution pass (uniform is the extreme case of the
    K^u bound); a top-k mass just above the bound fails."""
    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    ids = np.zeros((3, k), dtype=np.int32)
    for logits in (torch.zeros(3, k, dtype=torch.float64), 6 * torch.randn(3, k).double()):
        lps = torch.log_softmax(logits, -1).to(torch_dtype).float()
        assert value_problem(ids, lps, vocab=k, dtype=dtype) is None
    excess = UNIT_ROUNDOFF[dtype] * math.log(k) + 1e-3
    lps = torch.full((3, k), -math.log(k) + excess, dtype=torch.float64)
    why = value_problem(ids, lps.float(), vocab=k, dtype=dtype)
    assert ("a log-prob of +0.001" if k == 1 else "summing to") in why
    assert "outside [0, 5)" in value_problem(ids + 5, lps.float() - 1, vocab=5, dtype=dtype)
    lps[1, 0] = float("nan")
    assert "NaN or infinite" in value_problem(ids, lps.float() - 1, vocab=k, dtype=dtype)


def test_the_mismatch_hint_names_cache_dir(cache_k8, sharp_teacher):
    with pytest.raises(CacheMismatch, match="point cache.dir at a matching cache") as err:
        CachedTeacher(str(cache_k8[0]), str(sharp_teacher), top_k=16)
    assert "teacher.dir" not in str(err.value)
