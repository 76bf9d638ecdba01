"""The chunked cross-tokenizer op: hidden states + LM heads -> loss and gradients.

Three kinds of student rows (flattened, shifted positions): a span's *first* row, whose full
distribution meets the teacher's (`span_math`); a span's *inner* rows, which enter the span's
loss only through the log-probability of their own next token (the span's C); and trained
rows outside any span, which carry the CE term alone. The passes:

    1. teacher inner rows (no grad): log p of the teacher's next token, summed per span
    2. student inner rows: log q of the next token summed per span (C), their logsumexp kept
    3. spans, in chunks: student and teacher logits of the first rows, the span loss, d loss
       / d first-row logits (folded into d hidden, d weight right away) and d loss / d C
    4. student inner rows again: d C / d logits = (onehot - softmax) / T, times d loss / d C
    5. trained rows outside spans: the CE term

Inner rows are projected twice (passes 2 and 4); in return no (rows x V) tensor outlives its
chunk. A chunk of spans holds about 48 B x Vs + 36 B x Vt per row (fp32 logits, log-probs,
atoms, the sorts' values and int64 indices, the gradient), a chunk of rows 8 B x V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distill.ops.chunked import chain_head, fold, project
from distill.ops.divergence_torch import log_softmax, logsumexp, zero_sum_at
from distill.ops.spec import DivergenceSpec, HeadTransform
from distill.xtok.span_math import span_rows

BUDGET_BYTES = {"cuda": 2 << 30, "cpu": 64 << 20}
_HALF = (torch.bfloat16, torch.float16)


@dataclass
class Plan:
    """Which rows do what, built once per call by `distill.xtok.loss` (all on the device)."""

    first_s: torch.Tensor  # (S,) student row of each span's first token
    first_t: torch.Tensor  # (S,) teacher row of it
    s_tok: torch.Tensor  # (S,) the student's first token of each span
    t_tok: torch.Tensor  # (S,) the teacher's
    omega: torch.Tensor  # (S,) fp32 span weight: the mean weight of its student tokens
    inner_s: torch.Tensor  # (Ni,) student inner rows
    inner_s_span: torch.Tensor  # (Ni,) their span
    inner_s_tok: torch.Tensor  # (Ni,) the token each predicts
    inner_t: torch.Tensor  # (Nj,) teacher inner rows
    inner_t_span: torch.Tensor  # (Nj,)
    ce_rows: torch.Tensor  # (Nu,) trained student rows in no span (CE only)
    weights: torch.Tensor  # (Ns,) fp32 per-row weights
    labels: torch.Tensor  # (Ns,) the student's labels


@dataclass
class TeacherSide:
    """The teacher for the op: live (hidden states and head) or cached (top-k + the
    log-probability of each row's own next token), rows of the teacher's flattened batch."""

    targets: torch.Tensor  # (Nt,) int64 the token each teacher row predicts
    vocab: int
    hidden: torch.Tensor | None = None  # (Nt, Ht)
    weight: torch.Tensor | None = None  # (Vt, Ht), already cut to the vocabulary
    head: HeadTransform | None = None
    topk_ids: torch.Tensor | None = None  # (Nt, K)
    topk_logprobs: torch.Tensor | None = None  # (Nt, K)
    target_logprobs: torch.Tensor | None = None  # (Nt,)

    @property
    def live(self) -> bool:
        return self.hidden is not None

    def logits(self, rows):
        z, _ = project(self.hidden[rows], self.weight, self.head,
                        torch.empty((len(rows), self.vocab), dtype=torch.float32,
                                    device=self.hidden.device))
        return z

    def row_logprobs(self, rows, t: float) -> torch.Tensor:
        """(c, Vt) log-probs at the training temperature. Cached: the top-k and the row's
        own token as stored, the remaining mass spread evenly over the other ids."""
        if self.live:
            return log_softmax(self.logits(rows) / t)
        ids, lp = self.topk_ids[rows].long(), self.topk_logprobs[rows].float()
        tok, tok_lp = self.targets[rows], self.target_logprobs[rows].float()
        c, r = len(rows), torch.arange(len(rows), device=ids.device)
        known = torch.zeros((c, self.vocab), dtype=torch.bool, device=ids.device)
        known.scatter_(1, ids, True)
        extra = ~known[r, tok]
        mass = logsumexp(torch.cat([lp, torch.where(extra, tok_lp, -torch.inf)[:, None]], -1))
        left = (-torch.expm1(mass.squeeze(-1))).clamp_min(0)
        count = (self.vocab - ids.shape[1] - extra.long()).clamp_min(1)
        fill = torch.log(left) - torch.log(count.float())
        out = fill[:, None].expand(c, self.vocab).clone().scatter_(1, ids, lp)
        out[r[extra], tok[extra]] = tok_lp[extra]
        return out

    def own_logprobs(self, rows, t: float, chunk: int) -> torch.Tensor:
        """(n,) log p of each row's own next token, at the training temperature."""
        if not self.live:
            return self.target_logprobs[rows].float()
        out = torch.empty(len(rows), dtype=torch.float32, device=rows.device)
        for lo in range(0, len(rows), chunk):
            r = rows[lo:lo + chunk]
            a = self.logits(r).div_(t)
            out[lo:lo + chunk] = a.gather(1, self.targets[r][:, None]).squeeze(1) - logsumexp(
                a).squeeze(1)
        return out


def chunk_sizes(vs: int, vt: int, pairs: int, device, chunk_size: int | None):
    """(rows per span chunk, rows per row chunk) within the device's budget."""
    if chunk_size:
        return chunk_size, chunk_size
    budget = BUDGET_BYTES["cuda" if device.type == "cuda" else "cpu"]
    span = max(1, budget // (48 * vs + 36 * vt + 20 * pairs))
    row = max(1, budget // (8 * max(vs, vt)))
    return span, row


class _Folder:
    """Folds d loss / d logits of gathered rows into d hidden, d weight (and d bias)."""

    def __init__(self, hs, ws, head, needs, fp32_weight_grad):
        need_h, need_w, need_b = needs
        self.hs, self.ws, self.head = hs, ws, head
        self.grad_h = torch.zeros_like(hs) if need_h else None
        wdtype = torch.float32 if (fp32_weight_grad or not hs.is_cuda) else ws.dtype
        self.grad_w = torch.zeros(ws.shape, dtype=wdtype, device=ws.device) if need_w else None
        has_bias = need_b and head is not None and head.bias is not None
        self.grad_b = (torch.zeros(ws.shape[0], dtype=torch.float32, device=ws.device)
                       if has_bias else None)
        # the GEMMs run in the operands' 16-bit dtype on CUDA, with fp32 accumulation
        self.cast = hs.is_cuda and ws.dtype in _HALF

    def __call__(self, dz, rows, us):
        dz = chain_head(dz, us, self.head)
        if self.grad_b is not None:
            self.grad_b += dz.sum(0)
        if self.cast:
            dz = dz.to(self.ws.dtype)
        gh = None
        if self.grad_h is not None:
            gh = torch.empty((len(rows), self.hs.shape[1]), dtype=self.hs.dtype,
                             device=self.hs.device)
        fold(dz.contiguous(), self.hs[rows], self.ws, gh, self.grad_w, first=False)
        if gh is not None:
            self.grad_h.index_copy_(0, rows, gh)

    @property
    def grads(self):
        return self.grad_h, self.grad_w, self.grad_b


def _ce(z, labels):
    """Cross-entropy of untempered logits (c,) and softmax(z) (for its gradient)."""
    lse = logsumexp(z)
    return (lse - z.gather(1, labels[:, None])).squeeze(1), torch.exp(z - lse)


def _minus_onehot(x, labels, scale):
    """x - scale * onehot(labels), in place."""
    return x.scatter_add_(1, labels[:, None], -scale[:, None].expand(-1, 1).to(x.dtype))


class _Run:
    """One call's state shared by the passes: the student side, the loss so far, the CE."""

    def __init__(self, hs, ws, plan: Plan, spec, student_head, fold, ce_sum):
        self.hs, self.ws, self.plan, self.spec, self.head = hs, ws, plan, spec, student_head
        self.fold, self.ce_sum = fold, ce_sum
        self.want_ce = bool(spec.ce_weight) or ce_sum is not None
        self.loss = torch.zeros((), dtype=torch.float32, device=hs.device)

    def project(self, rows):
        """fp32 student logits (c, Vs) of some rows, and the soft-cap's tanh or None."""
        z = torch.empty((len(rows), self.ws.shape[0]), dtype=torch.float32,
                        device=self.hs.device)
        return project(self.hs[rows], self.ws, self.head, z)

    def add_ce(self, ce, rows):
        w = self.plan.weights[rows]
        if self.spec.ce_weight:
            self.loss = self.loss + self.spec.ce_weight * (ce @ w)
        if self.ce_sum is not None:
            self.ce_sum.add_(ce @ w)

    def ce_grad(self, soft, labels, rows):
        """ce_weight * w * (softmax(z) - onehot), written over `soft`."""
        wc = self.plan.weights[rows] * self.spec.ce_weight
        return _minus_onehot(soft.mul_(wc[:, None]), labels, wc)

    def fold_rows(self, dz, z, rows, us):
        # the largest logit's entry last, from all the others (every row sums to zero)
        self.fold(zero_sum_at(dz, z.argmax(-1, keepdim=True)), rows, us)


def _inner_pass(run: _Run, chunk: int):
    """Pass 2: C of each span on the student side, and the inner rows' logsumexp at T."""
    plan, t = run.plan, run.spec.temperature
    cs = torch.zeros(len(plan.first_s), dtype=torch.float32, device=run.hs.device)
    lse_t = torch.empty(len(plan.inner_s), dtype=torch.float32, device=run.hs.device)
    for lo in range(0, len(plan.inner_s), chunk):
        sl = slice(lo, lo + chunk)
        rows, tok = plan.inner_s[sl], plan.inner_s_tok[sl]
        z, _ = run.project(rows)
        lse_t[sl] = logsumexp(z / t).squeeze(1)
        cs.index_add_(0, plan.inner_s_span[sl],
                      z.gather(1, tok[:, None]).squeeze(1) / t - lse_t[sl])
        if run.want_ce:
            run.add_ce(_ce(z, tok)[0], rows)
    return cs, lse_t


def _span_pass(run: _Run, teacher: TeacherSide, cs, ct, mode, tables, uld_weight, chunk,
               need_grad):
    """Pass 3: the spans' loss; d first-row logits folded; returns d loss / d C (S,)."""
    plan, spec = run.plan, run.spec
    dcs = torch.zeros(len(plan.first_s), dtype=torch.float32, device=run.hs.device)
    for lo in range(0, len(plan.first_s), chunk):
        sl = slice(lo, lo + chunk)
        rows, tok = plan.first_s[sl], plan.s_tok[sl]
        z, us = run.project(rows)
        logp = teacher.row_logprobs(plan.first_t[sl], spec.temperature)
        span_loss, dz, dc = span_rows(z, logp, tok, plan.t_tok[sl], cs[sl], ct[sl], spec,
                                      mode, tables, uld_weight, need_grad)
        del logp
        om = plan.omega[sl]
        run.loss = run.loss + span_loss @ om
        if run.want_ce:
            ce, soft = _ce(z, tok)
            run.add_ce(ce, rows)
        if not need_grad:
            continue
        dcs[sl] = dc * om
        dz = dz * om[:, None]
        if spec.ce_weight:
            dz += run.ce_grad(soft, tok, rows)
        run.fold_rows(dz, z, rows, us)
    return dcs


def _inner_grad_pass(run: _Run, dcs, lse_t, chunk: int):
    """Pass 4: each inner row's part of its span's gradient, d C / d z = (onehot - q) / T."""
    plan, t = run.plan, run.spec.temperature
    for lo in range(0, len(plan.inner_s), chunk):
        sl = slice(lo, lo + chunk)
        rows, tok = plan.inner_s[sl], plan.inner_s_tok[sl]
        z, us = run.project(rows)
        g = dcs[plan.inner_s_span[sl]] / t
        dz = torch.exp(z / t - lse_t[sl][:, None]).mul_(-g[:, None])
        dz.scatter_add_(1, tok[:, None], g[:, None])
        if run.spec.ce_weight:
            dz += run.ce_grad(_ce(z, tok)[1], tok, rows)
        run.fold_rows(dz, z, rows, us)


def _ce_pass(run: _Run, chunk: int, need_grad: bool):
    """Pass 5: trained rows in no span carry the CE term alone."""
    plan = run.plan
    for lo in range(0, len(plan.ce_rows), chunk):
        rows = plan.ce_rows[lo:lo + chunk]
        lab = plan.labels[rows]
        z, us = run.project(rows)
        ce, soft = _ce(z, lab)
        run.add_ce(ce, rows)
        if need_grad and run.spec.ce_weight:
            run.fold_rows(run.ce_grad(soft, lab, rows), z, rows, us)


def xtok_rows(hs, ws, teacher: TeacherSide, plan: Plan, spec: DivergenceSpec, mode: str,
              tables, uld_weight: float, *, need_grad: bool, needs=(True, True, True),
              chunk_size=None, fp32_weight_grad=True, student_head=None, ce_sum=None):
    """Loss sum_i w_i loss_i and (grad_hidden, grad_weight, grad_bias); see the module
    docstring for the passes. `ce_sum` (0-dim fp32) receives sum_i w_i ce_i when given."""
    pairs = len(tables.student_ids) if tables is not None else 0
    span_chunk, row_chunk = chunk_sizes(ws.shape[0], teacher.vocab, pairs, hs.device,
                                        chunk_size)
    fold = _Folder(hs, ws, student_head, needs, fp32_weight_grad) if need_grad else None
    run = _Run(hs, ws, plan, spec, student_head, fold, ce_sum)
    # 1. teacher inner rows: the rest of each span's log-probability on the teacher side
    ct = torch.zeros(len(plan.first_s), dtype=torch.float32, device=hs.device)
    ct.index_add_(0, plan.inner_t_span,
                  teacher.own_logprobs(plan.inner_t, spec.temperature, row_chunk))
    cs, lse_t = _inner_pass(run, row_chunk)
    dcs = _span_pass(run, teacher, cs, ct, mode, tables, uld_weight, span_chunk, need_grad)
    if need_grad:
        _inner_grad_pass(run, dcs, lse_t, row_chunk)
    if run.want_ce:
        _ce_pass(run, row_chunk, need_grad)
    return run.loss, (fold.grads if fold is not None else (None, None, None))
