"""CompileWatch: the graphs torch.compile builds during training, and a warning when it
builds them after the warm-up.

`speed.compile` and transformers' flex_attention (packed rows on CUDA) compile on first use.
A graph built later means an input shape or mode the run had not seen: a batch width, a
rollout length, a smaller last batch. Each costs compile time, and a shape that keeps
changing ends in graphs dynamic in it (slower kernels for the rest of the run). The first
optimizer step and the first after each validation are the warm-up (DistillModule traces
afresh there); a graph built in any other step is logged as a warning naming the step, and
the run's summary counts them all.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn

WARNINGS = 3  # then only the summary's count


def compiled_graphs() -> int | None:
    """Graphs dynamo has built in this process so far (None where torch does not count)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return int(counters["stats"]["unique_graphs"])


class CompileWatch(L.Callback):
    def __init__(self):
        self.total = 0  # graphs built during training
        self.late: dict[int, int] = {}  # optimizer step -> graphs built after the warm-up
        self._mark: int | None = None
        self._seen_step = 0
        self._warm_up = True  # the step under way expects traces

    def on_train_start(self, trainer, pl_module) -> None:
        self._mark, self._seen_step, self._warm_up = compiled_graphs(), trainer.global_step, True

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._warm_up = True  # the next training forward is traced afresh

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._mark is None or trainer.global_step == self._seen_step:
            return  # no counter, or still inside the step's micro-batches
        self._seen_step = trainer.global_step
        now = compiled_graphs()
        built, self._mark = now - self._mark, now
        self.total += built
        if built and not self._warm_up:
            self.late[trainer.global_step] = built
            if len(self.late) <= WARNINGS:
                rank_zero_warn(
                    f"torch.compile built {built} graph(s) in optimizer step "
                    f"{trainer.global_step}, after the warm-up: an input shape or mode the "
                    "run had not met (a batch width: data.pad_to_multiple_of fixes widths; a "
                    "rollout's length; a smaller last batch). Each costs compile time; the "
                    "run's summary counts them" + (" (no more warnings)" if len(self.late)
                                                   == WARNINGS else ""))
        self._warm_up = False

    def report(self) -> dict | None:
        """{"graphs", "late", "late_steps"} for the run's summary; None when nothing compiled."""
        if not self.total:
            return None
        return {"graphs": self.total, "late": sum(self.late.values()),
                "late_steps": sorted(self.late)}
