"""Cross-entropy from hidden states and an LM head, chunk by chunk: the logits never exist.

For the runs and the numbers that need hard labels alone: CE-only training (the baseline a
distilled student must beat), SeqKD on teacher-written answers, a model's perplexity on
validation data, the teacher's log-probability of sampled tokens. Only (chunk x V) fp32
logits exist at a time; the gradient (softmax - one-hot) is formed in place over them and
folded into d hidden and d weight in forward, as the divergence op does.
"""

from __future__ import annotations

import torch

from distill.ops.chunked import chain_head, choose_chunk_size, fold, project
from distill.ops.function import trained_rows
from distill.ops.spec import HeadTransform


def _chunk_ce(z, labels, need_grad):
    """Per-row CE (C,) of fp32 logits (C, V), and softmax - one-hot written over z."""
    lse = torch.logsumexp(z, dim=-1)
    ce = lse - z.gather(-1, labels[:, None]).squeeze(-1)
    if not need_grad:
        return ce, None
    z.sub_(lse[:, None]).exp_()  # the softmax, in place
    z.scatter_add_(-1, labels[:, None], z.new_full((len(labels), 1), -1.0))
    return ce, z


def ce_rows(hs, ws, labels, weights, *, head: HeadTransform | None, chunk_size, need_grad,
            needs=(True, True, True), fp32_weight_grad=False):
    """sum_i w_i CE_i over given (trained) rows, and (grad_h, grad_w, grad_b)."""
    n, vocab = hs.shape[0], ws.shape[0]
    loss = torch.zeros((), dtype=torch.float32, device=hs.device)
    need_h, need_w, need_b = needs if need_grad else (False, False, False)
    need_b = need_b and head is not None and head.bias is not None
    grad_h = torch.empty_like(hs) if need_h else None
    wdtype = torch.float32 if (fp32_weight_grad or not hs.is_cuda) else ws.dtype
    alloc = torch.zeros if n == 0 else torch.empty  # the first chunk's fold writes it all
    grad_w = alloc(ws.shape, dtype=wdtype, device=ws.device) if need_w else None
    grad_b = torch.zeros(vocab, dtype=torch.float32, device=ws.device) if need_b else None
    if n == 0:
        return loss, (grad_h, grad_w, grad_b)
    chunk = min(n, chunk_size or choose_chunk_size(n, vocab, False, hs.device))
    buf = torch.empty((chunk, vocab), dtype=torch.float32, device=hs.device)
    for start in range(0, n, chunk):
        sl = slice(start, min(n, start + chunk))
        h = hs[sl]
        z, u = project(h, ws, head, buf[: h.shape[0]])
        ce, dz = _chunk_ce(z, labels[sl], need_h or need_w or need_b)
        loss += ce @ weights[sl]
        if dz is None:
            continue
        dz = chain_head(dz * weights[sl][:, None], u, head)
        if grad_b is not None:
            grad_b += dz.sum(0)
        if hs.is_cuda:
            dz = dz.to(ws.dtype)
        fold(dz, h, ws, grad_h[sl] if grad_h is not None else None, grad_w, first=start == 0)
    return loss, (grad_h, grad_w, grad_b)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hs, ws, bias, rows, labels, weights, opts):
        every_row = len(rows) == len(hs)
        needs = tuple(ctx.needs_input_grad[:3])
        loss, (g_h, g_w, g_b) = ce_rows(hs if every_row else hs[rows], ws, labels, weights,
                                        need_grad=True, needs=needs, **opts)
        if g_h is not None and not every_row:
            g_h = torch.zeros_like(hs).index_copy_(0, rows, g_h)
        ctx.grads = (g_h, g_w, g_b if bias is not None else None)
        ctx.weight_dtype = ws.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        g_h, g_w, g_b = ctx.grads
        ctx.grads = None
        scale = grad_out.float()
        out = [None if g is None else g.mul_(scale.to(g.dtype)) for g in (g_h, g_w, g_b)]
        if out[1] is not None:
            out[1] = out[1].to(ctx.weight_dtype)
        return *out, None, None, None, None


def cross_entropy_op(hs, ws, labels, weights, *, ignore_index: int,
                     head: HeadTransform | None, chunk_size=None, fp32_weight_grad=False):
    rows, w = trained_rows(hs.shape[0], labels, weights, ignore_index, hs.device)
    lab = labels[rows]
    opts = dict(head=head, chunk_size=chunk_size, fp32_weight_grad=fp32_weight_grad)
    bias = head.bias if head is not None else None
    need_grad = torch.is_grad_enabled() and (
        hs.requires_grad or ws.requires_grad or (bias is not None and bias.requires_grad))
    if need_grad:
        return _LinearCrossEntropy.apply(hs, ws, bias, rows, lab, w, opts)
    return ce_rows(hs[rows], ws, lab, w, need_grad=False, **opts)[0]
