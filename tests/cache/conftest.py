"""Fixtures of the cache tests: a sharper tiny teacher, composed configs, built caches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM

import distill.train  # noqa: F401  (registers the distill_demo resolver)
from distill.run.cache import cache_teacher_logits

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.fixture(scope="session")
def sharp_teacher(tiny_assets, tmp_path_factory):
    """The tiny teacher with its LM head scaled so logits have a trained model's spread
    (std ~4): top-k then holds most of the mass, as with a real teacher."""
    out = tmp_path_factory.mktemp("sharp_teacher")
    model = AutoModelForCausalLM.from_pretrained(tiny_assets["teacher"])
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(out)
    for f in Path(tiny_assets["teacher"]).iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.fixture(scope="session")
def teacher64(sharp_teacher):
    """The sharp teacher in float64: the targets a cache of it holds, recomputed."""
    return AutoModelForCausalLM.from_pretrained(sharp_teacher).double().eval()


def base_overrides(assets, teacher, cache_dir, out) -> list[str]:
    return ["+experiment=offline_fkl", f"paths.output_dir={out}",
            f"teacher.name_or_path={teacher}", f"paths.data={assets['sft_train'].parent}",
            f"cache.dir={cache_dir}", "data.batch_size=4"]


@pytest.fixture(scope="session")
def cache_overrides(tiny_assets, sharp_teacher):
    """The caching job's overrides for the tiny assets (also used on the command line)."""
    def _overrides(cache_dir, *extra, teacher=None):
        ov = base_overrides(tiny_assets, teacher or sharp_teacher, cache_dir,
                            Path(cache_dir).parent / "out")
        return ov + ["trainer.accelerator=cpu", "trainer.devices=1", "cache.shard_size=8",
                     "callbacks.progress.refresh_rate=0", *extra]

    return _overrides


@pytest.fixture(scope="session")
def compose_cache(cache_overrides):
    def _compose(cache_dir, *extra, teacher=None):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("train", overrides=cache_overrides(cache_dir, *extra,
                                                              teacher=teacher))

    return _compose


@pytest.fixture(scope="session")
def compose_train(tiny_assets, sharp_teacher):
    def _compose(cache_dir, *overrides, out):
        ov = base_overrides(tiny_assets, sharp_teacher, cache_dir, out)
        ov += [f"student.name_or_path={tiny_assets['student']}", "evaluate=null",
               "trainer.val_check_interval=5", "trainer.log_every_n_steps=1",
               "callbacks.progress.refresh_rate=0"]
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("train", overrides=ov + list(overrides))

    return _compose


@pytest.fixture(scope="session")
def vocab(tiny_assets):
    from distill.models.causal_lm import load_tokenizer

    return len(load_tokenizer(str(tiny_assets["teacher"])))


@pytest.fixture(scope="session")
def cache_k8(compose_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("cache_k8") / "cache"
    summary = cache_teacher_logits(compose_cache(root, "cache.top_k=8"))
    return root, summary


@pytest.fixture(scope="session")
def cache_kv(compose_cache, tmp_path_factory, vocab):
    root = tmp_path_factory.mktemp("cache_kv") / "cache"
    cache_teacher_logits(compose_cache(root, f"cache.top_k={vocab}"))
    return root
