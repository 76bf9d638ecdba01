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

from distill.losses.spec import DivergenceSpec, HeadTransform
from distill.ops.divergence_torch import _log_softmax, _logsumexp, _zero_sum_at
from distill.ops.linear_divergence import _chain_head, _fold, _project
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
        z, _ = _project(self.hidden[rows], self.weight, self.head,
                        torch.empty((len(rows), self.vocab), dtype=torch.float32,
                                    device=self.hidden.device))
        return z

    def row_logprobs(self, rows, t: float) -> torch.Tensor:
        """(c, Vt) log-probs at the training temperature. Cached: the top-k and the row's
        own token as stored, the remaining mass spread evenly over the other ids."""
        if self.live:
            return _log_softmax(self.logits(rows) / t)
        ids, lp = self.topk_ids[rows].long(), self.topk_logprobs[rows].float()
        tok, tok_lp = self.targets[rows], self.target_logprobs[rows].float()
        c, r = len(rows), torch.arange(len(rows), device=ids.device)
        known = torch.zeros((c, self.vocab), dtype=torch.bool, device=ids.device)
        known.scatter_(1, ids, True)
        extra = ~known[r, tok]
        mass = _logsumexp(torch.cat([lp, torch.where(extra, tok_lp, -torch.inf)[:, None]], -1))
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
            out[lo:lo + chunk] = a.gather(1, self.targets[r][:, None]).squeeze(1) - _logsumexp(
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
        dz = _chain_head(dz, us, self.head)
        if self.grad_b is not None:
            self.grad_b += dz.sum(0)
        if self.cast:
            dz = dz.to(self.ws.dtype)
        gh = None
        if self.grad_h is not None:
            gh = torch.empty((len(rows), self.hs.shape[1]), dtype=self.hs.dtype,
                             device=self.hs.device)
        _fold(dz.contiguous(), self.hs[rows], self.ws, gh, self.grad_w, first=False)
        if gh is not None:
            self.grad_h.index_copy_(0, rows, gh)

    @property
    def grads(self):
        return self.grad_h, self.grad_w, self.grad_b


def _ce(z, labels):
    """Cross-entropy of untempered logits (c,) and softmax(z) (for its gradient)."""
    lse = _logsumexp(z)
    return (lse - z.gather(1, labels[:, None])).squeeze(1), torch.exp(z - lse)


def _minus_onehot(x, labels, scale):
    """x - scale * onehot(labels), in place."""
    return x.scatter_add_(1, labels[:, None], -scale[:, None].expand(-1, 1).to(x.dtype))


def xtok_rows(hs, ws, teacher: TeacherSide, plan: Plan, spec: DivergenceSpec, mode: str,
              tables, uld_weight: float, *, need_grad: bool, needs=(True, True, True),
              chunk_size=None, fp32_weight_grad=True, student_head=None, ce_sum=None):
    """Loss sum_i w_i loss_i and (grad_hidden, grad_weight, grad_bias); see the module
    docstring for the passes. `ce_sum` (0-dim fp32) receives sum_i w_i ce_i when given."""
    dev, t, cw = hs.device, spec.temperature, spec.ce_weight
    vs = ws.shape[0]
    pairs = len(tables.student_ids) if tables is not None else 0
    span_chunk, row_chunk = chunk_sizes(vs, teacher.vocab, pairs, dev, chunk_size)
    fold = _Folder(hs, ws, student_head, needs if need_grad else (False,) * 3,
                   fp32_weight_grad) if need_grad else None
    n_span = len(plan.first_s)
    want_ce = bool(cw) or ce_sum is not None
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    w = plan.weights

    def project(rows):
        z = torch.empty((len(rows), vs), dtype=torch.float32, device=dev)
        return _project(hs[rows], ws, student_head, z)

    def add_ce(ce, rows):
        nonlocal loss
        if cw:
            loss = loss + cw * (ce @ w[rows])
        if ce_sum is not None:
            ce_sum.add_(ce @ w[rows])

    # 1. teacher inner rows: the rest of each span's log-probability on the teacher side
    ct = torch.zeros(n_span, dtype=torch.float32, device=dev)
    ct.index_add_(0, plan.inner_t_span, teacher.own_logprobs(plan.inner_t, t, row_chunk))
    # 2. student inner rows: the same on the student side, and the logsumexps pass 4 reuses
    cs = torch.zeros(n_span, dtype=torch.float32, device=dev)
    n_inner = len(plan.inner_s)
    lse_t = torch.empty(n_inner, dtype=torch.float32, device=dev)
    for lo in range(0, n_inner, row_chunk):
        sl = slice(lo, lo + row_chunk)
        rows, tok = plan.inner_s[sl], plan.inner_s_tok[sl]
        z, _ = project(rows)
        lse_t[sl] = _logsumexp(z / t).squeeze(1)
        cs.index_add_(0, plan.inner_s_span[sl], z.gather(1, tok[:, None]).squeeze(1) / t
                      - lse_t[sl])
        if want_ce:
            add_ce(_ce(z, tok)[0], rows)
    # 3. spans: the first rows meet the teacher
    dcs = torch.zeros(n_span, dtype=torch.float32, device=dev)
    for lo in range(0, n_span, span_chunk):
        sl = slice(lo, lo + span_chunk)
        rows = plan.first_s[sl]
        z, us = project(rows)
        logp = teacher.row_logprobs(plan.first_t[sl], t)
        span_loss, dz, dc = span_rows(z, logp, plan.s_tok[sl], plan.t_tok[sl], cs[sl], ct[sl],
                                      spec, mode, tables, uld_weight, need_grad)
        del logp
        om = plan.omega[sl]
        loss = loss + span_loss @ om
        if want_ce:
            ce, soft = _ce(z, plan.s_tok[sl])
            add_ce(ce, rows)
        if not need_grad:
            continue
        dcs[sl] = dc * om
        dz = dz * om[:, None]
        if cw:
            wc = w[rows] * cw
            dz = dz + _minus_onehot(soft.mul_(wc[:, None]), plan.s_tok[sl], wc)
        fold(_zero_sum_at(dz, z.argmax(-1, keepdim=True)), rows, us)
    # 4. student inner rows again: their part of each span's gradient (through C)
    if need_grad:
        for lo in range(0, n_inner, row_chunk):
            sl = slice(lo, lo + row_chunk)
            rows, tok = plan.inner_s[sl], plan.inner_s_tok[sl]
            z, us = project(rows)
            g = dcs[plan.inner_s_span[sl]] / t
            dz = torch.exp(z / t - lse_t[sl][:, None]).mul_(-g[:, None])
            dz.scatter_add_(1, tok[:, None], g[:, None])
            if cw:
                wc = w[rows] * cw
                dz += _minus_onehot(_ce(z, tok)[1].mul_(wc[:, None]), tok, wc)
            fold(_zero_sum_at(dz, z.argmax(-1, keepdim=True)), rows, us)
    # 5. trained rows in no span: the CE term alone
    if want_ce:
        for lo in range(0, len(plan.ce_rows), row_chunk):
            rows = plan.ce_rows[lo:lo + row_chunk]
            lab = plan.labels[rows]
            z, us = project(rows)
            ce, soft = _ce(z, lab)
            add_ce(ce, rows)
            if need_grad and cw:
                wc = w[rows] * cw
                fold(_zero_sum_at(_minus_onehot(soft.mul_(wc[:, None]), lab, wc),
                                  z.argmax(-1, keepdim=True)), rows, us)
    return loss, (fold.grads if fold is not None else (None, None, None))
