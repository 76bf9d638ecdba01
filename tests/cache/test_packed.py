"""A cached teacher with packed rows: each document gets its own cached targets, and a
packed offline run's first step is the loss of each document alone against the teacher's
own top-8 (tests/step_check.py)."""

from __future__ import annotations

import torch

from distill.models.causal_lm import load_tokenizer
from distill.run.cache import cache_teacher_logits
from distill.train import train
from distill.training.teachers import CachedTeacher
from tests.fixtures import data_from
from tests.step_check import CACHED_RTOL, assert_first_step_loss, record_first_step


def _data(cfg, tok, packing):
    dm = data_from(cfg, tok, packing=packing)
    dm.setup("fit")
    return dm


def test_packed_rows_get_each_documents_targets(compose_train, cache_k8, sharp_teacher,
                                                tiny_assets, tmp_path):
    cfg = compose_train(cache_k8[0], "cache.top_k=8", out=tmp_path)
    tok = load_tokenizer(str(tiny_assets["student"]))
    packed, plain = _data(cfg, tok, True), _data(cfg, tok, False)
    cached = CachedTeacher(str(cache_k8[0]), str(sharp_teacher), top_k=8)
    cached.check_data(packed, tok)  # checked by the examples the rows hold
    rows = [packed.train_set[i] for i in range(3)]
    assert all(len(r["example_ids"]) > 1 for r in rows)
    by_id = {ex["example_id"]: ex for ex in plain.train_examples}
    docs = [by_id[e] for r in rows for e in r["example_ids"]]
    pb, ub = packed.collate(rows), plain.collate(docs)
    p_ids, p_lps = (x.view(len(rows), -1, 8) for x in cached.cache.batch_targets(pb))
    u_ids, u_lps = (x.view(len(docs), -1, 8) for x in cached.cache.batch_targets(ub))
    k, covered = 0, torch.zeros(p_ids.shape[:2], dtype=torch.bool)
    for i, r in enumerate(rows):
        start = 0
        for _ in r["example_ids"]:
            n = len(docs[k]["input_ids"])  # its n - 1 positions predict its own next tokens
            assert torch.equal(p_ids[i, start:start + n - 1], u_ids[k, :n - 1])
            assert torch.equal(p_lps[i, start:start + n - 1], u_lps[k, :n - 1])
            assert torch.equal(u_ids[k, n - 1:], torch.zeros_like(u_ids[k, n - 1:]))
            covered[i, start:start + n - 1] = True
            start, k = start + n, k + 1
    assert (p_ids[covered] != 0).any()
    # a document's last position predicts nothing (the next document's first token)
    assert (p_ids[~covered] == 0).all() and (p_lps[~covered] == 0).all()


def test_cache_job_ignores_packing_and_packed_offline_training_runs(compose_cache,
                                                                    compose_train, cache_k8,
                                                                    tmp_path, monkeypatch,
                                                                    teacher64):
    # the same cache whether the data config packs or not: the job is per example
    summary = cache_teacher_logits(compose_cache(cache_k8[0], "cache.top_k=8",
                                                 "data.packing=true"))
    assert summary["shards_written"] == 0  # every shard already there: the same cache
    cfg = compose_train(cache_k8[0], "cache.top_k=8", "data.packing=true",
                        "trainer.max_steps=3", "evaluate=null", out=tmp_path)
    first = record_first_step(monkeypatch)
    result = train(cfg)
    assert result["global_step"] == 3
    assert all(torch.isfinite(torch.tensor(v)) for v in result["metrics"].values())
    assert any("position_ids" in b for b in first.batches)  # packed rows were trained
    assert_first_step_loss(first, cfg.loss, rtol=CACHED_RTOL, cached_teacher=teacher64,
                           top_k=8)


def test_cache_job_pads_each_batch_to_its_longest_example(compose_cache, cache_k8,
                                                          monkeypatch, tmp_path):
    """With data.packing=true the job still caches examples one by one; its batches must be
    padded to their own longest example, not to the packed rows' data.max_length (at 2048
    that was 5x the teacher's work on ~400-token chats)."""
    import distill.cache.job

    widths, longest = [], []

    class Spy(distill.cache.job.CacheJob):
        def __init__(self, settings, datasets, collate, **kw):
            def spied(examples):
                batch = collate(examples)
                widths.append(batch["input_ids"].shape[1])
                longest.append(max(len(ex["input_ids"]) for ex in examples))
                return batch
            super().__init__(settings, datasets, spied, **kw)

    monkeypatch.setattr("distill.run.cache.CacheJob", Spy)
    cache_teacher_logits(compose_cache(tmp_path / "fresh", "cache.top_k=8", "data.packing=true",
                                       "data.max_length=512"))
    assert widths and widths == longest and max(widths) < 512
