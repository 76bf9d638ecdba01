"""What the logs show: the learning rate and the gradient norm before clipping each step,
on-policy samples (jsonl, TensorBoard text), a resumed run continuing its logger version,
the final metrics a sweep reads, its summary table, and the known noise silenced (only it)."""

from __future__ import annotations

import json
import logging
import math
import re
import warnings
from types import SimpleNamespace

import lightning as L
import pandas as pd
import pytest
import torch

from distill.run.sweep import write_summary
from distill.train import train
from distill.training.state import grad_norm


def _csv(out):
    (path,) = out.glob("logs/version_*/metrics.csv")
    return pd.read_csv(path)


class Probe(L.Callback):
    """Records each step's learning rates and float64 gradient norm, at the hook where
    Lightning has the whole step's gradient and has not clipped it yet."""

    steps: list = []

    def on_fit_start(self, trainer, pl_module):
        Probe.steps = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad.double() for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
        Probe.steps.append({"lr": [g["lr"] for g in optimizer.param_groups],
                            "norm": float(torch.sqrt(sum((g**2).sum() for g in grads)))})


PROBE = "+callbacks.probe._target_=tests.test_logs.Probe"


def test_learning_rate_and_gradient_norm_before_clipping_each_step(compose_cfg, tmp_path):
    out = tmp_path / "run"
    # a clip far below the gradient's norm: a norm read after clipping would be 1e-4
    train(compose_cfg("+experiment=sft_fkl", "optimizer=adamw_grouped", "scheduler=warmup_cosine",
                      "scheduler.warmup_ratio=0.5", "trainer.max_steps=4",
                      "trainer.gradient_clip_val=1e-4", "trainer.accumulate_grad_batches=2",
                      PROBE, out=out))
    csv = _csv(out)
    lr, norm = csv["train/lr"].dropna().tolist(), csv["train/grad_norm"].dropna().tolist()
    assert len(lr) == len(norm) == 4 == len(Probe.steps)
    assert lr == pytest.approx([s["lr"][0] for s in Probe.steps], rel=1e-6)
    assert lr[0] < lr[1] and max(lr) == pytest.approx(2e-5, rel=1e-6)  # warmup, then decay
    assert all(s["lr"][0] == s["lr"][1] for s in Probe.steps)  # two groups, one rate
    assert "train/lr_1" not in csv  # a second key only for a second rate
    assert norm == pytest.approx([s["norm"] for s in Probe.steps], rel=1e-5)
    assert min(norm) > 1e-2  # the norm before clipping, not the clipped 1e-4


def test_a_second_learning_rate_gets_its_own_key(compose_cfg, tmp_path, monkeypatch):
    from distill.training import optim

    original = optim.adamw

    def two_rates(params, lr, **kwargs):
        opt = original(params, lr=lr, **kwargs)
        opt.param_groups[1]["lr"] = lr / 10
        return opt

    monkeypatch.setattr(optim, "adamw", two_rates)
    out = tmp_path / "run"
    train(compose_cfg("+experiment=sft_fkl", "optimizer=adamw_grouped", "scheduler=none",
                      "trainer.max_steps=2", out=out))
    csv = _csv(out)
    assert csv["train/lr"].dropna().tolist() == pytest.approx([2e-5, 2e-5])
    assert csv["train/lr_1"].dropna().tolist() == pytest.approx([2e-6, 2e-6])


def test_gradient_norm_sums_the_shards_under_fsdp():
    from lightning.pytorch.strategies import FSDPStrategy

    class TwoShards(FSDPStrategy):  # the type only; the other rank holds the same shard
        def __init__(self):
            pass

        def reduce(self, tensor, reduce_op="sum", **kwargs):
            assert reduce_op == "sum"
            return tensor * 2

    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 0.0, 4.0])
    opt = torch.optim.SGD([p], lr=0.1)
    assert float(grad_norm(opt, SimpleNamespace())) == pytest.approx(5.0)  # DDP, one device
    assert float(grad_norm(opt, TwoShards())) == pytest.approx(5.0 * math.sqrt(2))
    p.grad = None
    assert grad_norm(opt, SimpleNamespace()) is None


def test_gradient_norm_over_mixed_dtypes_matches_a_float64_sum():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(257, generator=g) * 1e3, torch.randn(3, 5, generator=g),
             (torch.randn(64, generator=g) * 40).bfloat16(), torch.full((2,), 1e-20)]
    params = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads]
    for p, x in zip(params, grads):
        p.grad = x
    opt = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:]}], lr=0.1)
    want = math.sqrt(sum(float((x.double() ** 2).sum()) for x in grads))
    got = grad_norm(opt, SimpleNamespace())
    assert got.dtype == torch.float32 and float(got) == pytest.approx(want, rel=1e-6)


def test_a_samples_teacher_logprob_is_the_mean_over_its_completion(tiny_assets):
    """Against the teacher's own forward().logits, log-softmax in float64."""
    from distill.models.causal_lm import load_causal_lm
    from distill.training.callbacks.logs import teacher_logprob
    from distill.training.teachers import LiveTeacher

    model = load_causal_lm(str(tiny_assets["teacher"]))
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # a spread of log-probs, not a flat -log V
    prompt, completion = [4, 9, 12, 30, 5], [17, 22, 8, 3]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0].double(),
                                 -1)
    ref = logp[torch.arange(4, 8), torch.tensor(completion)].mean()
    module = SimpleNamespace(teacher=LiveTeacher.from_model(model), vocab_size=None)
    assert teacher_logprob(module, prompt, completion) == pytest.approx(float(ref), abs=1e-5)
    assert float(ref) < -1.0  # a number the test can tell from another
    assert teacher_logprob(SimpleNamespace(teacher=SimpleNamespace(model=None)), prompt,
                           completion) is None


def test_onpolicy_samples_are_logged_every_n_steps(compose_cfg, tmp_path, tiny_assets):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


    out = tmp_path / "run"
    train(compose_cfg("+experiment=onpolicy_rkl", "logger=[csv,tensorboard]",
                      "trainer.max_steps=5", "callbacks.samples.every_n_steps=2",
                      "callbacks.samples.max_samples=3", "loss.on_policy.max_new_tokens=6",
                      out=out))
    rows = [json.loads(line) for line in
            next(out.glob("logs/version_*/samples.jsonl")).read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] * 3 + [2] * 3 + [4] * 3
    assert {r["writer"] for r in rows} == {"student"}  # onpolicy_rkl: the student writes all
    for r in rows:
        assert r["prompt"].startswith("<|user|>") and 1 <= r["completion_tokens"] <= 6
        assert math.isfinite(r["teacher_logprob"]) and r["teacher_logprob"] < 0
    events = EventAccumulator(str(out / "tb/version_0")).Reload()
    assert "rollout/samples/text_summary" in events.Tags()["tensors"]


def test_a_run_without_samples_logs_none(compose_cfg, tmp_path):
    out = tmp_path / "run"
    train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=2",
                      "callbacks.samples.every_n_steps=1", out=out))
    assert not list(out.glob("logs/version_*/samples.jsonl"))


def test_a_resumed_run_continues_its_logger_version(compose_cfg, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    common = ["+experiment=sft_fkl", "logger=[csv,tensorboard]", "trainer.val_check_interval=3"]
    train(compose_cfg(*common, "trainer.max_steps=3", out=out))
    # as a killed run leaves them: rows logged after its last checkpoint (step 3)
    path = out / "logs/version_0/metrics.csv"
    killed = pd.read_csv(path)
    extra = killed.tail(1).assign(step=[7])
    pd.concat([killed, extra]).to_csv(path, index=False)
    with pytest.warns(UserWarning, match=r"1 rows of steps >= \d from an earlier run"):
        train(compose_cfg(*common, "trainer.max_steps=6", "ckpt_path=last", out=out))
    assert [p.name for p in (out / "logs").iterdir()] == ["version_0"]
    assert [p.name for p in (out / "tb").iterdir()] == ["version_0"]
    csv = _csv(out)
    # the 3 steps of the first run, then the resumed run's 3 (at the steps Lightning
    # numbers them after a resume), once each, in order; the killed run's row is gone
    steps = csv.dropna(subset=["train/loss"])["step"].tolist()
    assert len(steps) == 6 and steps[:3] == [0, 1, 2] and steps == sorted(set(steps))
    assert max(csv["step"]) < 7 and csv["val/loss"].notna().sum() == 2
    scalars = EventAccumulator(str(out / "tb/version_0")).Reload().Scalars("train/loss")
    assert [s.step for s in scalars] == steps


def test_final_metrics_for_the_sweep_summary(compose_cfg, tmp_path):
    out = tmp_path / "run"
    summary = train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=3",
                                "trainer.val_check_interval=3", out=out))
    saved = json.loads((out / "final_metrics.json").read_text())
    assert saved["global_step"] == 3
    assert saved["val/loss"] == pytest.approx(summary["metrics"]["val/loss"])


def test_sweep_summary_table(tmp_path):
    for job, (kind, loss) in enumerate([("forward_kl", 0.5), ("reverse_kl", 0.25)]):
        folder = tmp_path / str(job)
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra/overrides.yaml").write_text(
            f"- +experiment=sft_rkl\n- loss.kind={kind}\n")
        (folder / "final_metrics.json").write_text(json.dumps(
            {"global_step": 10, "val/loss": loss, "train/loss": 2 * loss, "train/lengths": 9,
             "accuracy/distilled student": 0.5 + loss}))
    (tmp_path / "2").mkdir()  # a job that did not finish: no final_metrics.json
    text = write_summary(tmp_path)
    assert "every job: +experiment=sft_rkl" in text
    assert ("| job | loss.kind | steps | accuracy/distilled student | val/loss | train/loss |"
            in text)
    assert "| 0 | forward_kl | 10 | 1 | 0.5 | 1 |" in text
    assert "| 1 | reverse_kl | 10 | 0.75 | 0.25 | 0.5 |" in text
    table = pd.read_csv(tmp_path / "summary.csv")
    assert table["loss.kind"].tolist() == ["forward_kl", "reverse_kl"]
    assert "train/lengths" not in table  # counters are no comparison
    assert write_summary(tmp_path / "2") is None


def test_known_noise_is_silenced_and_only_it(compose_cfg, tmp_path, caplog, monkeypatch):
    # Lightning stops its records at its own handler when it was first imported with no
    # root handler (at collection, in some test orders): let caplog's root handler see them
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.INFO):
        warnings.simplefilter("default")
        train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=2", out=tmp_path / "a"))
    messages = [str(w.message) for w in seen]
    assert not any("eval mode" in m or "LeafSpec" in m for m in messages), messages
    logged = [r.getMessage() for r in caplog.records]
    assert not any("Tip: For seamless" in m for m in logged), logged
    assert any("GPU available" in m for m in logged)  # Lightning's other messages still show
    assert any("frozen teacher's 34 modules stay in eval mode" in m for m in logged)
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    other = logging.LogRecord(rank_zero.name, logging.INFO, "", 0, "a real message", None, None)
    assert rank_zero.filter(other)


class EvalStudentLayer(L.Callback):
    """A student module that stays in eval mode in training: a real problem to warn about."""

    def setup(self, trainer, pl_module, stage):  # before any on_fit_start
        norm = pl_module.student.model.norm
        norm.train = lambda mode=True: torch.nn.Module.train(norm, False)
        norm.eval()


def test_a_student_module_in_eval_mode_still_warns(compose_cfg, tmp_path):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=1",
                          "+callbacks.eval_layer._target_=tests.test_logs.EvalStudentLayer",
                          out=tmp_path / "a"))
    assert any("module(s) in eval mode" in str(w.message) for w in seen)


def test_a_resumed_run_continues_its_wandb_run(compose_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    common = ["+experiment=sft_fkl", "logger=wandb"]
    train(compose_cfg(*common, "trainer.max_steps=2", out=out))
    train(compose_cfg(*common, "trainer.max_steps=3", "ckpt_path=last", out=out))
    run_id = (out / "wandb/distill_run_id").read_text().strip()
    runs = sorted(p.name for p in out.glob("wandb/offline-run-*"))
    # wandb names a run's folder offline-run-<time>-<id>, with -1 added when two start in
    # the same second
    own = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    assert len(runs) == 2 and all(own.fullmatch(name) for name in runs), runs
    other = tmp_path / "other"
    train(compose_cfg(*common, "trainer.max_steps=1", out=other))
    assert (other / "wandb/distill_run_id").read_text().strip() != run_id
