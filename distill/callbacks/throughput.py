"""Tokens per second: Lightning's ThroughputMonitor counting real (non-padding) tokens.

Its items are the tokens, so the loggers get `train/device/items_per_sec` (this rank's
tokens/s; `train/items_per_sec`, all ranks, when there are several), plus batches and
samples per second, over a window of micro-batches, wall time included (data loading,
optimizer, validation excluded). The same rate, times the ranks, is logged as `tokens/s` and
shown in the progress bar; none before `window_size` micro-batches have run (a short
benchmark sets callbacks.throughput.window_size=2: the rate of each step).
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage


def real_tokens(batch: dict) -> int:
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def rows(batch: dict) -> int:
    return batch["input_ids"].shape[0]


class TokenThroughput(ThroughputMonitor):
    def __init__(self, window_size: int = 10, **kwargs):
        # window_size: micro-batches the rate is measured over (no rate before that many)
        super().__init__(batch_size_fn=rows, length_fn=real_tokens, window_size=window_size,
                         separator="/", **kwargs)

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        if not hasattr(pl_module, "flops_per_batch"):
            # no FLOP count (no MFU) rather than Lightning's warning that one is missing
            pl_module.flops_per_batch = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not trainer.is_global_zero:  # the monitor measures on rank 0 only
            return
        rate = self._throughputs[RunningStage.TRAINING].compute().get("device/items_per_sec")
        if rate is not None:
            pl_module.log("tokens/s", rate * trainer.world_size, prog_bar=True, on_step=True,
                          on_epoch=False, rank_zero_only=True)
