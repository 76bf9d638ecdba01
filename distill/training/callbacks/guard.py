"""A run that goes wrong stops loudly, at an optimizer-step boundary, with the way back.

- `DivergenceGuard`: before each optimizer step, the step's loss and the gradient norm are
  checked (after accumulation, before clipping: a clipped NaN is still NaN). A non-finite
  one stops the run with `TrainingDiverged`, naming the step and the last good checkpoint,
  before the optimizer applies it: the weights, the checkpoints and the export (which is
  never written) stay finite. With `patience=N` up to N - 1 bad steps in a row are skipped
  (their gradients dropped) instead; the N-th stops the run.
- `StopOnSignal`: SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) are deferred to
  the end of the optimizer step under way, where a resumable checkpoint is saved (the
  atomic checkpoint writer) and the run stops with `RunInterrupted`, whose message is the
  resume command; `python -m distill.train` then exits 128 + the signal (143, 130), so that
  `train && eval` does not carry on. A second Ctrl-C stops at once. The requeue signal
  of Lightning's SLURM auto-requeue (SIGUSR1) is deferred to the step boundary too, where
  Lightning's own handler then saves its checkpoint and requeues the job.

Both decide on every rank alike: each rank's finding is summed over the ranks
(`trainer.strategy.reduce`), so all ranks skip, save or stop at the same step.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import threading
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn

from distill.core.rules import boolean, integer
from distill.training.state import step_grad_norm  # the one the logs show


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm of an optimizer step is NaN or infinite."""


class RunInterrupted(RuntimeError):
    """The run stopped on a signal; `checkpoint` resumes it, `exit_code` is 128 + signal."""

    def __init__(self, message: str, signum: int, checkpoint: Path | None):
        super().__init__(message)
        self.signum, self.checkpoint, self.exit_code = signum, checkpoint, 128 + signum


def last_good_checkpoint(trainer) -> Path | None:
    """The newest checkpoint the run's checkpoint callbacks wrote (None if none yet)."""
    found = []
    for cb in trainer.checkpoint_callbacks:
        named = [cb.last_model_path, cb.best_model_path]
        if cb.dirpath is not None and Path(cb.dirpath).is_dir():
            named += list(Path(cb.dirpath).glob(f"*{cb.FILE_EXTENSION}"))
        found += [Path(p) for p in named if p and Path(p).exists()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resume_command(ckpt: Path) -> str:
    """The command that resumes this run from `ckpt`: the launch's own overrides when Hydra
    launched it (the run keeps its output folder), else the override to add."""
    from hydra.core.hydra_config import HydraConfig

    ckpt_arg = f"ckpt_path={shlex.quote(str(ckpt))}"
    if not HydraConfig.initialized():
        return f"run it again with {ckpt_arg}"
    hydra = HydraConfig.get()
    kept = [o for o in hydra.overrides.task
            if not o.lstrip("+~").startswith(("ckpt_path=", "paths.output_dir="))]
    out = f"paths.output_dir={shlex.quote(str(hydra.runtime.output_dir))}"
    return " ".join(["python -m distill.train", *map(shlex.quote, kept), out, ckpt_arg])


class DivergenceGuard(L.Callback):
    """Stop (or, with patience > 1, skip) an optimizer step whose loss or gradient norm is
    not finite; see the module docstring."""

    SETTINGS = {"patience": integer(1, what=" (bad steps in a row that stop the run; the "
                                           "earlier ones are skipped)"),
                "check_grad_norm": boolean()}

    def __init__(self, patience: int = 1, check_grad_norm: bool = True):
        self.patience, self.check_grad_norm = patience, check_grad_norm
        self.bad_in_a_row, self.skipped = 0, 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # before the module's own hook, which logs (and clears) the step's loss sums
        window = getattr(getattr(pl_module, "sums", None), "window", None)
        loss = window[0].detach().float() if window is not None else None
        # a GradScaler (16-mixed) finds inf gradients on purpose and skips those steps itself
        scaled = getattr(trainer.precision_plugin, "scaler", None) is not None
        check = self.check_grad_norm and not scaled
        norm = step_grad_norm(trainer, pl_module, optimizer) if check else None
        if loss is None and norm is None:
            return
        device = (loss if loss is not None else norm).device
        values = torch.stack([torch.zeros((), device=device) if v is None else v.float()
                              .to(device) for v in (loss, norm)])
        flags = trainer.strategy.reduce((~torch.isfinite(values)).float(), reduce_op="sum")
        loss_v, norm_v, bad_loss, bad_norm = torch.cat([values, flags]).tolist()  # one sync
        if not (bad_loss or bad_norm):
            self.bad_in_a_row = 0
            return
        self.bad_in_a_row += 1
        what = " and ".join(w for w, bad in (("the loss", bad_loss),
                                              ("the gradient norm", bad_norm)) if bad)
        found = (f"{what} is not finite (loss {loss_v:.4g}" + (f", gradient norm {norm_v:.4g}"
                 if norm is not None else "") + " on this rank)")
        step = trainer.global_step
        if self.bad_in_a_row >= self.patience:
            raise TrainingDiverged(self._stop_message(trainer, step, found))
        optimizer.zero_grad(set_to_none=True)  # the optimizer skips parameters without grads
        self.skipped += 1
        rank_zero_warn(f"optimizer step {step}: {found}: skipped ({self.bad_in_a_row} bad "
                       f"step(s) in a row; callbacks.guard.patience={self.patience} stops the "
                       "run)")

    def _stop_message(self, trainer, step: int, found: str) -> str:
        ckpt = last_good_checkpoint(trainer)
        if ckpt is None:
            back = ("No checkpoint was written before it: run again with a lower "
                    "optimizer.lr (or trainer.gradient_clip_val)")
        else:
            back = (f"The last good checkpoint is {ckpt}: resume from it with a lower "
                    f"learning rate, ckpt_path={shlex.quote(str(ckpt))} optimizer.lr=<lower>")
        rows = f"{self.bad_in_a_row} bad steps in a row, " if self.bad_in_a_row > 1 else ""
        return (f"the run diverged at optimizer step {step} (counted from 0, as "
                f"trainer.global_step and the logs' `step`): {found}. "
                f"Stopped before the optimizer applied it ({rows}callbacks.guard.patience="
                f"{self.patience}); the weights are those of the step before, and no student "
                f"was exported. {back}")


# the signals that stop a run at the next step boundary, and their names in messages
STOP_SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}


def requeue_signals(trainer) -> set[int]:
    """Signals whose handler saves a checkpoint and requeues the job (Lightning's SLURM
    auto-requeue: SIGUSR1 unless the environment names another)."""
    env = getattr(trainer.strategy, "cluster_environment", None)
    named = getattr(env, "requeue_signal", None) if getattr(env, "auto_requeue", False) else None
    return {s for s in (getattr(signal, "SIGUSR1", None), named) if s is not None}


class StopOnSignal(L.Callback):
    """Defer SIGTERM / SIGINT (and the SLURM requeue signal) to the next optimizer-step
    boundary: save a resumable checkpoint there and stop; see the module docstring."""

    def __init__(self):
        self.received: list[int] = []  # in arrival order
        self.previous: dict[int, object] = {}  # the handlers replaced, restored after fit
        self.signals: list[int] = []
        self.step: int | None = None
        self.rank = 0

    # Lightning installs its own SIGTERM handler after on_fit_start (it would stop the run
    # at the end of the micro-batch, mid-step, and exit 0): ours replace it from here on.
    def on_train_start(self, trainer, pl_module) -> None:
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn("StopOnSignal: fit runs outside the main thread, where signal "
                           "handlers cannot be set: SIGTERM and SIGINT are left to Lightning")
            return
        self.received, self.step, self.rank = [], trainer.global_step, trainer.global_rank
        # one list for every rank: the flags are summed over the ranks position by position
        self.signals = [*STOP_SIGNALS, *sorted(requeue_signals(trainer) - set(STOP_SIGNALS))]
        for signum in STOP_SIGNALS:
            self.previous[signum] = signal.signal(signum, self._on_stop)
        for signum in requeue_signals(trainer):
            if callable(signal.getsignal(signum)):  # Lightning's: save, then scontrol requeue
                self.previous[signum] = signal.signal(signum, self._on_requeue)

    def _on_stop(self, signum, frame) -> None:
        if signum == signal.SIGINT and signal.SIGINT in self.received:
            self.restore()  # a second Ctrl-C: stop now, as Python would
            raise KeyboardInterrupt
        self.received.append(signum)
        # os.write: a print here could re-enter a print the main thread is inside
        os.write(2, (f"\n[rank {self.rank}] {STOP_SIGNALS[signum]} received: the run stops at "
                     "the end of this optimizer step, after saving a checkpoint"
                     + (" (Ctrl-C again: stop now, unsaved)" if signum == signal.SIGINT
                        else "") + "\n").encode())

    def _on_requeue(self, signum, frame) -> None:
        self.received.append(signum)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def on_train_end(self, trainer, pl_module) -> None:
        self.restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.restore()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.step is None or trainer.global_step == self.step:
            return  # inside a step's window: a checkpoint here would resume mid-step
        self.step = trainer.global_step
        signals = self.signals
        got = [s in self.received for s in signals]
        if trainer.world_size > 1:  # every rank stops at the same step: one collective
            mine = torch.tensor([float(g) for g in got], device=trainer.strategy.root_device)
            got = (trainer.strategy.reduce(mine, reduce_op="sum") > 0).tolist()
        for signum, flag in zip(signals, got):
            handler = self.previous.get(signum)
            if flag and signum not in STOP_SIGNALS and callable(handler):
                handler(signum, None)  # the requeue, at a step boundary, on every rank
        stop = next((s for s, flag in zip(signals, got) if flag and s in STOP_SIGNALS), None)
        if stop is not None:
            self._stop(trainer, stop)
        self.received = [s for s in self.received if s in STOP_SIGNALS]

    def _stop(self, trainer, signum: int) -> None:
        path, owner = checkpoint_target(trainer)
        if owner is not None:  # its state then says it wrote the file: a resumed run's
            owner.last_model_path = str(path)  # saves replace it (no last-v1.ckpt beside it)
        trainer.save_checkpoint(path)  # every rank takes part; written atomically
        name = STOP_SIGNALS[signum]
        raise RunInterrupted(
            f"stopped by {name} at the end of optimizer step {trainer.global_step}: the "
            f"resumable checkpoint is {path} (no student was exported). Resume with: "
            f"{resume_command(path)}", signum, path)


def checkpoint_target(trainer) -> tuple[Path, ModelCheckpoint | None]:
    """Where an interrupted run saves, and the callback whose file it is: the checkpoint
    callback's last.ckpt (what `ckpt_path=last` finds), else `interrupted.ckpt` in the
    trainer's root folder."""
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None:
            return Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}", cb
    return Path(trainer.default_root_dir) / "interrupted.ckpt", None


@contextlib.contextmanager
def interrupted_outside_steps(trainer):
    """Around `trainer.fit`: Lightning's own SIGTERM handling (before the first step, after
    the last, or without StopOnSignal) ends fit with SIGTERMException, a SystemExit of status
    0, at the end of a micro-batch; it becomes RunInterrupted, status 143, naming the last
    checkpoint the run wrote."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    try:
        yield
    except SIGTERMException as err:
        ckpt = last_good_checkpoint(trainer)
        back = (f"the last checkpoint is {ckpt}; resume with: {resume_command(ckpt)}" if ckpt
                else "no checkpoint was written: start it again")
        raise RunInterrupted(f"stopped by SIGTERM through Lightning's own handler (before "
                             "the first step, after the last, or with callbacks.signals=null): "
                             f"no checkpoint was saved for this stop; {back}",
                             signal.SIGTERM, ckpt) from err
