"""The per-span loss of cross-tokenizer distillation and its gradient, in closed form.

A span is a stretch of text that both tokenizations cover with whole tokens (see
`distill.xtok.align`). Take the student side: at its first token's position the student has
a distribution q over its vocabulary; the span's text is its first token s_1 followed by the
rest s_2..s_n, whose conditional log-probabilities sum to C = sum_k log q_k(s_k) (0 for a
one-token span). The student's *span distribution* refines q at s_1 by whether the rest of
the span follows:

    atoms  v != s_1 : q(v)                     another first token
           A        : q(s_1) e^C               the span's text (its sequence probability)
           D        : q(s_1) (1 - e^C)         starts like the span, then departs from it

These atoms sum to one, and they are a softmax over "atom logits" (z_v / T; z_s1 / T + C;
z_s1 / T + log(1 - e^C)) with the row's own normalizer. The teacher's span distribution is
built the same way from its own tokens. For a one-token span D is empty and the span
distribution is q itself.

- `uld`: sum_r |sort(Q)_r - sort(P)_r| over the two span distributions (ULD: the
  Wasserstein distance under a uniform cost is the L1 distance of the sorted vectors), the
  shorter zero-padded.
- `hybrid`: the categories are the pairs of the vocabulary map (tokens that are the same
  text in both vocabularies), the span text A (the same text on both sides by construction)
  and one *rest* bucket holding every other atom. The package's divergence (forward_kl /
  reverse_kl / jsd) is taken over these categories exactly, and ULD over the rest's atoms
  stands in for the divergence inside the rest, which has no correspondence (by the chain
  rule KL(P || Q) = KL over the categories + P(rest) KL(P|rest || Q|rest)). A pair whose
  student token is s_1, or whose teacher token is t_1, is taken out of the pairs for that
  span (those tokens are A and D now) and its other token goes to its side's rest. With
  identical tokenizers every span is one token on both sides, every token is a pair, the
  rest is empty and the hybrid is the same-vocabulary divergence exactly. Only the rest's
  columns (the unpaired tokens, plus two per span) are sorted.

Cost of the sorts (per chunk of c spans): `uld` sorts c x (Vs + 1) and c x (Vt + 1) fp32
values; torch.sort also returns int64 indices, so 12 B per entry and side are live at
once, and the time is that of a segmented radix sort, O(V) passes over memory per row
(it dominates the GEMMs of a small student's head). `hybrid` sorts only c x (Rs + 2) and
c x (Rt + 2), R the unpaired part of each vocabulary.

Gradients: with a the atom logits and Q = softmax(a), a loss term f(Q) gives
d f / d a = Q * (G - <Q, G>), G = d f / d Q; the divergence over categories uses the
package's category gradient (`divergence_torch._category_grad`, which writes forward KL
as q - p), shared among a category's atoms in proportion to their mass. Back to the
student: d z_v = d a_v / T (v != s_1), d z_s1 = (d a_A + d a_D) / T, and since raising C
moves mass from D to A, d C = A (G_A - G_D); for the divergence part this is
d a_A - (A / Q_rest) d a_rest. Everything is fp32 and nothing here is autograd.
"""

from __future__ import annotations

import math

import torch

from distill.ops.divergence_torch import category_grad, divergence_and_g, log_softmax
from distill.ops.spec import TAIL_FLOOR, DivergenceSpec

NEG_INF = -math.inf


def log1mexp(c: torch.Tensor) -> torch.Tensor:
    """log(1 - e^c) for c <= 0, accurate at both ends; -inf at c = 0."""
    near = torch.log(-torch.expm1(c.clamp_max(0)))
    far = torch.log1p(-torch.exp(c.clamp_max(-math.log(2))))
    return torch.where(c > -math.log(2), near, far)


def atom_logprobs(logq: torch.Tensor, first: torch.Tensor, cont: torch.Tensor):
    """(log of the atoms over the vocabulary, with A at column `first`) and log D, per row.

    logq (c, V) log-probs at the span's first position, first (c,) its first token,
    cont (c,) C: the rest of the span's log-probability."""
    rows = torch.arange(len(first), device=logq.device)
    l_first = logq[rows, first]
    atoms = logq.clone()
    atoms[rows, first] = l_first + cont
    return atoms, l_first + log1mexp(cont)


def sorted_l1(qs: torch.Tensor, pt: torch.Tensor, need_grad: bool):
    """sum_r |sort(qs)_r - sort(pt)_r| per row (zero-padded), and d / d qs (its sign, in
    qs's order). Costs one sort of each side: O(V log V) time, and values plus int64
    indices (12 B an entry) per side."""
    width = max(qs.shape[1], pt.shape[1])
    sq, order = qs.sort(-1, descending=True)
    sp = pt.sort(-1, descending=True).values
    sq = torch.nn.functional.pad(sq, (0, width - sq.shape[1]))
    sp = torch.nn.functional.pad(sp, (0, width - sp.shape[1]))
    diff = sq - sp
    loss = diff.abs().sum(-1)
    if not need_grad:
        return loss, None
    del sq, sp
    sign = diff[:, :qs.shape[1]].sign_()
    return loss, torch.empty_like(qs).scatter_(-1, order, sign)


def _softmax_grad(mass: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """d f / d a = Q * (G - <Q, G>) for Q = softmax(a)."""
    return mass * (g - (mass * g).sum(-1, keepdim=True))


def _to_student(da: torch.Tensor, da_d: torch.Tensor, first: torch.Tensor, t: float):
    """Atom-logit gradients (c, V) + the D column (c,) -> d loss / d student logits."""
    rows = torch.arange(len(first), device=da.device)
    da[rows, first] += da_d
    return da.div_(t)


def uld_span(logq, logp, s_first, t_first, cs, ct, t: float, need_grad: bool):
    """ULD of the two span distributions: loss (c,), d / d student logits, d / d C."""
    a_s, d_s = atom_logprobs(logq, s_first, cs)
    a_t, d_t = atom_logprobs(logp, t_first, ct)
    q = torch.cat([a_s, d_s[:, None]], -1).exp_()  # (c, Vs + 1)
    p = torch.cat([a_t, d_t[:, None]], -1).exp_()
    loss, g = sorted_l1(q, p, need_grad)
    if not need_grad:
        return loss, None, None
    rows = torch.arange(len(s_first), device=q.device)
    big_a = q[rows, s_first]
    dcont = big_a * (g[rows, s_first] - g[:, -1])
    da = _softmax_grad(q, g)
    return loss, _to_student(da[:, :-1], da[:, -1], s_first, t), dcont


def _rest(atoms, d, unpaired, first, moved):
    """The rest bucket's atoms of one side, (c, R + 2): the unpaired tokens (less the span's
    own first token: it is A and D), the paired token whose partner is the other side's
    first token (or nothing), and D. Only these columns are sorted for ULD."""
    rows = torch.arange(len(first), device=atoms.device)
    block = atoms[:, unpaired].masked_fill_(unpaired[None, :] == first[:, None], NEG_INF)
    moved_lp = torch.where(moved >= 0, atoms[rows, moved.clamp_min(0)], NEG_INF)
    return torch.cat([block, moved_lp[:, None], d[:, None]], -1)


def _rest_to_atoms(x, unpaired, moved, vocab):
    """Scatter rest-bucket columns (c, R + 2) back to atom columns (c, V + 1)."""
    c, rows = x.shape[0], torch.arange(x.shape[0], device=x.device)
    out = torch.zeros((c, vocab + 1), dtype=x.dtype, device=x.device)
    out[:, unpaired] = x[:, :len(unpaired)]
    has = moved >= 0
    out[rows[has], moved[has]] += x[has, -2]
    out[:, -1] = x[:, -1]
    return out


def hybrid_span(logq, logp, s_first, t_first, cs, ct, tables, spec: DivergenceSpec,
                uld_weight: float, need_grad: bool):
    """Exact divergence over (pairs, A, rest) + uld_weight * ULD inside the rest."""
    ms, mt = tables.student_ids, tables.teacher_ids
    t, vs = spec.temperature, logq.shape[1]
    c, rows = len(s_first), torch.arange(len(s_first), device=logq.device)
    ps, pt = tables.pair_of_student[s_first], tables.pair_of_teacher[t_first]
    a_s, d_s = atom_logprobs(logq, s_first, cs)
    a_t, d_t = atom_logprobs(logp, t_first, ct)
    # the pairs that hold s_1 or t_1 leave the matched categories for this span, and the
    # other token of such a pair joins its side's rest
    drop = torch.zeros((c, len(ms)), dtype=torch.bool, device=logq.device)
    for p_idx in (ps, pt):
        drop[rows[p_idx >= 0], p_idx[p_idx >= 0]] = True
    moved_s = torch.where((pt >= 0) & (ps != pt), ms[pt.clamp_min(0)], -1)
    moved_t = torch.where((ps >= 0) & (ps != pt), mt[ps.clamp_min(0)], -1)
    lr_s = _rest(a_s, d_s, tables.unpaired_student, s_first, moved_s)  # (c, Rs + 2)
    lr_t = _rest(a_t, d_t, tables.unpaired_teacher, t_first, moved_t)
    tail_s, tail_t = torch.logsumexp(lr_s, -1), torch.logsumexp(lr_t, -1)
    if spec.kind == "reverse_kl":  # else a rest the teacher leaves empty is infinite
        tail_t = tail_t.clamp_min(math.log(TAIL_FLOOR))
    log_a = a_s[rows, s_first]
    cat_s = torch.cat([logq[:, ms].masked_fill_(drop, NEG_INF), log_a[:, None],
                       tail_s[:, None]], -1)  # (c, M + 2)
    cat_t = torch.cat([logp[:, mt].masked_fill_(drop, NEG_INF), a_t[rows, t_first, None],
                       tail_t[:, None]], -1)
    div, g_div = divergence_and_g(cat_t, cat_s, spec)
    uld, g_uld = sorted_l1(lr_s.exp(), lr_t.exp(), need_grad)
    loss = div + uld_weight * uld
    if not need_grad:
        return loss, None, None
    m = len(ms)
    da_cat = category_grad(cat_t, cat_s, g_div)  # (c, M + 2)
    has_rest = tail_s[:, None] > NEG_INF
    share = torch.where(has_rest, torch.exp(lr_s - tail_s[:, None]), 0.0)
    da = _rest_to_atoms(share * da_cat[:, m + 1:], tables.unpaired_student, moved_s, vs)
    da[:, ms] += da_cat[:, :m]
    da[rows, s_first] += da_cat[:, m]
    ratio = torch.where(has_rest[:, 0], torch.exp(log_a - tail_s), 0.0)  # A / Q_rest
    dcont = da_cat[:, m] - ratio * da_cat[:, -1]
    if uld_weight:
        g = _rest_to_atoms(g_uld * (lr_s > NEG_INF), tables.unpaired_student, moved_s, vs)
        da += uld_weight * _softmax_grad(torch.cat([a_s, d_s[:, None]], -1).exp_(), g)
        dcont -= uld_weight * log_a.exp() * g[:, -1]
    return loss, _to_student(da[:, :-1], da[:, -1], s_first, t), dcont


def span_rows(zs, logp, s_first, t_first, cs, ct, spec: DivergenceSpec, mode: str, tables,
              uld_weight: float, need_grad: bool):
    """Loss (c,) of a chunk of spans (divergence factor included), d loss / d zs (c, Vs)
    and d loss / d C (c,). zs: the student's logits at the spans' first positions, logp
    (c, Vt) the teacher's log-probs there (at the training temperature)."""
    logq = log_softmax(zs / spec.temperature)
    if mode == "uld":
        loss, dz, dcont = uld_span(logq, logp, s_first, t_first, cs, ct, spec.temperature,
                                   need_grad)
    else:
        loss, dz, dcont = hybrid_span(logq, logp, s_first, t_first, cs, ct, tables, spec,
                                      uld_weight, need_grad)
    factor = spec.divergence_factor
    if not need_grad:
        return loss * factor, None, None
    return loss * factor, dz * factor, dcont * factor
