"""The recipes for one's own models: hf_offline (the caching job and the training run read
one config), hf_onpolicy, their real-model defaults, and trainer=auto (the GPU where there
is one, else the CPU; a GPU preset on a machine without one is refused before loading)."""

from __future__ import annotations

import pytest
import torch

import distill.training.teachers
from distill.run.cache import cache_teacher_logits
from distill.run.config import ConfigError, parse
from distill.train import train


def _models(tiny_assets) -> list[str]:
    return [f"student.name_or_path={tiny_assets['student']}",
            f"teacher.name_or_path={tiny_assets['teacher']}",
            f"paths.data={tiny_assets['sft_train'].parent}"]


@pytest.mark.parametrize("experiment", ["hf_sft", "hf_offline", "hf_onpolicy"])
def test_real_model_recipes_keep_real_model_defaults(experiment, compose_cfg, tiny_assets):
    cfg = compose_cfg(f"+experiment={experiment}", *_models(tiny_assets),
                      "cache.dir=/tmp/c" if experiment == "hf_offline" else "data.packing=false")
    run = parse(cfg)
    assert run.evaluate is None  # no demo-task scoring of one's own models
    assert run.student.from_scratch is False and run.student.disable_dropout
    assert run.loss.temperature == 1.0 and cfg.optimizer.lr == 2e-5
    assert cfg.data.max_length == 2048 and cfg.trainer.accelerator == "auto"
    if experiment == "hf_offline":
        assert run.teacher.kind == "cached" and run.cache.top_k == 64
    if experiment == "hf_onpolicy":
        assert run.loss.kind == "jsd" and run.loss.on_policy.fraction == 0.5


def test_the_offline_recipe_caches_then_trains_from_one_config(compose_cfg, tiny_assets,
                                                               tmp_path, monkeypatch):
    overrides = ["+experiment=hf_offline", *_models(tiny_assets), f"cache.dir={tmp_path / 'c'}",
                 "cache.top_k=8", "trainer.max_steps=3", "trainer.val_check_interval=3"]
    cached = cache_teacher_logits(compose_cfg(*overrides))
    assert cached["run_examples"] > 0 and cached["dir"] == str(tmp_path / "c")

    def refuse(*args, **kwargs):
        raise AssertionError("training from the cache must not load the teacher model")

    monkeypatch.setattr(distill.training.teachers.LiveTeacher, "__init__", refuse)
    summary = train(compose_cfg(*overrides))
    assert summary["global_step"] == 3 and summary["metrics"]["val/kl"] > 0


def test_a_cache_of_another_teacher_is_refused(compose_cfg, tiny_assets, tmp_path):
    overrides = ["+experiment=hf_offline", *_models(tiny_assets), f"cache.dir={tmp_path / 'c'}",
                 "cache.top_k=8", "trainer.max_steps=1"]
    cache_teacher_logits(compose_cfg(*overrides))
    with pytest.raises(ValueError, match="teacher"):
        train(compose_cfg(*overrides, f"teacher.name_or_path={tiny_assets['student']}"))


def test_training_before_the_cache_says_which_command_writes_it(compose_cfg, tiny_assets,
                                                                tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no teacher cache at .*: write it first with "
                                                r"distill-cache and the same overrides"):
        train(compose_cfg("+experiment=hf_offline", *_models(tiny_assets),
                          f"cache.dir={tmp_path / 'none'}"))


def test_the_onpolicy_recipe_samples_and_trains(compose_cfg, tiny_assets, tmp_path):
    out = tmp_path / "run"
    summary = train(compose_cfg("+experiment=hf_onpolicy", *_models(tiny_assets),
                                "loss.on_policy.max_new_tokens=8", "trainer.max_steps=2",
                                "trainer.val_check_interval=2", out=out))
    m = summary["metrics"]
    assert summary["global_step"] == 2 and m["rollout/mean_length"] > 0
    assert "rollout/teacher_logprob" in m and torch.isfinite(torch.tensor(m["train/loss"]))


def test_trainer_auto_finds_the_cpu_here(compose_cfg, tiny_assets, monkeypatch):
    from hydra.utils import instantiate

    cfg = compose_cfg("+experiment=hf_sft", *_models(tiny_assets))
    if torch.cuda.is_available():
        assert cfg.trainer.precision == "bf16-mixed"
        return
    assert cfg.trainer.precision == "32-true"
    trainer = instantiate(cfg.trainer, logger=False, enable_checkpointing=False)
    assert trainer.accelerator.__class__.__name__ == "CPUAccelerator"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert compose_cfg("trainer=auto").trainer.precision == "bf16-mixed"


# ids other than "gpu": that keyword is the marker of tests that need a GPU
@pytest.mark.parametrize("preset", ["gpu", "gpu_bf16_true", "fsdp"], ids=lambda p: f"preset_{p}")
def test_a_gpu_preset_without_a_gpu_is_refused_before_anything_loads(preset, compose_cfg,
                                                                     monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # model folders that do not exist: the refusal comes first, before any loading
    cfg = compose_cfg("+experiment=hf_sft", f"trainer={preset}",
                      "student.name_or_path=/nowhere/student",
                      "teacher.name_or_path=/nowhere/teacher", "paths.data=/nowhere")
    with pytest.raises(ConfigError, match=r"trainer\.accelerator=gpu: this machine has no CUDA "
                                          r"GPU; use trainer=cpu \(or trainer\.accelerator=auto"):
        train(cfg)


def _package_cfg(*overrides):
    """The package's own config (the demo's defaults, no test swaps)."""
    from hydra import compose, initialize_config_module

    with initialize_config_module("distill.conf", version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize("experiment, demo", [("hf_sft", False), ("hf_offline", False),
                                              ("hf_onpolicy", False), ("onpolicy_demo", True),
                                              ("sft_rkl", True)])
def test_the_demo_evaluation_runs_on_the_demo_only(experiment, demo, tiny_assets):
    from distill.demo.task_eval import TaskAccuracy
    from distill.models.causal_lm import load_tokenizer
    from distill.run.assemble import build_callbacks

    cfg = _package_cfg(f"+experiment={experiment}", *_models(tiny_assets))
    run = parse(cfg)
    callbacks = build_callbacks(cfg, run, load_tokenizer(str(tiny_assets["teacher"])))
    assert any(isinstance(cb, TaskAccuracy) for cb in callbacks) == demo
    assert (run.evaluate is not None) == demo


def test_a_run_on_ones_own_models_prints_no_demo_accuracy(compose_cfg, tiny_assets, capsys):
    summary = train(compose_cfg("+experiment=hf_sft", *_models(tiny_assets),
                                "trainer.max_steps=1", "data.val=null"))
    printed = capsys.readouterr().out
    assert summary["accuracy"] == {} and summary["references"] == []
    assert "distill: run summary" in printed and "demo-task" not in printed
    assert "recorded references" not in printed
