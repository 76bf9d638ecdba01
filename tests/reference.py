"""Plain-PyTorch divergences on full logits: the test oracle, never a production path.

Everything here builds the whole (N, V) logits and lets autograd find the gradients, so
it is slow and memory-hungry on purpose: it is written to be obviously right. Tests run
it in float64 and compare the fused op against it. Its softmax is written so that float64
stays exact (relative to each gradient entry) even for logits tens of units apart.
"""

from __future__ import annotations

import math

import torch

from distill.constants import IGNORE_INDEX
from distill.ops.spec import TAIL_FLOOR, DivergenceSpec, HeadTransform


def apply_head(hidden, weight, head: HeadTransform | None):
    """Logits of an LM head: (hidden @ weight.T + bias) * scale, then optional soft-capping."""
    logits = hidden @ weight.T
    head = head or HeadTransform()
    if head.bias is not None:
        logits = logits + head.bias.to(logits.dtype)
    logits = logits * head.scale
    if head.softcap is not None:
        logits = head.softcap * torch.tanh(logits / head.softcap)
    return logits


def _rest(x, dim=-1):
    """(max, one-hot of the argmax, sum over the others of exp(x - max)) along `dim`."""
    m, i = x.max(dim, keepdim=True)  # max's gradient flows to the argmax
    is_max = torch.zeros_like(x, dtype=torch.bool).scatter_(dim, i, True)
    safe = torch.where(is_max | (m == -math.inf), -math.inf, x - m)
    return m, is_max, safe.exp().sum(dim, keepdim=True)


def stable_logsumexp(x, dim=-1):
    """logsumexp whose normalizer is max + log1p(rest), never log(1 + tiny) = 0: exact to
    float64 rounding however dominant the largest entry (logits 60 apart)."""
    m, _, rest = _rest(x, dim)
    return m + torch.log1p(rest)


def stable_log_softmax(x, dim=-1):
    """log_softmax that autograd differentiates without cancellation at the argmax.

    torch.log_softmax's backward forms grad_* - q_* * sum(grad) at the argmax *, whose true
    value (~exp(-gap)) is lost below float64's rounding of sum(grad) from gaps of ~37 on.
    Here the argmax's log-prob is -log1p(rest) alone, so its gradient is a sum of the small
    terms themselves.
    """
    m, is_max, rest = _rest(x, dim)
    lr = torch.log1p(rest)
    return torch.where(is_max, -lr, x - m - lr)


def _xlogy_diff(p, logp, logr):
    """sum p * (log p - log r), with 0 * anything = 0 (teacher zeros are common)."""
    return torch.where(p > 0, p * (logp - logr), torch.zeros_like(p)).sum(-1)


def divergence_from_logprobs(logp, logq, spec: DivergenceSpec):
    """Per-row divergence between teacher log-probs `logp` and student log-probs `logq`."""
    p, q = logp.exp(), logq.exp()
    if spec.kind == "forward_kl":
        return _xlogy_diff(p, logp, logq)
    if spec.kind == "reverse_kl":
        return _xlogy_diff(q, logq, logp)
    beta = spec.beta
    logm = torch.logaddexp(logp + math.log(beta), logq + math.log(1 - beta))
    return beta * _xlogy_diff(p, logp, logm) + (1 - beta) * _xlogy_diff(q, logq, logm)


def sparse_logprobs(student_logits_t, target_ids, target_logprobs, spec: DivergenceSpec):
    """Teacher and student log-probs over the K cached ids (+ a tail bucket in 'tail' mode)."""
    logq_full = stable_log_softmax(student_logits_t, dim=-1)
    logq_k = logq_full.gather(-1, target_ids)
    logp_k = target_logprobs.to(logq_full.dtype)
    if spec.sparse_mode == "renormalize":
        return stable_log_softmax(logp_k), stable_log_softmax(logq_k)
    in_topk = torch.zeros_like(logq_full, dtype=torch.bool).scatter_(-1, target_ids, True)
    # the tail's log-mass directly, never log(1 - sum q_k): that cancels for a confident
    # student; the teacher's 1 - sum p_k as -expm1(log sum p_k), exact when it is tiny
    logq_tail = stable_logsumexp(logq_full.masked_fill(in_topk, -math.inf))
    p_tail = (-torch.expm1(stable_logsumexp(logp_k))).clamp_min(0)
    if target_ids.shape[-1] == logq_full.shape[-1]:
        p_tail = torch.zeros_like(p_tail)  # K = V: no tail, only rounding noise
    if spec.kind == "reverse_kl":
        p_tail = p_tail.clamp_min(TAIL_FLOOR)
    logp = torch.cat([logp_k, p_tail.log()], dim=-1)
    logq = torch.cat([logq_k, logq_tail], dim=-1)
    return logp, logq


def reference_per_token_loss(
    student_logits,
    teacher_logits=None,
    *,
    target_ids=None,
    target_logprobs=None,
    labels=None,
    spec: DivergenceSpec,
):
    """Per-position loss (N,) from full logits; positions with ignored labels give 0."""
    t = spec.temperature
    st = student_logits / t
    if teacher_logits is not None:
        logp = stable_log_softmax(teacher_logits / t, dim=-1)
        logq = stable_log_softmax(st, dim=-1)
    else:
        logp, logq = sparse_logprobs(st, target_ids, target_logprobs, spec)
    loss = divergence_from_logprobs(logp, logq, spec)
    loss = loss * spec.divergence_factor
    if spec.ce_weight:
        safe = labels.clamp_min(0)
        ce = -stable_log_softmax(student_logits).gather(-1, safe[:, None]).squeeze(-1)
        loss = loss + spec.ce_weight * ce
    if labels is not None:
        loss = torch.where(labels != IGNORE_INDEX, loss, torch.zeros_like(loss))
    return loss


def reference_linear_divergence(
    student_hidden,
    student_weight,
    *,
    teacher_hidden=None,
    teacher_weight=None,
    target_ids=None,
    target_logprobs=None,
    labels=None,
    weights=None,
    spec: DivergenceSpec,
    vocab_size=None,
    student_head: HeadTransform | None = None,
    teacher_head: HeadTransform | None = None,
):
    """sum_i w_i loss_i on full logits (w defaults to 1 / number of trained positions)."""
    v = vocab_size or student_weight.shape[0]
    zs = apply_head(student_hidden, student_weight[:v], student_head)
    zt = None
    if teacher_hidden is not None:
        zt = apply_head(teacher_hidden, teacher_weight[:v], teacher_head)
    per_token = reference_per_token_loss(
        zs, zt, target_ids=target_ids, target_logprobs=target_logprobs, labels=labels, spec=spec
    )
    if weights is None:
        trained = (labels != IGNORE_INDEX) if labels is not None else None
        count = trained.sum() if trained is not None else per_token.new_tensor(len(per_token))
        weights = per_token.new_ones(per_token.shape) / count.clamp_min(1)
    return (weights.to(per_token.dtype) * per_token).sum()
