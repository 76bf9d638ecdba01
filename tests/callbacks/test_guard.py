"""DivergenceGuard and StopOnSignal in real runs: a diverging run stops before its NaN step is
applied, naming it and the last good checkpoint, and exports nothing; patience skips bad
steps; a signal stops the run at the end of the optimizer step under way with a checkpoint
that resumes exactly there; SLURM's requeue signal is deferred to that point too."""

from __future__ import annotations

import signal
from pathlib import Path

import lightning as L
import pytest
import torch

from distill.train import train
from distill.training.callbacks.guard import RunInterrupted, TrainingDiverged
from tests.faults import all_finite, windows_state

FAULTS = "tests.faults"


def _cb(name: str, target: str, **kw) -> list[str]:
    return [f"+callbacks.{name}._target_={target}"] + [f"+callbacks.{name}.{k}={v}"
                                                       for k, v in kw.items()]


class Weights(L.Callback):
    """The student's weights after every optimizer step (class-level: Hydra builds it)."""

    seen: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        w = pl_module.student.get_input_embeddings().weight.detach().clone()
        Weights.seen.append((trainer.global_step, w))


def test_a_diverging_run_stops_at_its_first_non_finite_step(compose_cfg, tmp_path):
    """The issue's case: optimizer.lr=1e3 makes the gradients NaN within a few steps."""
    out = tmp_path / "lr"
    cfg = compose_cfg("+experiment=sft_rkl", "optimizer.lr=1e3", "trainer.max_steps=30",
                      "callbacks.checkpoint.every_n_train_steps=2", out=out)
    with pytest.raises(TrainingDiverged, match=r"diverged at optimizer step \d+") as err:
        train(cfg)
    message = str(err.value)
    assert "is not finite" in message and "patience=1" in message
    assert f"The last good checkpoint is {out / 'checkpoints/last.ckpt'}" in message
    assert "ckpt_path=" in message and "optimizer.lr=<lower>" in message
    assert not (out / "student").exists()  # nothing exported
    ckpt = torch.load(out / "checkpoints/last.ckpt", weights_only=False)
    assert all_finite(ckpt["state_dict"])
    step = int(message.split("optimizer step ")[1].split()[0])
    assert ckpt["global_step"] <= step


def test_the_first_poisoned_step_stops_the_run_before_the_optimizer_applies_it(compose_cfg,
                                                                             tmp_path):
    Weights.seen = []
    cfg = compose_cfg("+experiment=sft_fkl", "trainer.max_steps=8",
                      *_cb("poison", f"{FAULTS}.PoisonGrads", at=3),
                      *_cb("weights", f"{__name__}.Weights"), out=tmp_path / "p1")
    with pytest.raises(TrainingDiverged, match=r"optimizer step 3 .*the gradient norm is not "
                                               r"finite.*No checkpoint was written before it"):
        train(cfg)
    assert [s for s, _ in Weights.seen] == [1, 2, 3]  # the step that failed was not taken


def test_patience_skips_the_bad_steps_and_the_run_finishes_finite(compose_cfg, tmp_path):
    Weights.seen = []
    out = tmp_path / "p2"
    cfg = compose_cfg("+experiment=sft_fkl", "trainer.max_steps=6", "callbacks.guard.patience=2",
                      *_cb("poison", f"{FAULTS}.PoisonGrads", at=3),
                      *_cb("weights", f"{__name__}.Weights"), out=out)
    with pytest.warns(UserWarning, match=r"optimizer step 3: the gradient norm is not finite.*"
                                         r"skipped \(1 bad step"):
        summary = train(cfg)
    assert summary["global_step"] == 6
    weights = dict(Weights.seen)
    torch.testing.assert_close(weights[4], weights[3], rtol=0, atol=0)  # step 3: skipped
    assert not torch.equal(weights[5], weights[4])  # step 4 trained again
    from safetensors.torch import load_file
    assert all_finite(load_file(Path(summary["student_dir"]) / "model.safetensors"))


def test_patience_counts_bad_steps_in_a_row(compose_cfg, tmp_path):
    cfg = compose_cfg("+experiment=sft_fkl", "trainer.max_steps=8", "callbacks.guard.patience=3",
                      *_cb("poison", f"{FAULTS}.PoisonGrads", at=2, steps=3), out=tmp_path / "p3")
    with pytest.warns(UserWarning, match="skipped"), pytest.raises(
            TrainingDiverged, match=r"optimizer step 4 .*3 bad steps in a row"):
        train(cfg)


def _signal_run(compose_cfg, out, signum, *extra):
    """K=2: micro-batch 2 is the first of step 2's window; the signal arrives there."""
    return compose_cfg("+experiment=sft_fkl", "trainer.max_steps=50",
                       "trainer.accumulate_grad_batches=2",
                       *_cb("kill", f"{FAULTS}.SendSignal", batch=2, signum=int(signum)), *extra,
                       out=out)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_at_the_end_of_the_step_with_a_checkpoint_that_resumes_there(
        compose_cfg, tmp_path, signum, recwarn):
    out = tmp_path / "sig"
    before = signal.getsignal(signum)
    with pytest.raises(RunInterrupted) as err:
        train(_signal_run(compose_cfg, out, signum))
    stop = err.value
    assert stop.exit_code == 128 + signum and stop.checkpoint == out / "checkpoints/last.ckpt"
    assert "at the end of optimizer step 2" in str(stop) and "ckpt_path=" in str(stop)
    assert signal.getsignal(signum) is before  # handlers restored
    assert not (out / "student").exists()
    ckpt = torch.load(stop.checkpoint, weights_only=False)
    assert ckpt["global_step"] == 2
    state = windows_state(ckpt)
    assert state["position"] == 4 and state["accumulate"] == 2  # a step boundary
    summary = train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=4",
                                "trainer.accumulate_grad_batches=2", "ckpt_path=last", out=out))
    assert summary["global_step"] == 4 and summary["student_dir"]
    assert not [w for w in recwarn if "middle of a step window" in str(w.message)]


def test_without_the_signal_callback_sigterm_still_exits_non_zero(compose_cfg, tmp_path):
    """Lightning's own handler ends fit with SIGTERMException, a SystemExit of status 0."""
    cfg = _signal_run(compose_cfg, tmp_path / "plain", signal.SIGTERM, "callbacks.signals=null",
                      "callbacks.checkpoint.every_n_train_steps=1")
    with pytest.raises(RunInterrupted, match=r"stopped by SIGTERM through Lightning's own "
                                             r"handler .*the last checkpoint is .*last.ckpt; "
                                             r"resume with: run it again with ckpt_path=") as err:
        train(cfg)
    assert err.value.exit_code == 143


def test_a_second_ctrl_c_stops_at_once(compose_cfg, tmp_path):
    cfg = _signal_run(compose_cfg, tmp_path / "twice", signal.SIGINT,
                      *_cb("again", f"{FAULTS}.SendSignal", batch=2, signum=int(signal.SIGINT)))
    with pytest.raises(SystemExit) as err:  # Lightning's own KeyboardInterrupt path
        train(cfg)
    assert err.value.code == 1
    assert not (tmp_path / "twice/checkpoints/last.ckpt").exists()


def test_the_slurm_requeue_signal_waits_for_the_step_boundary(compose_cfg, tmp_path,
                                                              monkeypatch):
    """Lightning's SLURM auto-requeue (SIGUSR1: save an hpc checkpoint, scontrol requeue),
    with the SLURM environment Lightning detects; the signal arrives mid-window, and
    Lightning's handler saves at the end of that step, then the run goes on."""
    for key, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "distill", "SLURM_JOB_ID": "77",
                       "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                       "SLURM_NODELIST": "localhost"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol: Lightning logs the failed requeue
    out = tmp_path / "slurm"
    summary = train(_signal_run(compose_cfg, out, signal.SIGUSR1, "trainer.max_steps=4"))
    assert summary["global_step"] == 4  # the requeue signal does not stop the run
    hpc = torch.load(out / "hpc_ckpt_1.ckpt", weights_only=False)
    assert hpc["global_step"] == 2 and windows_state(hpc)["position"] == 4
