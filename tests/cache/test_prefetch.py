"""Cached targets read by the DataLoader's collate (in its workers), not at the step."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from distill.models.causal_lm import load_tokenizer
from tests.fixtures import data_from, teacher_from


def test_targets_come_with_the_batch_from_the_workers(compose_train, cache_k8, tmp_path,
                                                      monkeypatch):
    cfg = compose_train(cache_k8[0], "cache.top_k=8", "data.num_workers=1", out=tmp_path)
    tokenizer = load_tokenizer(cfg.teacher.name_or_path)
    teacher = teacher_from(cfg)
    data = data_from(cfg, tokenizer)
    teacher.check_data(data, tokenizer)
    plain = data.collate
    examples = [data.train_set[i] for i in (3, 0, 7, 5)]
    want_ids, want_lps = teacher.cache.batch_targets(plain(examples))

    teacher.prefetch_in(data)
    loader = DataLoader(data.train_set, batch_size=4, collate_fn=data.collate,
                        num_workers=1, sampler=[3, 0, 7, 5])
    batch = next(iter(loader))  # collated (and the cache read) in a worker process
    assert torch.equal(batch["target_ids"], want_ids)
    assert torch.equal(batch["target_logprobs"], want_lps)
    assert (want_lps < 0).any()  # real targets, not the zero fill of untrained rows

    def no_read(*args):
        raise AssertionError("the step read the cache again")

    monkeypatch.setattr(teacher.cache, "batch_targets", no_read)
    got = teacher.targets(batch)
    assert torch.equal(got["target_ids"], want_ids)
    assert torch.equal(got["target_logprobs"], want_lps)
