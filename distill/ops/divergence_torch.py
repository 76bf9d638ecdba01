"""Row-wise divergence math in PyTorch: loss and d(loss)/d(logits) for a chunk of rows.

This is the CPU implementation of the op's inner step (the Triton kernel in
`divergence_triton.py` is the CUDA one). The gradient is in closed form so the forward
pass can produce it: with a = logits / T, q = softmax(a) and categories c (one per vocab
entry, or the K cached ids plus a tail bucket), d loss / d a_j = q_j * (G_c(j) - <q, G>)
where G = d loss / d q_c. Forward KL is written as q - p directly instead, because its
G = -p / q overflows where the student is confident and the teacher is not.

At the extremes (a logit tens of units above the rest) three quantities are small
differences of numbers near 1, and each is computed without forming that difference:
the log-normalizer is max + log1p(rest) (never log(1 + tiny) = 0), the student's tail
mass outside the cached ids is a log-sum-exp over those entries (never 1 - sum q_k), and
the gradient at the row's largest entry, whose exact value is ~exp(-gap), is minus the
sum of the others (every gradient row sums to zero) instead of q_* (G_* - <q, G>).
"""

from __future__ import annotations

import math

import torch

from distill.ops.spec import TAIL_FLOOR, DivergenceSpec


def _argmax_and_rest(x):
    """(max, argmax, sum of exp(x - max) over the other entries), each (C, 1)."""
    m, i = x.max(-1, keepdim=True)
    m0 = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf: a zero row
    e = torch.exp(x - m0).scatter_(-1, i, 0.0)
    return m, i, e.sum(-1, keepdim=True)


def log_softmax(x):
    """log softmax(x) in which the largest entry's log-prob is -log1p(rest), exactly."""
    m, i, rest = _argmax_and_rest(x)
    lr = torch.log1p(rest)
    return (x - m - lr).scatter_(-1, i, -lr)


def logsumexp(x):
    m, _, rest = _argmax_and_rest(x)
    return m + torch.log1p(rest)


def zero_sum_at(d, ref):
    """d with its entry `ref` (C, 1) replaced by minus the sum of the others."""
    d = d.scatter_(-1, ref, 0.0)
    return d.scatter_(-1, ref, -d.sum(-1, keepdim=True))


def _plogratio(p, logp, logr):
    # 0 * log 0 = 0: the teacher (or the tail bucket) often has exact zeros.
    return torch.where(p > 0, p * (logp - logr), torch.zeros_like(p))


def divergence_and_g(logp, logq, spec: DivergenceSpec):
    """Per-row divergence over categories, and G = dD/dq_c (None for forward KL)."""
    p, q = logp.exp(), logq.exp()
    if spec.kind == "forward_kl":
        return _plogratio(p, logp, logq).sum(-1), None
    if spec.kind == "reverse_kl":
        return _plogratio(q, logq, logp).sum(-1), torch.where(q > 0, logq - logp, 0.0)
    b = spec.beta
    logm = torch.logaddexp(logp + math.log(b), logq + math.log(1 - b))
    loss = b * _plogratio(p, logp, logm).sum(-1) + (1 - b) * _plogratio(q, logq, logm).sum(-1)
    return loss, (1 - b) * torch.where(q > 0, logq - logm, 0.0)


def category_grad(logp, logq, g):
    """d loss / d a over the categories; the largest category's entry from the others."""
    q = logq.exp()
    da = q - logp.exp() if g is None else q * (g - (q * g).sum(-1, keepdim=True))
    return zero_sum_at(da, logq.argmax(-1, keepdim=True))


def rows_loss_and_grad(zs, zt, target_ids, target_logprobs, labels, spec, need_grad, *,
                       row_scale=None, grad_dtype=torch.float32, ce_out=None):
    """Loss (C,) and its gradient w.r.t. the student logits zs (C, V), in fp32.

    zt: (C, V) teacher logits (live) or None; target_ids / target_logprobs: (C, K) cached.
    Every row given here is trained (the caller gathered them). `row_scale` (C,) multiplies
    each gradient row, `grad_dtype` is the gradient's dtype, `ce_out` (C,) receives each
    row's cross-entropy (the Triton kernel takes the same options).
    """
    t = spec.temperature
    logq = log_softmax(zs / t)  # (C, V)
    if zt is not None:
        logp = log_softmax(zt / t)
        loss, g = divergence_and_g(logp, logq, spec)
        da = category_grad(logp, logq, g) if need_grad else None
    else:
        loss, da = _sparse(logq, target_ids, target_logprobs, spec, need_grad)
    factor = spec.divergence_factor
    loss = loss * factor
    dz = da * (factor / t) if need_grad else None
    if labels is not None and (spec.ce_weight or ce_out is not None):
        logp_hard = logq if t == 1.0 else log_softmax(zs)
        ce = -logp_hard.gather(-1, labels[:, None]).squeeze(-1)
        loss = loss + spec.ce_weight * ce
        if ce_out is not None:
            ce_out.copy_(ce)
        if need_grad and spec.ce_weight:
            dz = dz + spec.ce_weight * logp_hard.exp()
            dz.scatter_add_(-1, labels[:, None], dz.new_full((len(labels), 1), -spec.ce_weight))
    # renormalized top-k alone: entries off the K ids get exactly 0, and the K ids' own
    # gradient was finished from the others already (category_grad)
    renorm_only = (zt is None and spec.sparse_mode == "renormalize"
                   and not (labels is not None and spec.ce_weight))
    if need_grad:
        if not renorm_only:
            # the largest logit's entry last, from all the others (the CE's included)
            dz = zero_sum_at(dz, zs.argmax(-1, keepdim=True))
        if row_scale is not None:
            dz = dz * row_scale[:, None].to(dz.dtype)
    return loss, dz.to(grad_dtype) if need_grad else None


def _sparse(logq, ids, logp_k, spec, need_grad):
    """Divergence over the K cached ids (+ tail bucket), and its gradient on the full vocab."""
    logq_k = logq.gather(-1, ids)  # (C, K)
    logp_k = logp_k.float()
    if spec.sparse_mode == "renormalize":
        logp_c, logq_c = log_softmax(logp_k), log_softmax(logq_k)
        loss, g = divergence_and_g(logp_c, logq_c, spec)
        if not need_grad:
            return loss, None
        da_k = category_grad(logp_c, logq_c, g)
        return loss, torch.zeros_like(logq).scatter_(-1, ids, da_k)
    in_topk = torch.zeros_like(logq, dtype=torch.bool).scatter_(-1, ids, True)
    off_topk = logq.masked_fill(in_topk, -math.inf)  # (C, V)
    logq_tail = logsumexp(off_topk)  # (C, 1): no 1 - sum(q_k)
    # 1 - sum(p_k) as -expm1(log sum p_k): exact when the teacher's tail is tiny
    p_tail = (-torch.expm1(logsumexp(logp_k))).clamp_min(0)
    if ids.shape[-1] == logq.shape[-1]:
        p_tail = torch.zeros_like(p_tail)  # K = V: no tail, only rounding noise
    if spec.kind == "reverse_kl":
        p_tail = p_tail.clamp_min(TAIL_FLOOR)  # else an empty teacher tail makes RKL infinite
    logp_c = torch.cat([logp_k, p_tail.log()], -1)  # (C, K + 1)
    logq_c = torch.cat([logq_k, logq_tail], -1)
    loss, g = divergence_and_g(logp_c, logq_c, spec)
    if not need_grad:
        return loss, None
    da_c = category_grad(logp_c, logq_c, g)
    # the tail bucket's gradient shared in proportion to each entry's part of the tail
    share = torch.where(logq_tail > -math.inf, torch.exp(off_topk - logq_tail), 0.0)
    return loss, (share * da_c[:, -1:]).scatter_(-1, ids, da_c[:, :-1])
