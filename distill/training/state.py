"""What a training step logs: the true step loss (not the scaled one Lightning receives),
its divergence and CE parts, the step's token counts, and the rollout's numbers.

Sums are kept on the device across a window's micro-batches (no host sync per
micro-batch) and logged once per optimizer step, summed over the ranks.
"""

from __future__ import annotations

import time

import torch
from lightning.pytorch.strategies import FSDPStrategy

from distill.onpolicy.rollout import RolloutStats


class StepSums:
    def __init__(self):
        self.window: torch.Tensor | None = None  # loss, divergence, ce over the step
        self.scored: torch.Tensor | None = None  # teacher log-prob sum, count of samples
        self.rollout: RolloutStats | None = None
        self.rollout_end: float | None = None
        self.samples: list = []  # the last rollout's (prompt, completion, by_teacher)
        self.val: torch.Tensor | None = None
        self.counts = None  # the last step's StepCounts
        self.trained_tokens = 0  # valid positions of every step so far, all ranks
        # (this step's norm,): computed once, for the callbacks and the clipping; cleared
        # by each DistillModule.training_step, whose backward brings new gradients
        self.grad_norm: tuple | None = None

    def add(self, loss, parts: dict, scored, counts) -> None:
        w = torch.stack([loss.detach(), parts["divergence"], parts["ce"]])
        self.window = w if self.window is None else self.window + w
        if scored is not None:
            self.scored = scored if self.scored is None else self.scored + scored
        self.counts = counts

    def rolled(self, stats: RolloutStats) -> None:
        self.rollout, self.rollout_end, self.samples = stats, time.perf_counter(), stats.examples

    def log_step(self, module) -> float | None:
        """Log the step's sums; returns its loss (None before any micro-batch)."""
        if self.window is None:
            return None
        loss, div, ce = self.window.tolist()
        self.window = None
        opts = dict(on_step=True, on_epoch=False, sync_dist=True, reduce_fx="sum")
        module.log("train/loss", loss, prog_bar=True, **opts)
        module.log("train/kl", div, **opts)
        module.log("train/ce", ce, **opts)
        if self.counts is not None:
            s, local = self.counts, dict(on_step=True, on_epoch=False)
            self.trained_tokens += int(s.valid)
            module.log("train/step_valid_tokens", float(s.valid), **local)
            module.log("train/step_real_tokens", float(s.real), **local)
            module.log("train/valid_fraction", s.valid / max(s.real, 1), **local)
        self._log_rollout(module)
        return loss

    def _log_rollout(self, module) -> None:
        stats, self.rollout = self.rollout, None
        if stats is None:
            return
        opts = dict(on_step=True, on_epoch=False, sync_dist=True)
        if stats.rows:
            module.log("rollout/mean_length", stats.tokens / stats.rows, **opts)
            module.log("rollout/cut_fraction", stats.cut / stats.rows, **opts)
        if self.scored is not None:
            logp, n = self.scored.tolist()
            if n:
                module.log("rollout/teacher_logprob", logp / n, **opts)
        self.scored = None
        module.log("time/rollout_s", stats.seconds, **opts)
        if self.rollout_end is not None:
            module.log("time/train_s", time.perf_counter() - self.rollout_end, **opts)

    def add_val(self, sums: torch.Tensor) -> None:
        self.val = sums if self.val is None else self.val + sums

    def take_val(self, strategy) -> list[float] | None:
        if self.val is None:
            return None
        totals = strategy.reduce(self.val, reduce_op="sum").tolist()
        self.val = None
        return totals


def step_grad_norm(trainer, pl_module, optimizer) -> torch.Tensor | None:
    """`grad_norm` of this optimizer step, computed once for every callback that asks (the
    guard, then the step logs, then the clipping): kept in the module's StepSums, which
    each DistillModule.training_step clears."""
    sums = getattr(pl_module, "sums", None)
    if sums is None:
        return grad_norm(optimizer, trainer.strategy)
    if sums.grad_norm is None:
        sums.grad_norm = (grad_norm(optimizer, trainer.strategy),)
    return sums.grad_norm[0]


def grad_norm(optimizer, strategy) -> torch.Tensor | None:
    """The L2 norm of the gradient of every parameter the optimizer updates, in fp32 (fp64
    when a gradient is fp64: trainer.precision=64-true)."""
    grads = [p.grad.detach() for g in optimizer.param_groups for p in g["params"]
             if p.grad is not None]
    if not grads:
        return None
    wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if total_norm is not None and all(g.dtype == wide for g in grads):
        squares = total_norm(grads, 2.0).square()  # a few foreach launches
    else:  # each gradient widened on its own (16-bit ones: fp16 overflows above 65504)
        squares = torch.stack([torch.linalg.vector_norm(g, dtype=wide)
                               for g in grads]).square().sum()
    if isinstance(strategy, FSDPStrategy):  # each rank holds a shard of every gradient
        squares = strategy.reduce(squares, reduce_op="sum")
    return squares.sqrt()  # DDP: the gradients are already the same on every rank


def clip_by_norm(params: list, max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients of `params` as torch's clip_grad_norm_ does once it has `norm`
    (by max_norm / (norm + 1e-6), never up)."""
    by_norm = getattr(torch.nn.utils, "clip_grads_with_norm_", None)  # torch >= 2.6
    if by_norm is not None:
        by_norm(params, max_norm, norm)
        return
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.device))
