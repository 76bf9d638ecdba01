"""End to end on CPU: every experiment composes, instantiates and trains; the student
reloads; a run resumes from its checkpoint."""

from pathlib import Path

import lightning as L
import pandas as pd
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from distill.train import train
from distill.training.module import DistillModule
from tests.fixtures import student_from, teacher_from

EXPERIMENTS = sorted(p.stem for p in (Path(__file__).parents[1] / "conf/experiment").glob("*.yaml"))
LIVE = [e for e in EXPERIMENTS if "offline" not in e]  # a cached teacher needs its cache


def _train_losses(out: Path) -> list[float]:
    df = pd.read_csv(next(out.glob("logs/version_*/metrics.csv")))
    return df["train/loss"].dropna().tolist()


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_and_instantiates(experiment, compose_cfg):
    cfg = compose_cfg(f"+experiment={experiment}")
    assert OmegaConf.select(cfg, "loss.kind") in ("forward_kl", "reverse_kl", "jsd")
    student = student_from(cfg)
    if experiment in LIVE:
        teacher = teacher_from(cfg)
    else:  # a cached teacher needs its cache: tests/cache/test_offline_train.py trains it
        assert cfg.teacher.kind == "cached"
        teacher = None
    module = DistillModule(student, teacher, loss=OmegaConf.to_container(cfg.loss, resolve=True),
                           optimizer=instantiate(cfg.optimizer))
    assert module.cfg.kind == module.objective.spec.kind == cfg.loss.kind
    trainer = instantiate(cfg.trainer, callbacks=[instantiate(c) for c in cfg.callbacks.values()])
    assert trainer.max_steps == cfg.trainer.max_steps


@pytest.mark.parametrize("experiment", LIVE)
def test_experiment_trains_and_loss_goes_down(experiment, compose_cfg, tmp_path):
    out = tmp_path / experiment
    # short samples: hf_onpolicy's 128 new tokens cost minutes on a CPU and test nothing more
    cfg = compose_cfg(f"+experiment={experiment}", "trainer.max_steps=24",
                      "optimizer.lr=1e-2", "scheduler=none", "loss.on_policy.max_new_tokens=16",
                      out=out)
    summary = train(cfg)
    assert summary["global_step"] == 24
    losses = _train_losses(out)
    assert len(losses) == 24 and all(map(torch.isfinite, torch.tensor(losses)))
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.8 * first, (first, last)
    assert "val/loss" in summary["metrics"] and "val/teacher_ppl" in summary["metrics"]
    # the summary's trained tokens: every step's valid positions, as each step logged them
    df = pd.read_csv(next(out.glob("logs/version_*/metrics.csv")))
    steps = df["train/step_valid_tokens"].dropna()
    assert len(steps) == 24 and summary["trained_tokens"] == int(steps.sum()) > 0


def test_saved_student_reloads_and_matches(compose_cfg, tmp_path, tiny_assets):
    out = tmp_path / "run"
    cfg = compose_cfg("+experiment=sft_fkl", "trainer.max_steps=3", out=out)
    summary = train(cfg)
    saved = AutoModelForCausalLM.from_pretrained(summary["student_dir"])
    ids = torch.randint(0, saved.config.vocab_size, (2, 9))
    untrained = AutoModelForCausalLM.from_pretrained(tiny_assets["student"])
    assert (Path(summary["student_dir"]) / "tokenizer_config.json").exists()
    with torch.no_grad():
        # training moved the weights: the export is not the initial model
        assert not torch.allclose(saved(ids).logits, untrained(ids).logits)
        ckpt = torch.load(out / "checkpoints/last.ckpt", weights_only=False)
    state = {k.removeprefix("student."): v for k, v in ckpt["state_dict"].items()}
    assert not any(k.startswith("teacher.") for k in ckpt["state_dict"])
    for name, p in saved.state_dict().items():
        torch.testing.assert_close(p, state[name])


def test_resume_continues_to_max_steps(compose_cfg, tmp_path):
    out = tmp_path / "resume"
    cb = ["callbacks.checkpoint.every_n_train_steps=2"]
    train(compose_cfg("+experiment=sft_rkl", "trainer.max_steps=4", *cb, out=out))
    ckpt = out / "checkpoints/last.ckpt"
    assert torch.load(ckpt, weights_only=False)["global_step"] == 4
    summary = train(compose_cfg("+experiment=sft_rkl", "trainer.max_steps=6", *cb,
                                f"ckpt_path={ckpt}", out=out))
    assert summary["global_step"] == 6


def test_no_checkpoint_callback_writes_no_checkpoint(compose_cfg, tmp_path):
    """callbacks.checkpoint=null: Lightning must not add its default ModelCheckpoint (at real
    scale it writes the fp32 student and its optimizer state at every validation)."""
    out = tmp_path / "nockpt"
    summary = train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=2",
                                "trainer.val_check_interval=1", "callbacks.checkpoint=null",
                                out=out))
    assert summary["global_step"] == 2 and "val/loss" in summary["metrics"]
    assert not list(out.rglob("*.ckpt"))
    # and with the callback, the same run writes its checkpoint (the check above can fail)
    out2 = tmp_path / "ckpt"
    train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=2",
                      "trainer.val_check_interval=1", out=out2))
    assert list(out2.rglob("*.ckpt"))


class _GradsAtForward(L.Callback):
    """Whether any student gradient exists when each micro-batch's forward starts."""

    def __init__(self):
        self.seen: list[tuple[int, bool]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        held = any(p.grad is not None for p in pl_module.student.parameters())
        self.seen.append((batch_idx, held))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_gradients_are_freed_after_each_optimizer_step(accumulate, compose_cfg, tmp_path,
                                                       monkeypatch):
    """Lightning zeroes the gradients after the next forward; DistillModule frees them at
    the optimizer step, so a window's first forward never runs beside the last step's
    gradients (a student-sized fp32 tensor at the allocator's peak on the GPU)."""
    import distill.run.assemble

    rec, build = _GradsAtForward(), distill.run.assemble.build_callbacks
    monkeypatch.setattr(distill.run.assemble, "build_callbacks",
                        lambda *a, **kw: [*build(*a, **kw), rec])
    train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=3",
                      f"trainer.accumulate_grad_batches={accumulate}", out=tmp_path / "g"))
    assert len(rec.seen) == 3 * accumulate
    # a window's first micro-batch starts without gradients; later ones accumulate
    assert [held for _, held in rec.seen] == [i % accumulate != 0 for i in range(len(rec.seen))]
