"""What a training step minimizes: the `loss:` settings and the loss of one micro-batch.

The loss of a micro-batch is sum_i w_i [d * D_i + c_i * CE_i] over its shifted positions:
D the divergence against the teacher's targets (`divergence_weight` d, T and T**2 in the
spec), CE the hard-label cross-entropy with a per-position weight c_i: `ce_weight` on the
dataset's rows and on rows the teacher wrote (SeqKD), 0 on the student's own samples
(a cross-entropy on them would only reinforce them). With `divergence_weight=0` no teacher
runs in training: the loss is the CE alone (`linear_cross_entropy`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distill.core.constants import IGNORE_INDEX
from distill.core.rules import boolean, choice, integer, number, setting
from distill.data.shift import shift_flat, shift_labels
from distill.losses import linear_cross_entropy, linear_divergence
from distill.models.causal_lm import final_hidden_states, lm_head
from distill.onpolicy.config import OnPolicyConfig
from distill.ops.spec import DivergenceSpec
from distill.training.normalization import POLICIES


@dataclass(frozen=True)
class LossConfig(DivergenceSpec):
    normalization: str = setting("valid_tokens", choice(POLICIES))
    chunk_size: int | None = setting(None, integer(1, null=True,
                                                   what=" (null picks it from the shapes)"))
    fp32_weight_grad: bool = setting(False, boolean())
    backend: str = setting("auto", choice(("auto", "torch", "triton")))
    # another tokenizer for the teacher: the divergence on aligned spans (distill/xtok)
    cross_tokenizer: str | None = setting(None, choice(("uld", "hybrid"), null=True))
    uld_weight: float = setting(1.0, number(0, strict=False, what=" (hybrid: its ULD part)"))
    on_policy: OnPolicyConfig = setting(factory=OnPolicyConfig)

    def problems(self, prefix: str = "") -> list[str]:
        out = super().problems(prefix)
        if self.ce_weight == 0 and self.divergence_weight == 0:
            out.append(f"{prefix}divergence_weight=0 and {prefix}ce_weight=0: the loss is "
                       "zero at every step and nothing trains; set divergence_weight > 0 "
                       "(distillation) and/or ce_weight > 0 (hard labels)")
        op = self.on_policy
        if self.ce_only and op.samples and op.teacher_fraction < 1:
            out.append(f"{prefix}divergence_weight=0 with {prefix}on_policy.fraction="
                       f"{op.fraction} and teacher_fraction={op.teacher_fraction}: the "
                       "student's own samples would train nothing (no divergence, and no CE "
                       "on its own samples). For CE on the labels alone set "
                       f"{prefix}on_policy.fraction=0 (+baseline=ce_only); for SeqKD, CE on "
                       f"the teacher's answers, set {prefix}on_policy.teacher_fraction=1 "
                       "(+baseline=seqkd)")
        return out

    @property
    def ce_only(self) -> bool:
        """No divergence: the CE alone trains, and no teacher runs in training steps."""
        return self.divergence_weight == 0


class Objective:
    """The loss of a micro-batch (see the module docstring) and the validation sums.
    `cross` (a cross-tokenizer run's distill.xtok CrossSetup): the divergence is taken on
    the aligned spans."""

    def __init__(self, cfg: LossConfig, teacher, vocab_size: int | None, cross=None):
        self.cfg, self.spec, self.teacher, self.vocab = cfg, cfg.spec(), teacher, vocab_size
        self.options = dict(chunk_size=cfg.chunk_size, fp32_weight_grad=cfg.fp32_weight_grad)
        self.cross = cross
        if cfg.cross_tokenizer and cross is None:
            raise ValueError(f"loss.cross_tokenizer={cfg.cross_tokenizer} needs the pairing of "
                             "the two tokenizers (distill.xtok.setup.cross_setup)")

    def _divergence(self, hs, weight, head, labels, weights, targets, ce_rows):
        """linear_divergence, or its cross-tokenizer counterpart on the aligned spans."""
        if not self.cfg.cross_tokenizer:
            return linear_divergence(
                hs, weight, labels=labels, weights=weights, spec=self.spec, student_head=head,
                vocab_size=self.vocab, ce_weight=ce_rows if ce_rows is not None else 0.0,
                backend=self.cfg.backend, return_components=True, **targets, **self.options)
        return self.cross.divergence(self.cfg, self.vocab, hs, weight, head, labels, weights,
                                     targets, ce_rows)

    def _student(self, student, batch):
        hidden = final_hidden_states(student, batch["input_ids"], batch.get("attention_mask"),
                                     batch.get("position_ids"))
        weight, head = lm_head(student)
        # position t predicts token t + 1 (the positions batch_masks weighs)
        return shift_flat(hidden), weight, head, shift_labels(batch["labels"])

    def ce_weights(self, batch: dict, n: int, device) -> torch.Tensor | None:
        """(N,) CE weight per position, or None where it is `ce_weight` everywhere."""
        own = _per_position(batch, "sampled", n, device)
        if own is None or not self.cfg.ce_weight:
            return None
        by_teacher = _per_position(batch, "by_teacher", n, device)
        if by_teacher is not None:
            own = own & ~by_teacher
        return torch.where(own, 0.0, self.cfg.ce_weight)

    def train(self, student, batch: dict, weights: torch.Tensor):
        """(loss, {"divergence", "ce"}, teacher log-prob sums of the student's samples)."""
        hs, weight, head, labels = self._student(student, batch)
        ce_rows = self.ce_weights(batch, len(labels), hs.device)
        if self.cfg.ce_only:
            scale = weights * (self.cfg.ce_weight if ce_rows is None else ce_rows)
            loss = linear_cross_entropy(hs, weight, labels, weights=scale, head=head,
                                        vocab_size=self.vocab, **self.options)
            zero = torch.zeros((), device=hs.device)
            return loss, {"divergence": zero, "ce": loss.detach() / self.cfg.ce_weight}, None
        targets = self.teacher.targets(batch)
        loss, parts = self._divergence(hs, weight, head, labels, weights, targets, ce_rows)
        return loss, parts, self._score(batch, targets, labels)

    @torch.no_grad()
    def _score(self, batch, targets: dict, labels):
        """(sum of the teacher's log-probs of the student's sampled tokens, their count)."""
        own = _per_position(batch, "sampled", len(labels), labels.device)
        if own is None or "teacher_hidden" not in targets or self.cfg.cross_tokenizer:
            return None  # (another tokenizer: the teacher scores its own tokens, not these)
        by_teacher = _per_position(batch, "by_teacher", len(labels), labels.device)
        if by_teacher is not None:
            own = own & ~by_teacher
        mask = (own & (labels != IGNORE_INDEX)).float()
        ce = linear_cross_entropy(targets["teacher_hidden"], targets["teacher_weight"], labels,
                                  weights=mask, head=targets["teacher_head"],
                                  vocab_size=self.vocab)
        return torch.stack([-ce, mask.sum()])

    @torch.no_grad()
    def validation(self, student, batch: dict, valid: torch.Tensor, with_teacher_ce: bool):
        """(4,) sums over the batch's valid positions: divergence, CE, the teacher's CE, n."""
        hs, weight, head, labels = self._student(student, batch)
        targets = self.teacher.targets(batch)
        _, parts = self._divergence(hs, weight, head, labels, valid, targets, None)
        teacher_ce = torch.zeros((), device=hs.device)
        # the teacher's perplexity on the student's labels: one vocabulary only
        if with_teacher_ce and "teacher_hidden" in targets and not self.cfg.cross_tokenizer:
            teacher_ce = linear_cross_entropy(targets["teacher_hidden"],
                                              targets["teacher_weight"], labels, weights=valid,
                                              head=targets["teacher_head"],
                                              vocab_size=self.vocab)
        return torch.stack([parts["divergence"], parts["ce"], teacher_ce, valid.sum()])


def _per_position(batch: dict, key: str, n: int, device) -> torch.Tensor | None:
    """A (B,) row flag of the batch as (N,) = (B * (T - 1),) flags of its positions."""
    flag = batch.get(key)
    if flag is None or not bool(flag.any()):
        return None
    width = batch["labels"].shape[1] - 1
    return flag.to(device)[:, None].expand(-1, width).reshape(n)
