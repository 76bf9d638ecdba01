"""A cache written for something else is refused, with an error naming what differs."""

from __future__ import annotations

import pytest
import torch

from distill.cache import CacheMismatch
from distill.data import DistillDataModule
from distill.models.causal_lm import load_tokenizer
from distill.run.cache import cache_teacher_logits
from distill.training.teachers import CachedTeacher
from tests.fixtures import data_from, make_tokenizer


@pytest.fixture(scope="module")
def cached(cache_k8, sharp_teacher):
    return CachedTeacher(str(cache_k8[0]), str(sharp_teacher), top_k=8)


@pytest.fixture(scope="module")
def data(compose_train, cache_k8, tiny_assets, tmp_path_factory):
    cfg = compose_train(cache_k8[0], "cache.top_k=8", out=tmp_path_factory.mktemp("o"))
    tok = load_tokenizer(str(tiny_assets["student"]))
    return cfg, tok


@pytest.mark.parametrize("field,kwargs", [
    ("teacher", {"teacher": "some/other-teacher"}),
    ("top_k", {"top_k": 16}),
    ("temperature", {"temperature": 2.0}),
])
def test_teacher_k_and_temperature(cache_k8, sharp_teacher, field, kwargs):
    args = {"teacher": str(sharp_teacher), "top_k": 8, **kwargs}
    with pytest.raises(CacheMismatch, match=field) as err:
        CachedTeacher(str(cache_k8[0]), **args)
    assert err.value.field == field


def test_matching_data_passes_and_is_served_the_teachers_top_k(cached, data, teacher64):
    """The data the cache was written for passes every check, and each of its trained
    positions is served the teacher model's own top-8 (recomputed here in float64; the
    cache rounds the log-probs to fp16); untrained positions hold id 0, log-prob 0."""
    cfg, tok = data
    dm = data_from(cfg, tok)
    assert cached.check_data(dm, tok) is None
    batch = next(iter(dm.val_dataloader()))
    served = cached.targets(batch)
    ids, lps = served["target_ids"].long(), served["target_logprobs"].double()
    with torch.no_grad():
        zt = teacher64(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logp = torch.log_softmax(zt.logits[:, :-1, :len(tok)].flatten(0, 1).double(), -1)
    trained = batch["labels"][:, 1:].flatten() != -100
    assert trained.any() and (~trained).any()
    top = logp[trained].topk(8, dim=-1)
    want = torch.zeros_like(logp[trained]).scatter(-1, top.indices, top.values)
    got = torch.zeros_like(want).scatter(-1, ids[trained], lps[trained])
    torch.testing.assert_close(got, want, rtol=2.0**-11, atol=1e-6)
    assert (ids[~trained] == 0).all() and (lps[~trained] == 0).all()


def test_tokenizer(cached, data, tmp_path):
    cfg, _ = data
    other = make_tokenizer(tmp_path, extra_chars="@#")
    with pytest.raises(CacheMismatch, match="tokenizer") as err:
        cached.check_data(data_from(cfg, other), other)
    assert err.value.field == "tokenizer"


def test_max_length(cached, data):
    cfg, tok = data
    with pytest.raises(CacheMismatch, match="max_length") as err:
        cached.check_data(data_from(cfg, tok, max_length=64), tok)
    assert err.value.field == "max_length"


@pytest.mark.parametrize("split", ["train", "val"])
def test_data_fingerprint(cached, data, split):
    cfg, tok = data
    sources = {"train": list(cfg.data.train), "val": list(cfg.data.val)}
    sources[split] = [{**sources[split][0], "max_examples": 5}]  # other examples
    dm = DistillDataModule(tok, train=sources["train"], val=sources["val"], max_length=128)
    with pytest.raises(CacheMismatch, match="data fingerprint") as err:
        cached.check_data(dm, tok)
    assert err.value.field.startswith(f"data.{split}")


def test_changed_example_tokens_and_unknown_example(cached, data):
    cfg, tok = data
    dm = data_from(cfg, tok)
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    cached.targets(batch)  # the real batch is served
    batch["input_ids"][0, 1] += 1
    with pytest.raises(CacheMismatch, match="tokens of example"):
        cached.targets(batch)
    batch["input_ids"][0, 1] -= 1
    batch["example_id"][0] = "nowhere:0"
    with pytest.raises(KeyError, match="not in the teacher cache"):
        cached.targets(batch)


def test_the_job_refuses_a_folder_holding_another_cache(compose_cache, cache_k8):
    with pytest.raises(CacheMismatch, match="top_k") as err:
        cache_teacher_logits(compose_cache(cache_k8[0], "cache.top_k=4"))
    assert err.value.field == "top_k"
    with pytest.raises(CacheMismatch, match="temperature"):
        cache_teacher_logits(compose_cache(cache_k8[0], "cache.top_k=8",
                                           "loss.temperature=2.0"))
