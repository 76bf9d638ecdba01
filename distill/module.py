"""DistillModule: the student, a teacher, the fused loss and the step-exact normalization.

Each training step computes per-token weights from the normalization policy and the step's
token counts (set by the StepTokenCounter callback before the step's first micro-batch),
then returns sum_i w_i loss_i * K * W: Lightning divides by K and DDP averages over W, so
the accumulated gradient is exactly grad(sum over the step of w_i * loss_i).

With on-policy distillation (`loss.on_policy.fraction` > 0) the counter first hands the
step's window to `rollout_window`, where the student rewrites its rows with its own
samples (distill.rollout); the counts are then taken on the rewritten window.
"""

from __future__ import annotations

import math
import time

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
from distill.rollout import (
    NEEDS_LIVE_TEACHER,
    HFSampler,
    OnPolicy,
    RolloutStats,
    rollout,
    window_seed,
)
from distill.teachers import shift_flat, shift_labels

LOSS_KEYS = ("kind", "beta", "temperature", "ce_weight", "temperature_squared",
             "sparse_mode", "divergence_weight", "chunk_size", "fp32_weight_grad", "backend")


class DistillModule(L.LightningModule):
    def __init__(self, student, teacher, loss: dict, optimizer, scheduler=None,
                 vocab_size: int | None = None, ignore_index: int = -100,
                 eos_token_id: int | None = None):
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
        self._setup_on_policy(loss, teacher, ignore_index, eos_token_id)
        self.step_counts: StepCounts | None = None  # set by StepTokenCounter
        # sums kept on the device (no host sync per micro-batch): loss, divergence, ce over
        # the step; divergence, ce, teacher ce, tokens over the validation set
        self._window: torch.Tensor | None = None
        self._val: torch.Tensor | None = None
        self._teacher_val_ce: float | None = None

    # --- on-policy rollouts -----------------------------------------------------------
    def _setup_on_policy(self, loss: dict, teacher, ignore_index: int, eos_token_id) -> None:
        self.on_policy = OnPolicy.from_config(loss.get("on_policy"))
        # CE-only (divergence_weight=0): the dataset's labels alone, no sample, no teacher
        self.ce_only = float(loss.get("divergence_weight", 1.0)) == 0.0
        self.rolls_out = self.on_policy.fraction > 0 and not self.ce_only
        self._rollout_stats: RolloutStats | None = None
        self._rollout_end: float | None = None
        self._sampled_sums: torch.Tensor | None = None
        if not self.rolls_out:
            return
        if getattr(teacher, "model", None) is None:
            raise ValueError(NEEDS_LIVE_TEACHER.format(self.on_policy.fraction))
        # the sampled rows are trained on the divergence alone: a cross-entropy on the
        # student's own samples would only reinforce them
        self.sample_loss_fn = FusedLinearDivergence(
            ignore_index=ignore_index,
            **{**{k: loss[k] for k in LOSS_KEYS if k in loss}, "ce_weight": 0.0})
        cfg = self.student.config
        # a sample stops at any of the model's stop tokens (chat models list their
        # end-of-turn token in generation_config) or the tokenizer's eos
        eos = []
        for found in (getattr(self.student.generation_config, "eos_token_id", None),
                      cfg.eos_token_id, eos_token_id):
            for t in [found] if isinstance(found, int) else list(found or []):
                eos += [t] if t not in eos else []
        if not eos:
            raise ValueError("on-policy sampling needs a stop token: neither the student's "
                             "config nor its generation_config nor the tokenizer has an "
                             "eos_token_id; set one in the student's config.json")
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else eos[0]
        self.sampler = HFSampler(self.on_policy.temperature, self.on_policy.top_p,
                                 self.on_policy.max_new_tokens, eos, pad, self.vocab_size)

    def rollout_window(self, batches: list[dict], epoch: int, step: int) -> list[dict]:
        """Called by the StepTokenCounter on each step window before counting it: the
        student rewrites the chosen rows (every rank its own, seeded by epoch, step, rank)."""
        if not self.rolls_out:
            return batches
        seed = window_seed(self.on_policy.seed, epoch, step, self.global_rank)
        with self.trainer.precision_plugin.forward_context():  # the training autocast
            out, stats = rollout(batches, self.sampler, self.student, self.on_policy, seed,
                                 self.sampler.pad_token_id, self.sampler.eos_token_ids,
                                 self.loss_fn.spec.ignore_index, teacher=self.teacher.model)
        self._rollout_stats, self._rollout_end = stats, time.perf_counter()
        return out

    # --- the loss -----------------------------------------------------------------
    def _divergence(self, batch: dict, weights: torch.Tensor, train: bool = False):
        hidden = final_hidden_states(self.student, batch["input_ids"],
                                     batch.get("attention_mask"), batch.get("position_ids"))
        weight, head = lm_head(self.student)
        # position t predicts token t + 1 (the positions batch_masks weighs)
        hidden, labels = shift_flat(hidden), shift_labels(batch["labels"])
        if train and self.ce_only:  # no teacher signal: the student against itself, weight 0
            targets = {"teacher_hidden": hidden.detach(), "teacher_weight": weight.detach(),
                       "teacher_head": head}
        else:
            targets = self.teacher.targets(batch)
        common = dict(labels=labels, student_head=head, vocab_size=self.vocab_size,
                      return_components=True, **targets)
        sampled = batch.get("sampled")
        if sampled is None or not bool(sampled.any()):
            return self.loss_fn(hidden, weight, weights=weights, **common)
        on = sampled[:, None].expand(-1, batch["labels"].shape[1] - 1).flatten()
        own = batch.get("by_teacher")
        own = on if own is None else on & ~own[:, None].expand_as(
            batch["labels"][:, 1:]).flatten()
        self._score_samples(targets, labels, own)
        if not self.loss_fn.spec.ce_weight:
            return self.loss_fn(hidden, weight, weights=weights, **common)
        loss_d, parts_d = self.loss_fn(hidden, weight, weights=weights * ~on, **common)
        loss_s, parts_s = self.sample_loss_fn(hidden, weight, weights=weights * on, **common)
        return loss_d + loss_s, {"divergence": parts_d["divergence"] + parts_s["divergence"],
                                 "ce": parts_d["ce"]}

    @torch.no_grad()
    def _score_samples(self, targets: dict, labels: torch.Tensor, on: torch.Tensor) -> None:
        """Sum of the teacher's log-probs of the student's sampled tokens, and their count."""
        from distill.losses import linear_divergence

        mask = on & (labels != self.loss_fn.spec.ignore_index)
        t_h, t_w, t_head = targets["teacher_hidden"], targets["teacher_weight"], \
            targets["teacher_head"]
        _, parts = linear_divergence(t_h, t_w, teacher_hidden=t_h, teacher_weight=t_w,
                                     student_head=t_head, teacher_head=t_head, labels=labels,
                                     weights=mask.float(), kind="forward_kl",
                                     vocab_size=self.vocab_size, return_components=True)
        sums = torch.stack([-parts["ce"], mask.sum().float()])
        self._sampled_sums = sums if self._sampled_sums is None else self._sampled_sums + sums

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
        self._check_rollout_setup()

    def _check_rollout_setup(self) -> None:
        if not self.rolls_out:
            return
        from lightning.pytorch.strategies import FSDPStrategy

        if isinstance(self.trainer.strategy, FSDPStrategy):
            raise ValueError("on-policy sampling runs the student's generate, which needs "
                             "its whole weights on each rank; FSDP shards them: use "
                             "strategy=ddp (trainer=ddp) or loss.on_policy.fraction=0")
        if not any(isinstance(cb, StepTokenCounter) for cb in self.trainer.callbacks):
            raise RuntimeError("on-policy distillation samples each step's window in the "
                               "StepTokenCounter callback: add distill.callbacks."
                               "StepTokenCounter to the trainer's callbacks "
                               "(callbacks=default has it)")

    def training_step(self, batch: dict, batch_idx: int):
        masks = batch_masks(batch, self.loss_fn.spec.ignore_index)
        step = self._step_counts(masks)
        weights = token_weights(self.policy, masks, step).flatten()
        loss, parts = self._divergence(batch, weights, train=True)
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
        self._log_rollout()
        if self.step_counts is not None:
            s = self.step_counts
            self.log("train/step_valid_tokens", float(s.valid), on_step=True, on_epoch=False)
            self.log("train/step_real_tokens", float(s.real), on_step=True, on_epoch=False)
            self.log("train/valid_fraction", s.valid / max(s.real, 1), on_step=True,
                     on_epoch=False)

    def _log_rollout(self) -> None:
        stats, self._rollout_stats = self._rollout_stats, None
        if stats is None:
            return
        opts = dict(on_step=True, on_epoch=False, sync_dist=True)
        if stats.rows:
            self.log("rollout/mean_length", stats.tokens / stats.rows, **opts)
            self.log("rollout/cut_fraction", stats.cut / stats.rows, **opts)
        if self._sampled_sums is not None:
            logp, n = self._sampled_sums.tolist()
            if n:
                self.log("rollout/teacher_logprob", logp / n, **opts)
        self._sampled_sums = None
        self.log("time/rollout_s", stats.seconds, **opts)
        if self._rollout_end is not None:
            self.log("time/train_s", time.perf_counter() - self._rollout_end, **opts)

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
