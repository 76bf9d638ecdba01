"""CompileWatch: the graphs torch.compile builds during a fit, and a warning when a training
step builds them after the warm-up.

`speed.compile` and transformers' flex_attention (packed rows on CUDA) compile on first use.
A graph a training step builds later means an input shape or mode the run had not seen: a
batch width, a smaller last batch. Each costs compile time, and a shape that keeps changing
ends in graphs dynamic in it (slower kernels for the rest of the run). The first optimizer
step and the first after each validation are the warm-up (DistillModule traces afresh
there). Graphs built in validation and in on-policy rollouts (their generate meets new
prompt and decode shapes by design) are counted apart and never warned about. The run's
summary prints the counts.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn

from distill.models.levers import compiled_graphs

WARNINGS = 3  # then only the summary's count


class CompileWatch(L.Callback):
    def __init__(self):
        self.steps = 0  # graphs built by training steps (their rollouts left out)
        self.rollouts = 0
        self.validation = 0
        self.late: dict[int, int] = {}  # optimizer step -> graphs built after the warm-up
        self._mark: int | None = None
        self._rolled = 0  # the module's rollout count at the mark
        self._val_mark: int | None = None
        self._seen_step = 0
        self._warm_up = True  # the step under way expects traces

    def on_train_start(self, trainer, pl_module) -> None:
        self._mark, self._seen_step, self._warm_up = compiled_graphs(), trainer.global_step, True
        self._rolled = getattr(pl_module, "rollout_graphs", 0)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_mark = compiled_graphs() if self._mark is not None else None

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._val_mark is None:
            return  # the sanity check (before training starts) or no counter
        built = compiled_graphs() - self._val_mark
        self.validation += built
        self._mark += built  # not the training step's
        self._val_mark, self._warm_up = None, True  # the next forward is traced afresh

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._mark is None or trainer.global_step == self._seen_step:
            return  # no counter, or still inside the step's micro-batches
        self._seen_step = trainer.global_step
        now, rolled = compiled_graphs(), getattr(pl_module, "rollout_graphs", 0)
        in_rollouts = rolled - self._rolled
        built = now - self._mark - in_rollouts
        self._mark, self._rolled = now, rolled
        self.steps += built
        self.rollouts += in_rollouts
        if built and not self._warm_up:
            self.late[trainer.global_step] = built
            if len(self.late) <= WARNINGS:
                rank_zero_warn(
                    f"torch.compile built {built} graph(s) in optimizer step "
                    f"{trainer.global_step}, after the warm-up: its batches had a shape or "
                    "mode the run had not met (a batch width: data.pad_to_multiple_of fixes "
                    "widths; a smaller last batch). Each costs compile time; the run's "
                    "summary counts them" + (" (no more warnings)" if len(self.late)
                                             == WARNINGS else ""))
        self._warm_up = False

    def report(self) -> dict | None:
        """The counts for the run's summary; None when nothing was compiled."""
        if not (self.steps or self.rollouts or self.validation):
            return None
        return {"graphs": self.steps, "rollouts": self.rollouts, "validation": self.validation,
                "late": sum(self.late.values()), "late_steps": sorted(self.late)}
