"""Row-wise divergence math in PyTorch: loss and d(loss)/d(logits) for a chunk of rows.

This is the CPU implementation of the op's inner step (the Triton kernel in
`divergence_triton.py` is the CUDA one). The gradient is in closed form so the forward
pass can produce it: with a = logits / T, q = softmax(a) and categories c (one per vocab
entry, or the K cached ids plus a tail bucket), d loss / d a_j = q_j * (G_c(j) - <q, G>)
where G = d loss / d q_c. Forward KL is written as q - p directly instead, because its
G = -p / q overflows where the student is confident and the teacher is not.
"""

from __future__ import annotations

import math

import torch

from distill.losses.spec import TAIL_FLOOR, DivergenceSpec


def _plogratio(p, logp, logr):
    # 0 * log 0 = 0: the teacher (or the tail bucket) often has exact zeros.
    return torch.where(p > 0, p * (logp - logr), torch.zeros_like(p))


def _divergence_and_g(logp, logq, spec: DivergenceSpec):
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


def _grad_from_g(q, g):
    return q * (g - (q * g).sum(-1, keepdim=True))


def rows_loss_and_grad(zs, zt, target_ids, target_logprobs, labels, spec, need_grad, *,
                       row_scale=None, grad_dtype=torch.float32, ce_out=None):
    """Loss (C,) and its gradient w.r.t. the student logits zs (C, V), in fp32.

    zt: (C, V) teacher logits (live) or None; target_ids / target_logprobs: (C, K) cached.
    Every row given here is trained (the caller gathered them). `row_scale` (C,) multiplies
    each gradient row, `grad_dtype` is the gradient's dtype, `ce_out` (C,) receives each
    row's cross-entropy (the Triton kernel takes the same options).
    """
    t = spec.temperature
    logq = torch.log_softmax(zs / t, dim=-1)  # (C, V)
    if zt is not None:
        logp = torch.log_softmax(zt / t, dim=-1)
        loss, g = _divergence_and_g(logp, logq, spec)
        da = None
        if need_grad:
            q = logq.exp()
            da = q - logp.exp() if g is None else _grad_from_g(q, g)
    else:
        loss, da = _sparse(logq, target_ids, target_logprobs, spec, need_grad)
    factor = spec.divergence_factor
    loss = loss * factor
    dz = da * (factor / t) if need_grad else None
    if labels is not None and (spec.ce_weight or ce_out is not None):
        logp_hard = logq if t == 1.0 else torch.log_softmax(zs, dim=-1)
        ce = -logp_hard.gather(-1, labels[:, None]).squeeze(-1)
        loss = loss + spec.ce_weight * ce
        if ce_out is not None:
            ce_out.copy_(ce)
        if need_grad and spec.ce_weight:
            dz = dz + spec.ce_weight * logp_hard.exp()
            dz.scatter_add_(-1, labels[:, None], dz.new_full((len(labels), 1), -spec.ce_weight))
    if need_grad and row_scale is not None:
        dz = dz * row_scale[:, None].to(dz.dtype)
    return loss, dz.to(grad_dtype) if need_grad else None


def _sparse(logq, ids, logp_k, spec, need_grad):
    """Divergence over the K cached ids (+ tail bucket), and its gradient on the full vocab."""
    logq_k = logq.gather(-1, ids)  # (C, K)
    logp_k = logp_k.float()
    if spec.sparse_mode == "renormalize":
        logp_c = logp_k - logp_k.logsumexp(-1, keepdim=True)
        logq_c = logq_k - logq_k.logsumexp(-1, keepdim=True)
        loss, g = _divergence_and_g(logp_c, logq_c, spec)
        if not need_grad:
            return loss, None
        q_c = logq_c.exp()
        da_k = q_c - logp_c.exp() if g is None else _grad_from_g(q_c, g)
        return loss, torch.zeros_like(logq).scatter_(-1, ids, da_k)
    in_topk = torch.zeros_like(logq, dtype=torch.bool).scatter_(-1, ids, True)
    logq_tail = logq.masked_fill(in_topk, -math.inf).logsumexp(-1, keepdim=True)  # (C, 1)
    p_tail = (1 - logp_k.exp().sum(-1, keepdim=True)).clamp_min(0)
    if ids.shape[-1] == logq.shape[-1]:
        p_tail = torch.zeros_like(p_tail)  # K = V: no tail, only rounding noise
    if spec.kind == "reverse_kl":
        p_tail = p_tail.clamp_min(TAIL_FLOOR)  # else an empty teacher tail makes RKL infinite
    logp_c = torch.cat([logp_k, p_tail.log()], -1)  # (C, K + 1)
    logq_c = torch.cat([logq_k, logq_tail], -1)
    loss, g = _divergence_and_g(logp_c, logq_c, spec)
    if not need_grad:
        return loss, None
    q = logq.exp()
    if g is None:
        # forward KL: tail entries get q_j - p_tail * q_j / q_tail, cached ids q_k - p_k
        share = torch.where(p_tail > 0, p_tail * torch.exp(logq - logq_tail), 0.0)
        return loss, (q - share).scatter_(-1, ids, logq_k.exp() - logp_k.exp())
    g_vocab = g[:, -1:].expand_as(logq).clone().scatter_(-1, ids, g[:, :-1])  # (C, V)
    return loss, _grad_from_g(q, g_vocab)
