"""Faults injected into a real run, as callbacks a config adds (`+callbacks.x._target_=...`):
a poisoned gradient, a signal sent to the run itself, a marker file once training runs."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import torch


class PoisonGrads(L.Callback):
    """A NaN in one gradient during the optimizer steps [at, at + steps) (0-based), on every
    rank or on `rank` only (after DDP's all-reduce: the other ranks' gradients are finite)."""

    def __init__(self, at: int, steps: int = 1, rank: int | None = None):
        self.at, self.steps, self.rank = at, steps, rank

    def on_after_backward(self, trainer, pl_module):
        if self.rank is not None and trainer.global_rank != self.rank:
            return
        if self.at <= trainer.global_step < self.at + self.steps:
            p = next(p for p in pl_module.student.parameters() if p.grad is not None)
            p.grad.view(-1)[0] = float("nan")


class SendSignal(L.Callback):
    """Send `signum` to this process after micro-batch `batch` (0-based, of the run), on
    `rank` only: the other ranks must learn of it from the guard's all-reduce."""

    def __init__(self, batch: int, signum: int = int(signal.SIGTERM), rank: int = 0):
        self.batch, self.signum, self.rank, self.seen = batch, signum, rank, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.seen == self.batch and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)
        self.seen += 1


class Marker(L.Callback):
    """Write `path` (the global step) after every micro-batch: the run is training."""

    def __init__(self, path: str):
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            self.path.write_text(str(trainer.global_step))


def windows_state(ckpt: dict) -> dict:
    """The train loader's StepWindows state inside a Lightning checkpoint."""
    def find(node):
        if isinstance(node, dict) and {"position", "accumulate", "epoch"} <= set(node):
            return node
        for v in node.values() if isinstance(node, dict) else (
                node if isinstance(node, list) else []):
            if (hit := find(v)) is not None:
                return hit
        return None
    return find(ckpt["loops"])


def all_finite(state: dict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values()
               if torch.is_tensor(v) and v.is_floating_point())


def train_with_a_save_that_hangs(hang_at: int = 2) -> None:
    """`python -m distill.train` whose `hang_at`-th checkpoint save (1-based) writes half
    its bytes to the temporary file, says so on stdout, and hangs there (to be SIGKILLed)."""
    import io
    import sys
    import time

    import distill.core.checkpoint_io as cio
    import distill.run.train

    real, calls = cio.torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) < hang_at:
            return real(obj, f, *args, **kwargs)
        data = io.BytesIO()
        real(obj, data)
        with open(f, "wb") as out:
            out.write(data.getvalue()[: len(data.getvalue()) // 2])
            out.flush()
            os.fsync(out.fileno())
        print(f"HALF-WRITTEN {f}", flush=True)
        time.sleep(600)

    cio.torch.save = save
    sys.argv = ["distill.train", *sys.argv[1:]]
    distill.run.train.main()
