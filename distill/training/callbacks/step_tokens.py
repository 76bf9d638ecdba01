"""StepTokenCounter: the token counts of each optimizer step, known before the step starts.

Exact normalization needs, at a step's first micro-batch, the valid tokens (and real tokens,
sequences) of all its K micro-batches on all W ranks. The train loader hands them out:
every micro-batch of a `distill.data.StepWindows` loader carries its window, counted in
the loader's workers (`batch["window"]`). At the window's first micro-batch this callback
sums the counts over the ranks and hands them to the window, where the module reads them.
A module that rewrites its windows (on-policy sampling: `rewrites_windows`) samples in its
training step and sums the rewritten window's counts itself, with the same function.

The callback also tells the loader which micro-batch is training, which is what a
checkpoint records of the data (Lightning saves the loader's `state_dict`), and checks that
Lightning's accumulation boundaries fall where the windows do. Only public Lightning API
is used: hooks, `trainer.accumulate_grad_batches`, `trainer.strategy.reduce`.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

from distill.data.windows import reduce_counts, window_of

# Strategies under which "return loss * K * W" is not the exact compensation.
REFUSED_STRATEGIES = {
    DeepSpeedStrategy: "it runs gradient accumulation and its scaling itself",
    ModelParallelStrategy: "its ranks are not all data-parallel replicas",
}


def check_strategy(strategy) -> None:
    for cls, why in REFUSED_STRATEGIES.items():
        if isinstance(strategy, cls):
            raise ValueError(
                f"{type(strategy).__name__} cannot keep the token normalization exact: {why}. "
                "Use strategy=ddp or fsdp (trainer=ddp), which distill supports and tests."
            )


class StepTokenCounter(L.Callback):
    """Sums each step window's token counts over the ranks before its first micro-batch."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            check_strategy(trainer.strategy)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        info = window_of(batch)
        k = trainer.accumulate_grad_batches
        if info is None:
            if k * trainer.world_size > 1:
                raise RuntimeError(
                    f"StepTokenCounter: the train loader's micro-batches carry no step window, "
                    f"so the token counts of a step of {k} micro-batch(es) x "
                    f"{trainer.world_size} rank(s) are unknown before it starts: use "
                    "distill.data.DistillDataModule, or wrap the loader in "
                    "distill.data.StepWindows.from_loader(loader, accumulate_grad_batches)")
            return
        if info.owner.accumulate != k or batch_idx % k != info.index % k:
            raise RuntimeError(
                f"StepTokenCounter: Lightning's micro-batch {batch_idx} of the epoch (K={k}) is "
                f"micro-batch {info.index} of a {info.size}-batch window of the loader "
                f"(K={info.owner.accumulate}): the optimizer steps would not fall at the ends "
                "of the counted windows. Build the loader with the trainer's "
                "accumulate_grad_batches")
        info.owner.mark(info)
        if info.first and not getattr(pl_module, "rewrites_windows", False):
            info.step_counts = reduce_counts(trainer, info)
