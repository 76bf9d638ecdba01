"""Tokens per second of training, measured on the trained (real, non-padding) tokens.

Lightning's `Throughput` (lightning.fabric.utilities.throughput) over a window of
micro-batches, wall time included (data loading, the optimizer step; validation excluded):
`train/device/items_per_sec` is this rank's tokens/s, `train/items_per_sec` all ranks',
beside batches and samples per second. `tokens/s` (all ranks) also goes to the progress bar.
An on-policy step counts the rows it trained on (the rewritten window's), not the loader's.
"""

from __future__ import annotations

import time

import lightning as L
from lightning.fabric.utilities.throughput import Throughput

from distill.core.rules import integer
from distill.data.windows import window_of


def real_tokens(batch: dict) -> int:
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def trained_batch(batch: dict) -> dict:
    """The micro-batch as trained: a rewritten window's row, else the loader's."""
    info = window_of(batch)
    return info.rolled[info.index] if info is not None and info.rolled else batch


class TokenThroughput(L.Callback):
    SETTINGS = {"window_size": integer(2, what=" (micro-batches)")}

    def __init__(self, window_size: int = 10):
        self.window_size = window_size
        self.throughput: Throughput | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.throughput = Throughput(window_size=self.window_size,
                                     world_size=trainer.world_size)
        self._t0, self._batches, self._samples, self._tokens = time.perf_counter(), 0, 0, 0
        self._paused = 0.0

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.training:
            self._val_t0 = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.training:
            self._paused += time.perf_counter() - self._val_t0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        trained = trained_batch(batch)
        self._batches += 1
        self._samples += trained["input_ids"].shape[0]
        self._tokens += real_tokens(trained)
        self.throughput.update(time=time.perf_counter() - self._t0 - self._paused,
                               batches=self._batches, samples=self._samples,
                               lengths=self._tokens)
        metrics = self.throughput.compute()  # the counts, then the rates once a window ran
        logged = {f"train/{k}": float(v) for k, v in metrics.items()}
        pl_module.log_dict(logged, on_step=True, on_epoch=False, rank_zero_only=True)
        rate = metrics.get("device/items_per_sec")
        if rate is not None:
            pl_module.log("tokens/s", rate * trainer.world_size, prog_bar=True, on_step=True,
                          on_epoch=False, rank_zero_only=True)
