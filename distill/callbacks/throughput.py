"""Tokens per second in the progress bar and the logs (real, non-padding tokens)."""

from __future__ import annotations

import time

import lightning as L


class TokensPerSecond(L.Callback):
    def __init__(self, smoothing: float = 0.9):
        self.smoothing = smoothing
        self._rate: float | None = None
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        mask = batch.get("attention_mask")
        tokens = int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        rate = tokens * trainer.world_size / max(time.perf_counter() - self._start, 1e-9)
        s = self.smoothing
        self._rate = rate if self._rate is None else s * self._rate + (1 - s) * rate
        pl_module.log("tokens/s", self._rate, prog_bar=True, on_step=True, on_epoch=False)
