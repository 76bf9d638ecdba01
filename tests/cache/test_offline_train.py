"""`train(cfg)` with +experiment=offline_fkl: trains from the cache, no teacher model; the
first step's loss is the divergence against the teacher model's own top-8, recomputed
(tests/step_check.py) to the cache's fp16 rounding."""

from __future__ import annotations

import math

import pandas as pd
import pytest

import distill.training.teachers
from distill.train import train
from tests.step_check import CACHED_RTOL, assert_first_step_loss, record_first_step


@pytest.fixture
def no_live_teacher(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the offline experiment must not load a teacher model")

    monkeypatch.setattr(distill.training.teachers.LiveTeacher, "__init__", refuse)


def train_losses(compose_train, cache_dir, out, monkeypatch, teacher, *overrides):
    """The logged train/loss of each step; the first one checked against the teacher."""
    cfg = compose_train(cache_dir, "cache.top_k=8", "trainer.val_check_interval=3",
                        *overrides, out=out)
    first = record_first_step(monkeypatch)
    summary = train(cfg)
    assert summary["metrics"]["val/kl"] > 0  # validation reads the cached val split
    losses = pd.read_csv(next(out.glob("logs/version_*/metrics.csv")))["train/loss"].dropna()
    assert first.loss == pytest.approx(losses.iloc[0], rel=1e-6)
    assert_first_step_loss(first, cfg.loss, rtol=CACHED_RTOL, cached_teacher=teacher, top_k=8)
    return losses


def test_offline_experiment_trains_and_loss_goes_down(compose_train, cache_k8, tmp_path,
                                                      no_live_teacher, monkeypatch, teacher64):
    losses = train_losses(compose_train, cache_k8[0], tmp_path / "out", monkeypatch, teacher64,
                          "trainer.max_steps=12")
    first, last = losses.iloc[:3].mean(), losses.iloc[-3:].mean()
    print(f"\nforward_kl from the K=8 cache: train/loss {first:.4f} -> {last:.4f}")
    assert len(losses) == 12 and last < first


@pytest.mark.parametrize("loss", ["reverse_kl", "jsd"])
def test_other_divergences_train_from_the_cache(compose_train, cache_k8, tmp_path,
                                                no_live_teacher, monkeypatch, teacher64, loss):
    losses = train_losses(compose_train, cache_k8[0], tmp_path / "out", monkeypatch, teacher64,
                          f"loss={loss}", "trainer.max_steps=3")
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses)
