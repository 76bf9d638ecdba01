"""Fine-tuning optimizer and schedule: AdamW without decay on norms and biases, warmup.

Weight decay pulls every weight towards zero; on a norm's gain (initialized at 1) or a
bias that is a change of the model, not a regularizer, so fine-tuning recipes leave the
one-dimensional parameters undecayed. The module hands the optimizer factory a flat
list of the student's trainable tensors, so the groups are told apart by shape: 1-D
tensors (norm weights, biases) get no decay, matrices (projections, embeddings) do.
"""

from __future__ import annotations

import math

import torch
from transformers import get_cosine_schedule_with_warmup

from distill.core.rules import Rule, is_number, number


def decay_groups(params, weight_decay: float) -> list[dict]:
    """Two parameter groups: matrices with `weight_decay`, 1-D tensors without."""
    params = list(params)
    if params and isinstance(params[0], dict):
        raise ValueError("decay_groups takes tensors, not parameter groups")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


LR = number(0, strict=True)
WARMUP_RATIO = Rule(lambda v: is_number(v) and 0 <= v < 1 and math.isfinite(v),
                    "a number in [0, 1) (the share of the steps that warm up)")


def adamw(params, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999),
          eps: float = 1e-8, fused: bool | None = None) -> torch.optim.AdamW:
    """torch.optim.AdamW whose weight decay skips norms and biases (see decay_groups).

    `fused`: torch's fused AdamW kernel. None takes it when every parameter is a
    floating-point CUDA tensor (the 1.24B student's clipping + step: 15.0 ms fused against
    30.2 foreach on an H200, docs/benchmarks.md), else torch's default (foreach); a run whose
    clipping needs the unfused step gets False from distill.run.assemble.optimizer.
    """
    if not LR.check(lr):
        raise ValueError(f"optimizer.lr={lr!r}: must be {LR.allowed}")
    groups = decay_groups(params, weight_decay)
    if fused is None:
        fused = fused_by_default([p for g in groups for p in g["params"]])
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused)


def fused_by_default(params) -> bool | None:
    """True when every parameter is a floating-point CUDA tensor, else None (torch picks)."""
    on_gpu = bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)
    return True if on_gpu else None


adamw.SETTINGS = {"lr": LR}


def cosine_with_warmup(optimizer, num_training_steps: int, warmup_ratio: float = 0.03,
                       num_cycles: float = 0.5):
    """Linear warmup over `warmup_ratio` of the steps (at least one), then cosine to 0."""
    if not WARMUP_RATIO.check(warmup_ratio):
        raise ValueError(f"scheduler.warmup_ratio={warmup_ratio!r}: must be "
                         f"{WARMUP_RATIO.allowed}")
    if num_training_steps is None or not math.isfinite(num_training_steps):
        raise ValueError("a warmup ratio needs a finite number of steps: set "
                         "trainer.max_steps")
    warmup = max(1, round(warmup_ratio * num_training_steps)) if warmup_ratio else 0
    return get_cosine_schedule_with_warmup(optimizer, warmup, int(num_training_steps),
                                           num_cycles=num_cycles)


cosine_with_warmup.SETTINGS = {"warmup_ratio": WARMUP_RATIO}
