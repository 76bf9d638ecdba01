"""The caching job: kill and rerun, two gloo ranks, reruns skip, storage per token."""

from __future__ import annotations

import signal

import pyarrow as pa
import pytest

from distill.cache import TeacherCache, content_hash, read_metadata
from distill.cache.format import shard_path
from distill.run.cache import cache_teacher_logits
from tests.cache.helpers import run_script, script, wait_for

THROTTLE = "+callbacks.throttle={_target_:tests.cache.helpers.Throttle,seconds:0.3}"


def n_shards(root) -> int:
    return len(list(root.glob("*/shard-*.arrow")))


def example_ids(root) -> list[str]:
    ids = []
    for path in sorted(root.glob("*/shard-*.arrow")):
        with pa.memory_map(str(path)) as src:
            ids += pa.ipc.open_stream(src).read_all().column("example_id").to_pylist()
    return ids


@pytest.mark.slow  # >10 s on a 2-core CPU (make test runs it)
def test_killed_at_any_moment_then_rerun_gives_the_identical_cache(cache_overrides, cache_k8,
                                                                    tmp_path):
    ref, _ = cache_k8  # the same job, uninterrupted
    root = tmp_path / "cache"
    args = cache_overrides(root, "cache.top_k=8")
    proc = script(args + [THROTTLE])
    wait_for(lambda: n_shards(root) >= 2)
    wait_for(lambda: any(root.glob("*/*.tmp")))  # in the middle of the next shard
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not read_metadata(root).get("complete")
    with pytest.raises(RuntimeError, match="incomplete"):
        TeacherCache(root)  # training refuses a cache the job did not finish
    out = run_script(args)
    assert "teacher cache:" in out
    meta = read_metadata(root)
    assert meta["complete"] and meta["shards"] == read_metadata(ref)["shards"]
    # the command line is kept for the repair hint of a damaged shard
    assert meta["command"].startswith("distill-cache +experiment=")
    assert f"cache.dir={root}" in meta["command"]
    assert content_hash(root, meta) == content_hash(ref, read_metadata(ref))


@pytest.mark.slow  # >10 s on a 2-core CPU (make test runs it)
def test_two_gloo_ranks_write_a_complete_non_overlapping_cache(cache_overrides, cache_k8,
                                                               tmp_path):
    ref, _ = cache_k8
    root = tmp_path / "cache"
    out = run_script(cache_overrides(root, "cache.top_k=8", "trainer.devices=2",
                                     "trainer.strategy=ddp"))
    written = {}
    for line in out.splitlines():
        if line.startswith("[cache] rank "):
            rank = line.split()[2].rstrip(":")
            written[rank] = int(line.split("wrote ")[1].split()[0])
    meta = read_metadata(root)
    total = sum(i["shards"] for i in meta["plan"]["splits"].values())
    assert set(written) == {"0/2", "1/2"} and min(written.values()) > 0
    assert sum(written.values()) == total  # each shard written by exactly one rank
    ids = example_ids(root)
    assert len(ids) == len(set(ids)) == sum(i["examples"] for i in meta["plan"]["splits"].values())
    assert content_hash(root, meta) == content_hash(ref, read_metadata(ref))


def test_rerun_skips_finished_shards_and_changes_nothing(compose_cache, cache_k8):
    root, first = cache_k8
    before = content_hash(root, read_metadata(root))
    again = cache_teacher_logits(compose_cache(root, "cache.top_k=8"))
    assert again["shards_written"] == 0 and again["tokens"] == first["tokens"]
    assert content_hash(root, read_metadata(root)) == before


def test_a_partial_shard_is_never_read(cache_k8, sharp_teacher):
    root, _ = cache_k8
    junk = shard_path(root, "train", 0).with_name("shard-00000.arrow.tmp")
    junk.write_bytes(b"half a shard")
    try:
        cache = TeacherCache(root)
        assert len(cache.index) == sum(i["examples"]
                                       for i in cache.meta["plan"]["splits"].values())
    finally:
        junk.unlink()


def test_storage_per_trained_token(compose_cache, tmp_path):
    """The default settings (K = 64, fp16, shards of 256 examples): <= 6K + 16 bytes."""
    summary = cache_teacher_logits(compose_cache(tmp_path / "c", "cache.top_k=64",
                                                 "cache.shard_size=256"))
    print(f"\nK=64 fp16: {summary['bytes_per_token']:.1f} bytes per trained token "
          f"({summary['tokens']} tokens, {summary['examples']} examples)")
    assert summary["bytes_per_token"] <= 6 * 64 + 16
