"""The fused linear divergence as one autograd Function over the trained rows.

`divergence_op` gathers the rows that carry weight (an SFT batch whose prompts are half its
tokens costs half the GEMMs), splits them by their cross-entropy weight (dataset rows train
divergence + CE, sampled rows the divergence alone: one call, no second loss object), runs
the chunk loop of `chunked.fused_rows` on each group and sums. Gradients are computed in
forward, where the weights are known; backward only scales them by grad_output.
"""

from __future__ import annotations

import dataclasses

import torch

from distill.ops.chunked import DEFAULT_TUNING, Targets, fused_rows, resolve_backend
from distill.ops.spec import DivergenceSpec, HeadTransform


class _LinearDivergence(torch.autograd.Function):
    """Gradients are computed in forward (the weights are known); backward scales them."""

    @staticmethod
    def forward(ctx, hs, ws, bias, rows, groups, targets, labels, weights, opts, parts):
        # e.g. pretraining: no gather, no scatter
        every_row = rows is None or len(rows) == len(hs)
        needs = tuple(ctx.needs_input_grad[:3])
        loss = None
        grad_h = torch.zeros_like(hs) if needs[0] and not every_row else None
        grad_w = grad_b = None
        for spec, sel in groups:
            part = _select(sel, hs if every_row else hs[rows], targets, labels, weights)
            # only the gradients autograd asks for: a frozen head (LoRA) skips d weight
            l_g, (g_h, g_w, g_b) = fused_rows(part[0], ws, *part[1:], spec=spec,
                                              need_grad=True, needs=needs,
                                              ce_sum=_ce_sum(parts, spec), **opts)
            loss = l_g if loss is None else loss.add_(l_g)
            if g_h is not None:
                at = _index(rows, sel)
                if every_row and sel is None:
                    grad_h = g_h
                else:
                    grad_h = torch.zeros_like(hs) if grad_h is None else grad_h
                    grad_h.index_copy_(0, at, g_h)
            grad_w = g_w if grad_w is None else grad_w.add_(g_w)
            if g_b is not None:
                grad_b = g_b if grad_b is None else grad_b.add_(g_b)
        if loss is None:  # no trained row carries a CE group
            loss = torch.zeros((), dtype=torch.float32, device=hs.device)
        # Held as plain attributes (not saved tensors) and dropped in backward, so that the
        # returned gradients are the only references: autograd then takes them as .grad
        # instead of cloning a weight-sized tensor.
        ctx.grads = (grad_h, grad_w, grad_b if bias is not None else None)
        ctx.weight_dtype = ws.dtype
        ctx.triton = resolve_backend(hs.device, opts["backend"]) == "triton"
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grads = take_grads(ctx, grad_out, "linear_divergence")
        return (*grads, None, None, None, None, None, None, None)


def take_grads(ctx, grad_out, name: str) -> tuple:
    """The (hidden, weight, bias) gradients a Function computed in its forward, released
    from `ctx` (a second backward is refused) and scaled by `grad_out`: in place (a copy of
    grad_w would cost its size), and only if grad_out != 1. On the Triton path
    (`ctx.triton`) a kernel reads grad_out on the device, so backward does not wait for
    the forward's GPU work (no host sync)."""
    if ctx.grads is None:
        raise RuntimeError(f"{name}: backward through the same loss twice; its gradients "
                           "were computed once, in forward")
    grad_h, grad_w, grad_b = ctx.grads
    ctx.grads = None
    grads = [g for g in (grad_h, grad_w, grad_b) if g is not None]
    if getattr(ctx, "triton", False) and all(g.is_contiguous() for g in grads):
        from distill.ops import divergence_triton

        divergence_triton.scale_(grads, grad_out)
    elif bool(grad_out != 1):
        for g in grads:
            g.mul_(grad_out.to(g.dtype))
    if grad_w is not None:
        grad_w = grad_w.to(ctx.weight_dtype)
    return grad_h, grad_w, grad_b


def _ce_sum(parts: dict | None, spec: DivergenceSpec):
    """A fresh sum for one CE group's sum_i w_i ce_i; `parts` collects it (see report)."""
    if parts is None:
        return None
    s = torch.zeros((), dtype=torch.float32, device=parts["device"])
    parts.setdefault("groups", []).append((spec.ce_weight, s))
    return s


def report(parts: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_i w_i ce_i, sum_i w_i c_i ce_i) over the groups of one call."""
    zero = torch.zeros((), dtype=torch.float32, device=parts["device"])
    groups = parts.get("groups", [])
    ce = sum((s for _, s in groups), zero)
    return ce, sum((c * s for c, s in groups), zero)


def _select(sel, hs, targets: Targets, labels, weights):
    """The operands of one CE group (sel: indices into the trained rows, None: all)."""
    if sel is None:
        return hs, targets, labels, weights

    def take(x):
        return None if x is None else x[sel]

    sub = Targets(teacher_hidden=take(targets.teacher_hidden),
                  teacher_weight=targets.teacher_weight, teacher_head=targets.teacher_head,
                  ids=take(targets.ids), logprobs=take(targets.logprobs))
    return hs[sel], sub, take(labels), weights[sel]


def trained_rows(n: int, labels, weights, ignore_index: int, device):
    """Indices of the rows that carry weight (None: every row), and their weights (fp32)."""
    if labels is None and weights is None:  # every row, the mean: no host sync, no index
        return None, torch.full((n,), 1.0 / max(n, 1), dtype=torch.float32, device=device)
    keep = torch.ones(n, dtype=torch.bool, device=device)
    if labels is not None:
        keep &= labels != ignore_index
    if weights is None:
        w = torch.ones(n, dtype=torch.float32, device=device) / keep.sum().clamp_min(1)
    else:
        w = weights.float()
        keep &= w != 0
    rows = keep.nonzero().squeeze(-1)
    return rows, w[rows]


def ce_groups(spec: DivergenceSpec, ce_rows, rows):
    """[(spec with that row group's CE weight, indices into the trained rows or None)].
    `ce_rows` (N,): a CE weight per position (None: spec.ce_weight everywhere)."""
    if ce_rows is None:
        return [(spec, None)]
    own = _take(ce_rows, rows).float()
    values = torch.unique(own).tolist()
    if len(values) == 1:
        return [(dataclasses.replace(spec, ce_weight=float(values[0])), None)]
    return [(dataclasses.replace(spec, ce_weight=float(v)), (own == v).nonzero().squeeze(-1))
            for v in values]


def divergence_op(hs, ws, *, targets: Targets, labels, weights, spec: DivergenceSpec,
                  ce_rows=None, ignore_index: int, student_head: HeadTransform | None,
                  chunk_size, fp32_weight_grad, backend, tuning=DEFAULT_TUNING,
                  parts: dict | None = None):
    """sum_i w_i loss_i over the trained rows of (N, H) `hs` (targets still full-length).
    `parts`, a dict with "device", receives each CE group's sum_i w_i ce_i (see report)."""
    rows, w = trained_rows(hs.shape[0], labels, weights, ignore_index, hs.device)
    groups = ce_groups(spec, ce_rows, rows)
    with_ce = any(g.ce_weight for g, _ in groups) or parts is not None
    lab = labels[rows] if (labels is not None and with_ce) else None
    ids, lps = _take(targets.ids, rows), _take(targets.logprobs, rows)
    if ids is not None:
        # torch.gather takes int64 ids; the Triton kernels read int32 or int64 rows of
        # unit stride (no copy when every row trains and the rows are contiguous)
        torch_rows = resolve_backend(hs.device, backend) == "torch"
        ids, lps = (ids.long() if torch_rows else ids.contiguous()), lps.contiguous()
    sub = Targets(
        teacher_hidden=_take(targets.teacher_hidden, rows),
        teacher_weight=targets.teacher_weight, teacher_head=targets.teacher_head,
        ids=ids, logprobs=lps,
    )
    opts = dict(chunk_size=chunk_size, fp32_weight_grad=fp32_weight_grad, backend=backend,
                student_head=student_head, tuning=tuning)
    bias = student_head.bias if student_head is not None else None
    need_grad = torch.is_grad_enabled() and (
        hs.requires_grad or ws.requires_grad or (bias is not None and bias.requires_grad))
    if need_grad:
        return _LinearDivergence.apply(hs, ws, bias, rows, groups, sub, lab, w, opts, parts)
    loss = torch.zeros((), dtype=torch.float32, device=hs.device)
    for g_spec, sel in groups:
        part = _select(sel, _take(hs, rows), sub, lab, w)
        loss += fused_rows(part[0], ws, *part[1:], spec=g_spec, need_grad=False,
                           ce_sum=_ce_sum(parts, g_spec), **opts)[0]
    return loss


def _take(x: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    """x[rows], without the copy when every row is kept (rows None or all of them)."""
    return x if x is None or rows is None or len(rows) == len(x) else x[rows]


def _index(rows: torch.Tensor | None, sel: torch.Tensor | None) -> torch.Tensor | None:
    """The positions in the full batch of a CE group's rows (sel indexes the trained rows;
    None: every row, every trained row)."""
    if sel is None:
        return rows
    return sel if rows is None else rows[sel]
