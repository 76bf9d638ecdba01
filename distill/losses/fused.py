"""The loss users call: `linear_divergence` (functional) and `FusedLinearDivergence` (module).

Both take final hidden states and LM-head weights, never logits. Rows that carry no
weight (ignored labels, zero weight) are dropped before any GEMM, then the op in
`distill.ops.linear_divergence` computes loss and gradients chunk by chunk.
"""

from __future__ import annotations

import functools

import torch

from distill.losses.spec import DivergenceSpec, HeadTransform
from distill.losses.validation import check_inputs
from distill.ops.linear_divergence import Targets, fused_rows, resolve_backend


class _LinearDivergence(torch.autograd.Function):
    """Gradients are computed in forward (the weights are known); backward scales them."""

    @staticmethod
    def forward(ctx, hs, ws, bias, rows, targets, labels, weights, opts):
        every_row = len(rows) == len(hs)  # e.g. pretraining: no gather, no scatter
        # only the gradients autograd asks for: a frozen head (LoRA) skips the d weight GEMM
        loss, (g_h, g_w, g_b) = fused_rows(hs if every_row else hs[rows], ws, targets, labels,
                                           weights, need_grad=True,
                                           needs=tuple(ctx.needs_input_grad[:3]), **opts)
        grad_h = g_h
        if g_h is not None and not every_row:
            grad_h = torch.zeros_like(hs).index_copy_(0, rows, g_h)
        # Held as plain attributes (not saved tensors) and dropped in backward, so that the
        # returned gradients are the only references: autograd then takes them as .grad
        # instead of cloning a weight-sized tensor.
        ctx.grads = (grad_h, g_w, g_b if bias is not None else None)
        ctx.weight_dtype = ws.dtype
        ctx.triton = resolve_backend(hs.device, opts["backend"]) == "triton"
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError("linear_divergence: backward through the same loss twice; "
                               "its gradients were computed once, in forward")
        grad_h, grad_w, grad_b = ctx.grads
        ctx.grads = None
        # scaled in place (a copy of grad_w would cost its size), and only if
        # grad_out != 1: on the Triton path a kernel reads grad_out on the device, so
        # backward does not wait for the forward's GPU work (no host sync)
        grads = [g for g in (grad_h, grad_w, grad_b) if g is not None]
        if ctx.triton and all(g.is_contiguous() for g in grads):
            from distill.ops import divergence_triton

            divergence_triton.scale_(grads, grad_out)
        elif bool(grad_out != 1):
            for g in grads:
                g.mul_(grad_out.to(g.dtype))
        if grad_w is not None:
            grad_w = grad_w.to(ctx.weight_dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _outside_autocast(fn):
    """Under autocast (Lightning's bf16-mixed with fp32 master weights) autocast would run
    the loss's GEMMs and reductions in bf16, rounding the logits and the loss itself. The
    GEMM operands take autocast's dtype, as autocast would give them, and the loss runs
    with autocast off: fp32 logits out of the GEMM, fp32 math after it."""

    @functools.wraps(fn)
    def wrapper(student_hidden, student_weight, **kwargs):
        device = student_hidden.device.type
        if not torch.is_autocast_enabled(device):
            return fn(student_hidden, student_weight, **kwargs)
        half = torch.get_autocast_dtype(device)

        def cast(x):
            return x.to(half) if x is not None and x.dtype == torch.float32 else x

        for key in ("teacher_hidden", "teacher_weight"):
            kwargs[key] = cast(kwargs.get(key))
        with torch.autocast(device, enabled=False):
            return fn(cast(student_hidden), cast(student_weight), **kwargs)

    return wrapper


@_outside_autocast
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
    ce_weight: float = 0.0,
    ignore_index: int = -100,
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
):
    """sum_i weights_i * loss_i (fp32 scalar) between student and teacher distributions.

    student_hidden (N, Hs) and student_weight (V', Hs) give the student logits; the target
    is either a live teacher (teacher_hidden (N, Ht), teacher_weight (V'', Ht)) or cached
    top-k (target_ids (N, K), target_logprobs (N, K) at the training temperature).
    `weights` (N,) defaults to 1 / (number of trained positions), i.e. the mean.
    `vocab_size` keeps the first rows of both heads (heads padded past the tokenizer);
    by default both heads must have the same number of rows. The divergence is taken at
    `temperature`; `temperature_squared` multiplies it by T**2. `ce_weight` adds the hard
    label cross-entropy of the untempered student logits. Gradients flow into
    student_hidden, student_weight (and a student bias in `student_head`).
    """
    spec = DivergenceSpec(kind, beta, temperature, ce_weight, ignore_index,
                          temperature_squared, sparse_mode, divergence_weight)
    vocab = check_inputs(student_hidden, student_weight, teacher_hidden, teacher_weight,
                         target_ids, target_logprobs, labels, weights, spec, vocab_size)
    rows, w = _trained_rows(student_hidden, labels, weights, spec)
    # labels reach the op for the CE term, or to report the CE (return_components)
    lab = labels[rows] if (labels is not None and (ce_weight or return_components)) else None
    targets = Targets(
        teacher_hidden=_take(teacher_hidden, rows),
        teacher_weight=_rows(teacher_weight, vocab),
        teacher_head=_sliced(teacher_head, vocab),
        ids=target_ids[rows].long() if target_ids is not None else None,
        logprobs=target_logprobs[rows] if target_logprobs is not None else None,
    )
    head = _sliced(student_head, vocab)
    ws = _rows(student_weight, vocab)
    ce_sum = torch.zeros((), dtype=torch.float32, device=student_hidden.device)
    opts = dict(spec=spec, chunk_size=chunk_size, fp32_weight_grad=fp32_weight_grad,
                backend=backend, student_head=head, ce_sum=ce_sum if return_components else None)
    bias = head.bias if head is not None else None
    need_grad = torch.is_grad_enabled() and (
        student_hidden.requires_grad or student_weight.requires_grad
        or (bias is not None and bias.requires_grad)
    )
    if need_grad:
        loss = _LinearDivergence.apply(student_hidden, ws, bias, rows, targets, lab, w, opts)
    else:
        loss, _ = fused_rows(student_hidden[rows], ws, targets, lab, w, need_grad=False,
                             **opts)
    if not return_components:
        return loss
    ce = ce_sum.detach()
    return loss, {"divergence": loss.detach() - spec.ce_weight * ce, "ce": ce}


def _take(x: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """x[rows], without the copy when every row is kept."""
    return x if x is None or len(rows) == len(x) else x[rows]


def _rows(x: torch.Tensor | None, vocab: int) -> torch.Tensor | None:
    """x[:vocab], or x itself when nothing is cut: a slice view would route the weight's
    gradient through a zero-filled weight-sized buffer and a copy."""
    return x if x is None or x.shape[0] == vocab else x[:vocab]


def _sliced(head: HeadTransform | None, vocab: int) -> HeadTransform | None:
    if head is None or head.bias is None:
        return head
    return HeadTransform(_rows(head.bias, vocab), head.scale, head.softcap)


def _trained_rows(hidden, labels, weights, spec):
    """Indices of the rows that carry weight, and their weights (fp32)."""
    n = hidden.shape[0]
    if labels is None and weights is None:  # every row, the mean: no host sync
        return (torch.arange(n, device=hidden.device),
                torch.full((n,), 1.0 / max(n, 1), dtype=torch.float32, device=hidden.device))
    keep = torch.ones(n, dtype=torch.bool, device=hidden.device)
    if labels is not None:
        keep &= labels != spec.ignore_index
    if weights is None:
        w = torch.ones(n, dtype=torch.float32, device=hidden.device) / keep.sum().clamp_min(1)
    else:
        w = weights.float()
        keep &= w != 0
    rows = keep.nonzero().squeeze(-1)
    return rows, w[rows]


class FusedLinearDivergence(torch.nn.Module):
    """nn.Module form of `linear_divergence`: the options once, the tensors per call."""

    def __init__(self, kind="reverse_kl", beta=0.5, temperature=1.0, ce_weight=0.0,
                 ignore_index=-100, temperature_squared=False, sparse_mode="tail",
                 divergence_weight=1.0, chunk_size=None, fp32_weight_grad=False,
                 backend="auto"):
        super().__init__()
        self.spec = DivergenceSpec(kind, beta, temperature, ce_weight, ignore_index,
                                   temperature_squared, sparse_mode, divergence_weight)
        self.chunk_size = chunk_size
        self.fp32_weight_grad = fp32_weight_grad
        self.backend = backend

    def forward(self, student_hidden, student_weight, **kwargs):
        s = self.spec
        return linear_divergence(
            student_hidden, student_weight, kind=s.kind, beta=s.beta,
            temperature=s.temperature, ce_weight=s.ce_weight, ignore_index=s.ignore_index,
            temperature_squared=s.temperature_squared, sparse_mode=s.sparse_mode,
            divergence_weight=s.divergence_weight, chunk_size=self.chunk_size,
            fp32_weight_grad=self.fp32_weight_grad,
            backend=self.backend, **kwargs,
        )

    def extra_repr(self) -> str:
        s = self.spec
        return f"kind={s.kind}, beta={s.beta}, temperature={s.temperature}, ce={s.ce_weight}"
