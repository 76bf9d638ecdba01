"""The cross-tokenizer losses written plainly, as the test oracle (float64, autograd).

Full logits, a Python loop over spans, every span distribution built as an explicit list
of atoms, empty atoms left out. It shares nothing with distill: the divergences over the
categories are the test oracle's (tests/oracle.py), which imports nothing of the package.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from tests.oracle import TAIL_FLOOR, divergence


def span_atoms(logprobs, rows, tokens):
    """{atom: log mass} of one side's span distribution. logprobs (N, V) full log-probs;
    rows: the rows of the span, tokens: the token each predicts."""
    first, tok = logprobs[rows[0]], tokens[0]
    rest_of_span = sum((logprobs[r, y] for r, y in zip(rows[1:], tokens[1:])),
                       start=torch.zeros((), dtype=logprobs.dtype))
    atoms = {("tok", v): first[v] for v in range(len(first)) if v != tok}
    atoms["A"] = first[tok] + rest_of_span
    if len(rows) > 1:
        atoms["D"] = first[tok] + torch.log(-torch.expm1(rest_of_span))
    return atoms


def _sorted_l1(a: list, b: list):
    qa = torch.stack(a).exp().sort(descending=True).values if a else torch.zeros(0)
    qb = torch.stack(b).exp().sort(descending=True).values if b else torch.zeros(0)
    n = max(len(qa), len(qb))
    qa = torch.cat([qa, qa.new_zeros(n - len(qa))])
    qb = torch.cat([qb.to(qa.dtype), qa.new_zeros(n - len(qb))])
    return (qa - qb).abs().sum()


def uld(s_atoms: dict, t_atoms: dict):
    return _sorted_l1(list(s_atoms.values()), list(t_atoms.values()))


def hybrid(s_atoms: dict, t_atoms: dict, pairs, s_first, t_first, spec, uld_weight):
    """Exact divergence over (live pairs, A, rest) + ULD over the rest's atoms."""
    live = [(v, u) for v, u in pairs if v != s_first and u != t_first]
    s_paired = {("tok", v) for v, _ in live}
    t_paired = {("tok", u) for _, u in live}
    s_rest = [x for k, x in s_atoms.items() if k != "A" and k not in s_paired]
    t_rest = [x for k, x in t_atoms.items() if k != "A" and k not in t_paired]
    lq = [s_atoms[("tok", v)] for v, _ in live] + [s_atoms["A"]]
    lp = [t_atoms[("tok", u)] for _, u in live] + [t_atoms["A"]]
    if s_rest or t_rest:
        assert s_rest and t_rest, "the oracle needs both rests non-empty, or both empty"
        lq.append(torch.logsumexp(torch.stack(s_rest), 0))
        tail = torch.logsumexp(torch.stack(t_rest), 0)
        if spec.kind == "reverse_kl":
            tail = tail.clamp_min(math.log(TAIL_FLOOR))
        lp.append(tail)
    div = divergence(torch.stack(lp), torch.stack(lq), spec.kind, spec.beta)
    return div + uld_weight * _sorted_l1(s_rest, t_rest)


def reference_loss(student_hidden, student_weight, teacher_logprobs, *, spans, labels,
                   teacher_targets, weights=None, mode="hybrid", pairs=(), kind="reverse_kl",
                   beta=0.5, temperature=1.0, ce_weight=0.0, ignore_index=-100,
                   temperature_squared=False, divergence_weight=1.0, uld_weight=1.0,
                   vocab=None):
    """sum over spans of omega_j L_j + ce_weight sum_i w_i CE_i; teacher_logprobs (Nt, Vt)
    at the temperature already."""
    t2 = temperature**2 if temperature_squared else 1.0
    spec = SimpleNamespace(kind=kind, beta=beta, divergence_factor=t2 * divergence_weight)
    v = vocab or student_weight.shape[0]
    z = student_hidden @ student_weight[:v].T
    logq = torch.log_softmax(z / temperature, -1)
    trained = labels != ignore_index
    w = trained.double() / trained.sum() if weights is None else weights.double() * trained
    total = torch.zeros((), dtype=torch.float64)
    for s_lo, s_hi, t_lo, t_hi in spans.tolist():
        rows = list(range(s_lo, s_hi))
        if not all(bool(trained[r]) and float(w[r]) != 0 for r in rows):
            continue
        s_tok = [int(labels[r]) for r in rows]
        t_rows = list(range(t_lo, t_hi))
        t_tok = [int(teacher_targets[r]) for r in t_rows]
        sa = span_atoms(logq, rows, s_tok)
        ta = span_atoms(teacher_logprobs, t_rows, t_tok)
        if mode == "uld":
            loss = uld(sa, ta)
        else:
            loss = hybrid(sa, ta, pairs, s_tok[0], t_tok[0], spec, uld_weight)
        total = total + w[rows].mean() * loss * spec.divergence_factor
    if ce_weight:
        ce = -torch.log_softmax(z, -1).gather(1, labels.clamp_min(0)[:, None]).squeeze(1)
        total = total + ce_weight * (w * torch.where(trained, ce, 0.0)).sum()
    return total
