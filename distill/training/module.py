"""DistillModule: the student, a teacher, the objective and the step-exact normalization.

Each training step weighs its positions by the normalization policy and the step's token
counts (summed over the step's window on every rank before its first micro-batch, see
distill.data.windows), then returns sum_i w_i loss_i * K * W: Lightning divides by K and
DDP averages over W, so the accumulated gradient is exactly grad(sum over the step of
w_i loss_i). An on-policy run first rewrites the window with samples, at its first
micro-batch, and counts the rewritten window.
"""

from __future__ import annotations

import dataclasses
import math

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info

from distill.core.rules import parse
from distill.data.masks import batch_masks, local_step_counts
from distill.data.windows import count_window, reduce_counts, window_of
from distill.models.levers import compiled_graphs
from distill.onpolicy.step import OnPolicyStep
from distill.training.normalization import token_weights, warn_if_biased
from distill.training.objective import LossConfig, Objective
from distill.training.state import StepSums, clip_by_norm, step_grad_norm


class DistillModule(L.LightningModule):
    def __init__(self, student, teacher, loss: LossConfig | dict, optimizer, scheduler=None,
                 vocab_size: int | None = None, eos_token_id: int | None = None,
                 onpolicy: OnPolicyStep | None = None, cross=None,
                 pad_to_multiple_of: int | None = None):
        super().__init__()
        self.cfg = loss if isinstance(loss, LossConfig) else parse(LossConfig, loss, "loss.")
        self.save_hyperparameters({"loss": dataclasses.asdict(self.cfg), "vocab_size": vocab_size})
        self.student, self.teacher, self.vocab_size = student, teacher, vocab_size
        # cross: a teacher with its own tokenizer (a distill.xtok CrossSetup)
        self.objective = Objective(self.cfg, teacher, vocab_size, cross)
        op = self.cfg.on_policy
        if onpolicy is None and op.samples:
            onpolicy = OnPolicyStep(op, student, getattr(teacher, "model", None),
                                    vocab_size=vocab_size, eos_token_id=eos_token_id,
                                    cross=cross, pad_to_multiple_of=pad_to_multiple_of)
        self.onpolicy = onpolicy
        self.rollout_graphs = 0  # graphs torch.compile built during rollouts
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.sums = StepSums()
        self._teacher_val_ce: float | None = None
        self._traced_fresh = False  # see _drop_earlier_traces

    @property
    def rewrites_windows(self) -> bool:
        """Whether the window is rewritten (and recounted) in the step: see StepTokenCounter."""
        return self.onpolicy is not None

    def on_fit_start(self):
        k, w = self.trainer.accumulate_grad_batches, self.trainer.world_size
        if self.onpolicy is not None and isinstance(self.trainer.strategy, FSDPStrategy):
            raise ValueError("on-policy sampling runs the student's generate, which needs its "
                             "whole weights on each rank; FSDP shards them: use strategy=ddp "
                             "(trainer=ddp) or loss.on_policy.fraction=0")
        warn_if_biased(self.cfg.normalization, k, w)
        rank_zero_info(f"normalization: {self.cfg.normalization} over {k} micro-batch(es) x "
                       f"{w} rank(s) per optimizer step")

    def _step_counts(self, info, masks):
        if info is not None and info.step_counts is not None:
            return info.step_counts
        k, w = self.trainer.accumulate_grad_batches, self.trainer.world_size
        if k * w > 1:
            raise RuntimeError(
                f"accumulate_grad_batches={k} on {w} rank(s) needs the StepTokenCounter "
                "callback (callbacks=default has it) and a windowed train loader "
                "(DistillDataModule's, or distill.data.StepWindows.from_loader(loader, K)): "
                "exact normalization needs the step's token counts before its first "
                "micro-batch")
        return local_step_counts(masks)

    def training_step(self, batch: dict, batch_idx: int):
        # gradients to come: the norm taken for the last ones (the last step's, or this
        # step's last closure run: LBFGS runs the closure several times) is stale
        self.sums.grad_norm = None
        info = window_of(batch)
        if info is None and self.onpolicy is not None:
            raise RuntimeError("on-policy distillation samples each step's window before it "
                               "trains it, and this train loader hands out no windows: use "
                               "distill.data.DistillDataModule, or wrap the loader in "
                               "distill.data.StepWindows.from_loader(loader, K)")
        if info is not None and info.first and self.onpolicy is not None:
            before = compiled_graphs()
            self.sums.rolled(self.onpolicy(self.student, info, self.global_rank))
            if before is not None:  # generate's own graphs (CompileWatch counts them apart)
                self.rollout_graphs += compiled_graphs() - before
            info.step_counts = reduce_counts(self.trainer, info, count_window(info.rolled))
        if info is not None and info.rolled is not None:
            batch = move_data_to_device(info.rolled[info.index], self.device)
        if not self._traced_fresh:
            self._drop_earlier_traces()
        masks = batch_masks(batch)
        step = self._step_counts(info, masks)
        weights = token_weights(self.cfg.normalization, masks, step).flatten()
        loss, parts, scored = self.objective.train(self.student, batch, weights)
        self.sums.add(loss, parts, scored, step)
        return loss * (step.accumulate * step.world_size)

    def _drop_earlier_traces(self) -> None:
        """Right before the first training forward, and the first after each validation.
        The models ran at other shapes before it: the validation on its batches (the teacher
        under the same guards as in training), the first rollout's generate on its prompts
        and decode steps, HeadCheck on one row of 16 tokens (eagerly on torch >= 2.6). Code
        torch.compile traced there (transformers' flex_attention, layers compiled by
        speed.compile) would make the training graphs dynamic in batch and length: slower
        kernels for the rest of the run (flex_attention's 1.5-1.8x on the H200). It is traced
        afresh at this batch's shapes instead; inductor's on-disk caches keep that retrace
        short."""
        self._traced_fresh = True
        if not torch.compiler.is_compiling():  # a compiled training_step traces this call
            torch.compiler.reset()

    def on_validation_end(self):
        if not self.trainer.sanity_checking:  # the first training forward resets anyway
            self._traced_fresh = False

    def on_before_optimizer_step(self, optimizer):
        self.sums.log_step(self)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # Lightning zeroes the gradients after the next step's forward: until then they
        # would sit beside its activations (a student-sized fp32 tensor at the peak)
        optimizer.zero_grad(set_to_none=True)

    def validation_step(self, batch: dict, batch_idx: int):
        valid = batch_masks(batch).valid.flatten().float()
        self.sums.add_val(self.objective.validation(self.student, batch, valid,
                                                    self._teacher_val_ce is None))

    def on_validation_epoch_end(self):
        totals = self.sums.take_val(self.trainer.strategy)
        if not totals or totals[3] == 0:
            return
        div, ce, t_ce, n = totals
        self.log("val/loss", (div + self.cfg.ce_weight * ce) / n, prog_bar=True)
        self.log("val/kl", div / n)
        self.log("val/ppl", math.exp(min(ce / n, 50.0)))
        if self._teacher_val_ce is None and t_ce > 0:
            self._teacher_val_ce = t_ce / n
        if self._teacher_val_ce is not None:
            self.log("val/teacher_ppl", math.exp(min(self._teacher_val_ce, 50.0)))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        # FSDP shards the gradients: only the wrapped module can take their global norm
        if (isinstance(self.trainer.strategy, FSDPStrategy) and gradient_clip_val
                and gradient_clip_algorithm in (None, "norm")):
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
            return
        # by the step's norm (the guard's and the logs', else taken here; after unscaling,
        # before clipping), as torch's clip_grad_norm_ would and without a second pass over
        # the gradients (a callback that edits gradients in place after StepLogs would need
        # Lightning's path). The norm is taken in fp32: for fp32 gradients the same as
        # torch's, for 16-bit ones (bf16-true) more exact. A fused optimizer clips here too:
        # Lightning's AMP plugin refuses it for fear of a GradScaler, and bf16-mixed has
        # none. Not under a GradScaler: an optimizer that unscales in its own step has
        # scaled gradients here
        plugin = getattr(self.trainer, "precision_plugin", None)
        scaled = getattr(plugin, "scaler", None) is not None
        if gradient_clip_val and not scaled and gradient_clip_algorithm in (None, "norm"):
            norm = step_grad_norm(self.trainer, self, optimizer)
            params = [p for g in optimizer.param_groups for p in g["params"]
                      if p.grad is not None]
            if params and norm is not None:
                clip_by_norm(params, gradient_clip_val, norm)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        params = [p for p in self.student.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params=params)
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(
            optimizer=optimizer, num_training_steps=self.trainer.estimated_stepping_batches)
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
