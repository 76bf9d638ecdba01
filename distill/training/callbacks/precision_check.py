"""Warn, before training, when the student's trainable weights would lose small updates.

Under a '*-mixed' precision Lightning keeps the weights in the dtype they were loaded in
and autocasts only the compute: a student loaded in bf16 then has bf16 weights and AdamW
state, and an update smaller than ~1/256 of a weight rounds away (at lr 1e-5, most of
them). That is a choice to make explicitly (trainer=gpu_bf16_true), never by accident.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

HALF = (torch.bfloat16, torch.float16)


def half_trainable(model: torch.nn.Module) -> dict[torch.dtype, int]:
    """Number of trainable parameters per 16-bit dtype."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.requires_grad and p.dtype in HALF:
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return counts


class PrecisionCheck(L.Callback):
    def on_fit_start(self, trainer, pl_module):
        half = half_trainable(pl_module.student)
        if not half:
            return
        precision = str(trainer.precision)
        what = ", ".join(f"{n:,} {str(d)[6:]}" for d, n in half.items())
        if precision.endswith("-true"):
            rank_zero_info(f"precision {precision}: the student trains in 16-bit weights "
                           f"({what} parameters); updates below ~1/256 of a weight are lost")
            return
        rank_zero_warn(
            f"the student's trainable weights are 16-bit ({what} parameters) under precision "
            f"{precision}: AdamW's state is 16-bit too and updates smaller than ~1/256 of a "
            "weight are lost. Load the student in float32 (student.dtype=float32, the "
            "default of student=hf) to keep fp32 master weights, or choose pure bf16 "
            "explicitly with trainer=gpu_bf16_true")
