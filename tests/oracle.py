"""A float64 oracle for `distill.linear_divergence`, written from DESIGN.md alone.

It imports nothing from `distill`: a bug in a shared helper (how the temperature factor is
built, how a cached tail is formed) would otherwise be in the code under test and in the
oracle at once, and every comparison would pass. It builds the full (N, V) logits, writes
each divergence as its textbook formula, and lets autograd find the gradients. Its
log-softmax takes the largest entry apart (max + log1p(sum of the others)), so float64
gradients stay exact entry by entry even for logits tens of units apart.

`oracle_loss` takes the keywords of `linear_divergence` that define the loss (not the
chunking or backend ones). A head is anything with `.bias`, `.scale` and `.softcap`
attributes (distill's HeadTransform or `Head` below).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Reverse KL on cached targets floors the teacher's tail bucket at this mass: part of the
# documented contract (a top-k that sums to one would make KL(q || p) infinite), so it is
# stated here, not read from the package.
TAIL_FLOOR = 1e-8


@dataclass(frozen=True)
class Head:
    """logits = softcap * tanh((hidden @ weight.T + bias) * scale / softcap)."""

    bias: torch.Tensor | None = None  # (V,)
    scale: float = 1.0
    softcap: float | None = None


def _split_top(x):
    """(the row's largest entry (C, 1), a mask of where it is (C, V), the others minus it)."""
    top = x.argmax(-1, keepdim=True)
    is_top = torch.zeros_like(x, dtype=torch.bool).scatter(-1, top, True)
    m = x.gather(-1, top)
    finite_m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # an all -inf row
    others = torch.where(is_top, torch.full_like(x, -math.inf), x - finite_m)
    return m, is_top, others


def log_softmax(x):
    """log softmax over the last dim. The largest entry's log-probability is
    -log1p(sum of exp(others - max)), so it is never 1 - (something near 1) and its
    gradient is built from the small terms themselves."""
    _, is_top, others = _split_top(x)
    log_norm = torch.log1p(others.exp().sum(-1, keepdim=True))
    return torch.where(is_top, -log_norm, others - log_norm)


def logsumexp(x):
    """log sum exp over the last dim as max + log1p(rest): -inf for an all -inf row."""
    m, _, others = _split_top(x)
    return m + torch.log1p(others.exp().sum(-1, keepdim=True))


def head_logits(hidden, weight, head=None, vocab=None):
    """(N, vocab) float64 logits of an LM head restricted to its first `vocab` rows."""
    vocab = vocab or weight.shape[0]
    z = hidden.double() @ weight[:vocab].double().T
    if head is None:
        return z
    if head.bias is not None:
        z = z + head.bias[:vocab].double()
    z = z * head.scale
    if head.softcap is not None:
        z = head.softcap * torch.tanh(z / head.softcap)
    return z


def _plog(a, log_a, log_b):
    """sum_c a_c (log a_c - log b_c) with 0 log 0 = 0 (a teacher's zeros are common).
    Where a_c = 0 the logs are replaced before the product, so that no 0 * inf enters the
    forward or the gradient."""
    live = a > 0
    zero = torch.zeros_like(a)
    diff = torch.where(live, log_a, zero) - torch.where(live, log_b, zero)
    return torch.where(live, a * diff, zero).sum(-1)


def divergence(logp, logq, kind, beta=0.5):
    """Per-row divergence between teacher log-probs logp and student log-probs logq."""
    p, q = logp.exp(), logq.exp()
    if kind == "forward_kl":
        return _plog(p, logp, logq)
    if kind == "reverse_kl":
        return _plog(q, logq, logp)
    if kind != "jsd":
        raise ValueError(f"unknown kind {kind!r}")
    logm = torch.logaddexp(logp + math.log(beta), logq + math.log(1 - beta))
    return beta * _plog(p, logp, logm) + (1 - beta) * _plog(q, logq, logm)


def cached_categories(a, ids, logprobs, mode, kind):
    """(teacher, student) log-probs over the categories of cached top-k targets, from the
    student's tempered logits `a` (n, V).

    'tail': the K ids plus a bucket for everything else (teacher: 1 - sum of its K
    probabilities, floored at TAIL_FLOOR for reverse KL; student: its mass outside the K
    ids); with K = V there is nothing else and no bucket. 'renormalize': both sides over
    the K ids alone, each rescaled to sum to one.
    """
    logp_k = logprobs.double()
    if mode == "renormalize":
        # q_k / sum_K q is the softmax of the K logits: the other logits drop out exactly
        # (their gradient is an exact zero, not rounding noise)
        return log_softmax(logp_k), log_softmax(a.gather(-1, ids))
    if mode != "tail":
        raise ValueError(f"unknown sparse mode {mode!r}")
    logq = log_softmax(a)
    logq_k = logq.gather(-1, ids)
    if ids.shape[-1] == logq.shape[-1]:
        return logp_k, logq_k
    in_k = torch.zeros_like(logq, dtype=torch.bool).scatter(-1, ids, True)
    logq_tail = logsumexp(logq.masked_fill(in_k, -math.inf))  # log of the mass outside
    # 1 - sum p_k as -expm1(log sum p_k): exact when the leftover is tiny; a top-k that
    # sums past one (rounded fp16 log-probs) leaves no mass
    p_tail = (-torch.expm1(logsumexp(logp_k))).clamp_min(0.0)
    if kind == "reverse_kl":
        p_tail = p_tail.clamp_min(TAIL_FLOOR)
    return torch.cat([logp_k, p_tail.log()], -1), torch.cat([logq_k, logq_tail], -1)


def oracle_per_token(zs, zt=None, *, target_ids=None, target_logprobs=None, labels=None,
                     kind="reverse_kl", beta=0.5, temperature=1.0, temperature_squared=False,
                     divergence_weight=1.0, ce_weight=0.0, sparse_mode="tail"):
    """(divergence term, cross-entropy) per row of the logits zs (n, V): the divergence
    term already multiplied by divergence_weight (and T**2); the CE unweighted (zero
    without labels). Every row given is a trained one."""
    t = temperature
    if zt is not None:  # a live teacher is tempered like the student
        logp, logq = log_softmax(zt / t), log_softmax(zs / t)
    else:  # cached log-probs are already at the training temperature
        logp, logq = cached_categories(zs / t, target_ids, target_logprobs, sparse_mode, kind)
    factor = divergence_weight * (t * t if temperature_squared else 1.0)
    div = factor * divergence(logp, logq, kind, beta)
    if labels is None:
        return div, torch.zeros_like(div)
    ce = -log_softmax(zs).gather(-1, labels[:, None]).squeeze(-1)  # untempered logits
    return div, ce


def oracle_loss(student_hidden, student_weight, *, teacher_hidden=None, teacher_weight=None,
                target_ids=None, target_logprobs=None, labels=None, weights=None,
                kind="reverse_kl", beta=0.5, temperature=1.0, ce_weight=0.0,
                ignore_index=-100, temperature_squared=False, sparse_mode="tail",
                divergence_weight=1.0, vocab_size=None, student_head=None,
                teacher_head=None, return_components=False):
    """sum_i w_i (divergence term_i + ce_weight * ce_i) over the trained positions, float64.

    Trained: label != ignore_index (every position without labels). w defaults to
    1 / (number of trained positions). Components: {'divergence': sum_i w_i * divergence
    term_i, 'ce': sum_i w_i * ce_i}, so loss = divergence + ce_weight * ce.
    """
    n = student_hidden.shape[0]
    trained = torch.ones(n, dtype=torch.bool)
    if labels is not None:
        trained = labels.cpu() != ignore_index
    rows = trained.nonzero().squeeze(-1).to(student_hidden.device)
    if weights is None:
        w = torch.full((len(rows),), 1.0 / max(len(rows), 1), dtype=torch.float64)
    else:
        w = weights.double()[rows]
    w = w.to(student_hidden.device)
    # only the trained rows are projected: the others get an exact zero gradient
    zs = head_logits(student_hidden[rows], student_weight, student_head, vocab_size)
    zt = None
    if teacher_hidden is not None:
        zt = head_logits(teacher_hidden[rows], teacher_weight, teacher_head, zs.shape[-1])
    div, ce = oracle_per_token(
        zs, zt, target_ids=None if target_ids is None else target_ids[rows].long(),
        target_logprobs=None if target_logprobs is None else target_logprobs[rows],
        labels=None if labels is None else labels[rows].long(), kind=kind, beta=beta,
        temperature=temperature, temperature_squared=temperature_squared,
        divergence_weight=divergence_weight, ce_weight=ce_weight, sparse_mode=sparse_mode)
    div_sum, ce_sum = (w * div).sum(), (w * ce).sum()
    loss = div_sum + ce_weight * ce_sum
    if return_components:
        return loss, {"divergence": div_sum.detach(), "ce": ce_sum.detach()}
    return loss


def assert_rows_close(got, want, rtol, atol=0.0, name="tensor", scale=None):
    """Each row of `got` within rtol * (its row's scale) + atol of `want`, in 2-norm: a row
    of tiny gradients is held to its own size, not hidden in the norm of the whole matrix.

    The scale of a row is the norm of its row of `want` unless `scale` (one value per row)
    is given, e.g. the norm of the sum of the magnitudes of the terms a gradient row sums
    (a sum whose terms cancel is only as accurate as its largest terms). A 1-D tensor is
    compared entry by entry.
    """
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    assert torch.isfinite(g).all(), f"{name}: non-finite entries"
    if g.dim() == 1:
        g, w = g[:, None], w[:, None]
    g, w = g.reshape(g.shape[0], -1), w.reshape(w.shape[0], -1)
    err = (g - w).norm(dim=1)
    scale = w.norm(dim=1) if scale is None else scale.detach().double().cpu().reshape(-1)
    bad = err > rtol * scale + atol
    if bad.any():
        idx = bad.nonzero().flatten()
        worst = idx[(err[idx] / (rtol * scale[idx] + atol)).argmax()].item()
        raise AssertionError(
            f"{name}: {len(idx)} of {len(bad)} rows off (rtol={rtol}, atol={atol}); worst "
            f"row {worst}: error {err[worst].item():.3e}, its scale {scale[worst].item():.3e}, "
            f"its norm {w[worst].norm().item():.3e}; rows {idx[:10].tolist()}")
