"""The loss users call: `linear_divergence`, `linear_cross_entropy` (functional) and
`FusedLinearDivergence` (module).

They take final hidden states and LM-head weights, never logits. Rows that carry no
weight (ignored labels, zero weight) are dropped before any GEMM; the ops in
`distill.ops` compute loss and gradients chunk by chunk.
"""

from __future__ import annotations

import functools
import inspect

import torch

from distill.core.constants import IGNORE_INDEX
from distill.losses.validation import check_ce_inputs, check_inputs
from distill.ops.chunked import DEFAULT_TUNING, Targets, Tuning
from distill.ops.cross_entropy import cross_entropy_op
from distill.ops.function import divergence_op, report
from distill.ops.spec import DivergenceSpec, HeadTransform, op_head


def outside_autocast(fn):
    """Under autocast (Lightning's bf16-mixed with fp32 master weights) autocast would run
    the loss's GEMMs and reductions in bf16, rounding the logits and the loss itself. The
    GEMM operands take autocast's dtype, as autocast would give them, and the loss runs
    with autocast off: fp32 logits out of the GEMM, fp32 math after it."""

    first, second = list(inspect.signature(fn).parameters)[:2]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        args = list(args)
        hidden = args.pop(0) if args else kwargs.pop(first)
        weight = args.pop(0) if args else kwargs.pop(second)
        device = hidden.device.type
        if not torch.is_autocast_enabled(device):
            return fn(hidden, weight, *args, **kwargs)
        half = torch.get_autocast_dtype(device)

        def cast(x):
            return x.to(half) if x is not None and x.dtype == torch.float32 else x

        for key in ("teacher_hidden", "teacher_weight"):
            if key in kwargs:
                kwargs[key] = cast(kwargs[key])
        with torch.autocast(device, enabled=False):
            return fn(cast(hidden), cast(weight), *args, **kwargs)

    return wrapper


@outside_autocast
def linear_divergence(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    *,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    target_ids: torch.Tensor | None = None,
    target_logprobs: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    ce_weight: float | torch.Tensor = 0.0,
    ignore_index: int = IGNORE_INDEX,
    temperature_squared: bool = False,
    sparse_mode: str = "tail",
    divergence_weight: float = 1.0,
    vocab_size: int | None = None,
    student_head: HeadTransform | None = None,
    teacher_head: HeadTransform | None = None,
    chunk_size: int | None = None,
    fp32_weight_grad: bool = False,
    backend: str = "auto",
    return_components: bool = False,
    spec: DivergenceSpec | None = None,
    tuning: Tuning | None = None,
):
    """sum_i weights_i * loss_i (fp32 scalar) between student and teacher distributions.

    student_hidden (N, Hs) and student_weight (V', Hs) give the student logits; the target
    is either a live teacher (teacher_hidden (N, Ht), teacher_weight (V'', Ht)) or cached
    top-k (target_ids (N, K), target_logprobs (N, K) at the training temperature).
    `weights` (N,) defaults to 1 / (number of trained positions), i.e. the mean.
    `vocab_size` keeps the first rows of both heads (heads padded past the tokenizer);
    by default both heads must have the same number of rows. The divergence is taken at
    `temperature`; `temperature_squared` multiplies it by T**2; `divergence_weight`
    multiplies it. `ce_weight` adds the hard-label cross-entropy of the untempered student
    logits: one number, or a (N,) tensor of per-position CE weights (0 where a position
    trains the divergence alone, e.g. a student's own samples). `spec` gives the options as
    one `DivergenceSpec` instead (the keywords are then ignored). Gradients flow into
    student_hidden, student_weight (and a student bias in `student_head`). `tuning`: the
    CUDA path's knobs, for benchmarks. With `return_components`, also returns
    {"divergence", "ce"}: the weighted divergence part and sum_i w_i CE_i.
    """
    ce_rows = ce_weight if isinstance(ce_weight, torch.Tensor) else None
    if spec is None:
        spec = DivergenceSpec(kind=kind, beta=beta, temperature=temperature,
                              temperature_squared=temperature_squared,
                              ce_weight=0.0 if ce_rows is not None else float(ce_weight),
                              divergence_weight=divergence_weight, sparse_mode=sparse_mode)
    elif ce_rows is None and ce_weight:
        raise ValueError("give ce_weight in the spec, or as a (N,) tensor beside it")
    vocab = check_inputs(student_hidden, student_weight, teacher_hidden, teacher_weight,
                         target_ids, target_logprobs, labels, weights, spec, vocab_size,
                         ignore_index, ce_rows)
    targets = Targets(
        teacher_hidden=teacher_hidden,
        teacher_weight=_rows(teacher_weight, vocab),
        teacher_head=op_head(teacher_head, vocab),
        ids=target_ids, logprobs=target_logprobs,
    )
    parts = {"device": student_hidden.device} if return_components else None
    loss = divergence_op(
        student_hidden, _rows(student_weight, vocab), targets=targets, labels=labels,
        weights=weights, spec=spec, ce_rows=ce_rows, ignore_index=ignore_index,
        student_head=op_head(student_head, vocab),
        chunk_size=chunk_size, fp32_weight_grad=fp32_weight_grad, backend=backend,
        tuning=tuning or DEFAULT_TUNING, parts=parts)
    if not return_components:
        return loss
    ce, weighted = report(parts)
    return loss, {"divergence": loss.detach() - weighted, "ce": ce}


@outside_autocast
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    head: HeadTransform | None = None,
    vocab_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
    fp32_weight_grad: bool = False,
):
    """sum_i weights_i * CE_i (fp32 scalar) of the logits hidden (N, H) @ weight[:vocab].T
    (plus the head's extras) on `labels` (N,); `weights` default to the mean over the
    labelled positions. Gradients flow into hidden, weight and a head bias."""
    vocab = check_ce_inputs(hidden, weight, labels, weights, vocab_size, ignore_index)
    return cross_entropy_op(hidden, _rows(weight, vocab), labels, weights,
                            ignore_index=ignore_index,
                            head=op_head(head, vocab),
                            chunk_size=chunk_size, fp32_weight_grad=fp32_weight_grad)


def _rows(x: torch.Tensor | None, vocab: int) -> torch.Tensor | None:
    """x[:vocab], or x itself when nothing is cut: a slice view would route the weight's
    gradient through a zero-filled weight-sized buffer and a copy."""
    return x if x is None or x.shape[0] == vocab else x[:vocab]


class FusedLinearDivergence(torch.nn.Module):
    """nn.Module form of `linear_divergence`: the options once (a `DivergenceSpec`, or its
    keywords), the tensors per call."""

    def __init__(self, spec: DivergenceSpec | None = None, *, chunk_size=None,
                 fp32_weight_grad=False, backend="auto", **options):
        super().__init__()
        if spec is not None and options:
            raise ValueError("give a DivergenceSpec or its options, not both")
        self.spec = spec.spec() if spec is not None else DivergenceSpec(**options)
        self.chunk_size, self.fp32_weight_grad, self.backend = (chunk_size, fp32_weight_grad,
                                                                backend)

    def forward(self, student_hidden, student_weight, **kwargs):
        return linear_divergence(student_hidden, student_weight, spec=self.spec,
                                 chunk_size=self.chunk_size,
                                 fp32_weight_grad=self.fp32_weight_grad,
                                 backend=self.backend, **kwargs)

    def extra_repr(self) -> str:
        s = self.spec
        return f"kind={s.kind}, beta={s.beta}, temperature={s.temperature}, ce={s.ce_weight}"
