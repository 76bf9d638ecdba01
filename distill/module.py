"""DistillModule: the student, a teacher, the fused loss and the step-exact normalization.

Each training step computes per-token weights from the normalization policy and the step's
token counts (set by the StepTokenCounter callback before the step's first micro-batch),
then returns sum_i w_i loss_i * K * W: Lightning divides by K and DDP averages over W, so
the accumulated gradient is exactly grad(sum over the step of w_i * loss_i).
"""

from __future__ import annotations

import math

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from distill.callbacks.step_tokens import StepTokenCounter
from distill.losses import FusedLinearDivergence
from distill.models import final_hidden_states, lm_head
from distill.normalization import (
    StepCounts,
    batch_masks,
    check_policy,
    local_step_counts,
    token_weights,
    warn_if_biased,
)
from distill.teachers import shift_flat, shift_labels

LOSS_KEYS = ("kind", "beta", "temperature", "ce_weight", "temperature_squared",
             "sparse_mode", "divergence_weight", "chunk_size", "fp32_weight_grad", "backend")


class DistillModule(L.LightningModule):
    def __init__(self, student, teacher, loss: dict, optimizer, scheduler=None,
                 vocab_size: int | None = None, ignore_index: int = -100):
        super().__init__()
        self.save_hyperparameters(ignore=["student", "teacher", "optimizer", "scheduler"])
        self.student = student
        self.teacher = teacher
        loss = dict(loss)
        self.policy = check_policy(loss.get("normalization", "valid_tokens"))
        self.loss_fn = FusedLinearDivergence(
            ignore_index=ignore_index, **{k: loss[k] for k in LOSS_KEYS if k in loss}
        )
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.vocab_size = vocab_size
        self.step_counts: StepCounts | None = None  # set by StepTokenCounter
        # sums kept on the device (no host sync per micro-batch): loss, divergence, ce over
        # the step; divergence, ce, teacher ce, tokens over the validation set
        self._window: torch.Tensor | None = None
        self._val: torch.Tensor | None = None
        self._teacher_val_ce: float | None = None

    # --- the loss -----------------------------------------------------------------
    def _divergence(self, batch: dict, weights: torch.Tensor):
        hidden = final_hidden_states(self.student, batch["input_ids"],
                                     batch.get("attention_mask"), batch.get("position_ids"))
        weight, head = lm_head(self.student)
        # position t predicts token t + 1 (the positions batch_masks weighs)
        return self.loss_fn(shift_flat(hidden), weight, labels=shift_labels(batch["labels"]),
                            weights=weights, student_head=head, vocab_size=self.vocab_size,
                            return_components=True, **self.teacher.targets(batch))

    def _step_counts(self, masks) -> StepCounts:
        if self.step_counts is not None:
            return self.step_counts
        self._check_counter()
        return local_step_counts(masks)

    def _check_counter(self) -> None:
        k, w = self.trainer.accumulate_grad_batches, self.trainer.world_size
        counted = any(isinstance(cb, StepTokenCounter) for cb in self.trainer.callbacks)
        if (k > 1 or w > 1) and not counted:
            raise RuntimeError(f"accumulate_grad_batches={k} on {w} rank(s) needs the "
                               "StepTokenCounter callback for exact normalization: add "
                               "distill.callbacks.StepTokenCounter to the trainer's callbacks "
                               "(callbacks=default has it)")

    def on_fit_start(self):
        self._check_counter()
        k, w = self.trainer.accumulate_grad_batches, self.trainer.world_size
        warn_if_biased(self.policy, k, w)
        rank_zero_info(f"normalization: {self.policy} over {k} micro-batch(es) x {w} rank(s) "
                       "per optimizer step")

    def training_step(self, batch: dict, batch_idx: int):
        masks = batch_masks(batch, self.loss_fn.spec.ignore_index)
        step = self._step_counts(masks)
        weights = token_weights(self.policy, masks, step).flatten()
        loss, parts = self._divergence(batch, weights)
        window = torch.stack([loss.detach(), parts["divergence"], parts["ce"]])
        self._window = window if self._window is None else self._window + window
        return loss * (step.accumulate * step.world_size)

    def on_before_optimizer_step(self, optimizer):
        # the true step loss: sum over this rank's micro-batches, summed over the ranks
        if self._window is None:
            return
        loss, div, ce = self._window.tolist()
        opts = dict(on_step=True, on_epoch=False, sync_dist=True, reduce_fx="sum")
        self.log("train/loss", loss, prog_bar=True, **opts)
        self.log("train/kl", div, **opts)
        self.log("train/ce", ce, **opts)
        self._window = None
        if self.step_counts is not None:
            s = self.step_counts
            self.log("train/step_valid_tokens", float(s.valid), on_step=True, on_epoch=False)
            self.log("train/step_real_tokens", float(s.real), on_step=True, on_epoch=False)
            self.log("train/valid_fraction", s.valid / max(s.real, 1), on_step=True,
                     on_epoch=False)

    # --- validation -----------------------------------------------------------------
    def validation_step(self, batch: dict, batch_idx: int):
        masks = batch_masks(batch, self.loss_fn.spec.ignore_index)
        valid = masks.valid.flatten().float()
        _, parts = self._divergence(batch, valid)  # sums over the batch's valid tokens
        teacher_ce = torch.zeros((), device=valid.device)
        if self._teacher_val_ce is None and hasattr(self.teacher, "cross_entropy_sum"):
            teacher_ce = self.teacher.cross_entropy_sum(batch, valid, self.vocab_size)
        sums = torch.stack([parts["divergence"], parts["ce"], teacher_ce, valid.sum()])
        self._val = sums if self._val is None else self._val + sums

    def on_validation_epoch_end(self):
        if self._val is None:
            return
        totals = self.trainer.strategy.reduce(self._val, reduce_op="sum")
        div, ce, t_ce, n = totals.tolist()
        self._val = None
        if n == 0:
            return
        self.log("val/loss", (div + self.loss_fn.spec.ce_weight * ce) / n, prog_bar=True)
        self.log("val/kl", div / n)
        self.log("val/ppl", math.exp(min(ce / n, 50.0)))
        if self._teacher_val_ce is None and t_ce > 0:
            self._teacher_val_ce = t_ce / n
        if self._teacher_val_ce is not None:
            self.log("val/teacher_ppl", math.exp(min(self._teacher_val_ce, 50.0)))

    # --- optimizer, checkpoints -------------------------------------------------------
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        # FSDP shards the gradients: only the wrapped module can take their global norm
        from lightning.pytorch.strategies import FSDPStrategy

        if (isinstance(self.trainer.strategy, FSDPStrategy) and gradient_clip_val
                and gradient_clip_algorithm in (None, "norm")):
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        params = [p for p in self.student.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params=params)
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(
            optimizer=optimizer, num_training_steps=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict):
        # the teacher is frozen and reloaded from its own path: keep it out of checkpoints
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith("teacher.")]:
            del state[key]

    def on_load_checkpoint(self, checkpoint: dict):
        for key, value in self.state_dict().items():
            if key.startswith("teacher."):
                checkpoint["state_dict"][key] = value
