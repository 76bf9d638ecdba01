"""`cross_tokenizer_divergence`: distil a teacher with another tokenizer, from hidden states.

The student is trained on its own tokens: `labels` and `weights` are per student position,
exactly as for `distill.linear_divergence`, and the normalization policies keep their
meaning. The teacher runs on its own tokenization of the same text; `spans` (from
`distill.xtok.pairing` / `collate`) say which student rows and which teacher rows cover the
same stretch of text. For span j with student rows R_j (n_j of them):

    loss = sum_j omega_j * L_j  +  ce_weight * sum_i w_i * CE_i

where L_j is the span loss of `distill.xtok.span_math` (`uld`, or `hybrid`: the exact
divergence on tokens both vocabularies share, ULD on the rest) and omega_j = mean of w over
R_j, i.e. each student token of a span carries L_j / n_j. A span counts only if every one
of its student rows is trained (label set, weight > 0), so an ignored position never gets
a gradient. Trained student rows in no span (text the teacher's rendering lacks) keep the
CE term only.
"""

from __future__ import annotations

import torch

from distill.core.constants import IGNORE_INDEX
from distill.losses.fused import outside_autocast
from distill.ops.function import take_grads
from distill.ops.spec import DivergenceSpec, HeadTransform
from distill.xtok.op import Plan, TeacherSide, xtok_rows
from distill.xtok.vocab import VocabMap

MODES = ("uld", "hybrid")


class _CrossTokenizer(torch.autograd.Function):
    """Gradients computed in forward (the weights are known); backward scales them."""

    @staticmethod
    def forward(ctx, hs, ws, bias, teacher, plan, opts):
        loss, grads = xtok_rows(hs, ws, teacher, plan, need_grad=True,
                                needs=tuple(ctx.needs_input_grad[:3]), **opts)
        ctx.grads, ctx.weight_dtype = grads, ws.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        return (*take_grads(ctx, grad_out, "cross_tokenizer_divergence"), None, None, None)


def _expand(lo: torch.Tensor, hi: torch.Tensor):
    """Rows lo[j] .. hi[j] - 1 of every span j, and the span each belongs to."""
    lens = (hi - lo).clamp_min(0)
    span = torch.repeat_interleave(torch.arange(len(lo), device=lo.device), lens)
    starts = torch.repeat_interleave(lo - (torch.cumsum(lens, 0) - lens), lens)
    return starts + torch.arange(len(span), device=lo.device), span


def _check_spans(spans, ns: int, nt: int):
    if spans.dim() != 2 or spans.shape[1] != 4:
        raise ValueError(f"spans must be (S, 4) [student lo, hi, teacher lo, hi) rows, got "
                         f"{tuple(spans.shape)}")
    s_lo, s_hi, t_lo, t_hi = spans.long().unbind(1)
    bad = (s_lo < 0) | (s_hi <= s_lo) | (s_hi > ns) | (t_lo < 0) | (t_hi <= t_lo) | (t_hi > nt)
    if bool(bad.any()):
        j = int(bad.nonzero()[0])
        raise ValueError(f"span {j} {spans[j].tolist()} is empty or outside the rows (student "
                         f"{ns}, teacher {nt})")
    for lo, hi, n, who in ((s_lo, s_hi, ns, "student"), (t_lo, t_hi, nt, "teacher")):
        rows, _ = _expand(lo, hi)
        if bool((torch.bincount(rows, minlength=n) > 1).any()):
            raise ValueError(f"spans overlap: a {who} row belongs to two spans")
    return s_lo, s_hi, t_lo, t_hi


def build_plan(spans, labels, weights, teacher_targets, ns: int, nt: int, spec, want_ce,
               ignore_index: int = IGNORE_INDEX):
    """Which rows are span firsts, span inners and CE-only rows; see `op.Plan`."""
    dev = labels.device if labels is not None else spans.device
    if labels is None:
        raise ValueError("cross_tokenizer_divergence needs the student's labels: the tokens "
                         "its span rows predict")
    s_lo, s_hi, t_lo, t_hi = _check_spans(spans.to(dev), ns, nt)
    trained = labels != ignore_index
    if weights is None:
        w = trained.float() / trained.sum().clamp_min(1)
    else:
        w = weights.float() * trained
        trained = trained & (w != 0)
    # a span counts only when all of its student rows are trained
    cum_n = torch.nn.functional.pad(torch.cumsum(trained.long(), 0), (1, 0))
    cum_w = torch.nn.functional.pad(torch.cumsum(w.double(), 0), (1, 0))
    keep = (cum_n[s_hi] - cum_n[s_lo]) == (s_hi - s_lo)
    s_lo, s_hi, t_lo, t_hi = s_lo[keep], s_hi[keep], t_lo[keep], t_hi[keep]
    omega = ((cum_w[s_hi] - cum_w[s_lo]) / (s_hi - s_lo)).float()
    inner_s, inner_s_span = _expand(s_lo + 1, s_hi)
    inner_t, inner_t_span = _expand(t_lo + 1, t_hi)
    ce_rows = torch.zeros(0, dtype=torch.long, device=dev)
    if want_ce:
        alone = trained.clone()
        alone[_expand(s_lo, s_hi)[0]] = False
        ce_rows = alone.nonzero().squeeze(1)
    targets = teacher_targets.long()
    return Plan(first_s=s_lo, first_t=t_lo, s_tok=labels[s_lo], t_tok=targets[t_lo],
                omega=omega, inner_s=inner_s, inner_s_span=inner_s_span,
                inner_s_tok=labels[inner_s], inner_t=inner_t, inner_t_span=inner_t_span,
                ce_rows=ce_rows, weights=w, labels=labels)


def _cut(x, vocab):
    return x if x is None or x.shape[0] == vocab else x[:vocab]


@outside_autocast
def cross_tokenizer_divergence(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    *,
    spans: torch.Tensor,
    teacher_targets: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_topk_ids: torch.Tensor | None = None,
    teacher_topk_logprobs: torch.Tensor | None = None,
    teacher_target_logprobs: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    mode: str = "hybrid",
    vocab_map: VocabMap | None = None,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    ce_weight: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    temperature_squared: bool = False,
    divergence_weight: float = 1.0,
    uld_weight: float = 1.0,
    student_vocab_size: int | None = None,
    teacher_vocab_size: int | None = None,
    student_head: HeadTransform | None = None,
    teacher_head: HeadTransform | None = None,
    chunk_size: int | None = None,
    fp32_weight_grad: bool = True,
    return_components: bool = False,
):
    """sum_j omega_j L_j + ce_weight sum_i w_i CE_i (fp32 scalar); see the module docstring.

    student_hidden (Ns, Hs), student_weight (Vs', Hs); labels / weights (Ns,) as for
    linear_divergence. spans (S, 4): [student row lo, hi, teacher row lo, hi) in the two
    flattened, shifted batches (`distill.xtok.collate.flat_spans`). teacher_targets (Nt,):
    the token each teacher row predicts. The teacher is live (teacher_hidden (Nt, Ht),
    teacher_weight (Vt', Ht)) or cached (teacher_topk_ids / _logprobs (Nt, K) and
    teacher_target_logprobs (Nt,), at the training temperature). `mode` 'uld' or 'hybrid'
    (needs `vocab_map`); `kind` / `beta` choose the hybrid's divergence; `uld_weight`
    scales its ULD part. The vocabulary sizes default to the vocab map's, else the heads'.
    Gradients flow into student_hidden, student_weight (and a student head bias).
    """
    if mode not in MODES:
        raise ValueError(f"unknown loss.cross_tokenizer={mode!r}: choose 'uld' or 'hybrid'")
    if mode == "hybrid" and vocab_map is None:
        raise ValueError("loss.cross_tokenizer=hybrid needs the vocabulary map "
                         "(distill.xtok.VocabMap.build(student_tokenizer, teacher_tokenizer))")
    live = teacher_hidden is not None
    if live == (teacher_topk_ids is not None) or (live and teacher_weight is None) or (
            not live and (teacher_topk_logprobs is None or teacher_target_logprobs is None)):
        raise ValueError("give the teacher either live (teacher_hidden, teacher_weight) or "
                         "cached (teacher_topk_ids, teacher_topk_logprobs, "
                         "teacher_target_logprobs)")
    spec = DivergenceSpec(kind=kind, beta=beta, temperature=temperature, ce_weight=ce_weight,
                          temperature_squared=temperature_squared,
                          divergence_weight=divergence_weight)
    vs = student_vocab_size or (vocab_map.student_size if vocab_map else student_weight.shape[0])
    vt = teacher_vocab_size or (vocab_map.teacher_size if vocab_map else
                                (teacher_weight.shape[0] if live else None))
    if vt is None:
        raise ValueError("cached teacher: give teacher_vocab_size (len of its tokenizer)")
    if vocab_map is not None and (vocab_map.student_size, vocab_map.teacher_size) != (vs, vt):
        raise ValueError(f"the vocab map is for vocabularies of {vocab_map.student_size} and "
                         f"{vocab_map.teacher_size} tokens, the loss got {vs} and {vt}")
    if student_weight.shape[0] < vs or (live and teacher_weight.shape[0] < vt):
        raise ValueError("an LM head has fewer rows than its tokenizer has tokens")
    dev = student_hidden.device
    ns = student_hidden.shape[0]
    nt = len(teacher_targets)
    ce_sum = torch.zeros((), dtype=torch.float32, device=dev) if return_components else None
    plan = build_plan(spans, labels, weights, teacher_targets.to(dev), ns, nt, spec,
                      want_ce=bool(ce_weight) or return_components, ignore_index=ignore_index)
    head = student_head
    if head is not None and head.bias is not None:
        head = HeadTransform(_cut(head.bias, vs), head.scale, head.softcap)
    t_head = teacher_head
    if t_head is not None and t_head.bias is not None:
        t_head = HeadTransform(_cut(t_head.bias, vt), t_head.scale, t_head.softcap)
    teacher = TeacherSide(targets=teacher_targets.to(dev).long(), vocab=vt,
                          hidden=teacher_hidden, weight=_cut(teacher_weight, vt), head=t_head,
                          topk_ids=teacher_topk_ids, topk_logprobs=teacher_topk_logprobs,
                          target_logprobs=teacher_target_logprobs)
    tables = vocab_map.tables(dev) if mode == "hybrid" else None
    ws = _cut(student_weight, vs)
    opts = dict(spec=spec, mode=mode, tables=tables, uld_weight=uld_weight,
                chunk_size=chunk_size, fp32_weight_grad=fp32_weight_grad, student_head=head,
                ce_sum=ce_sum)
    bias = head.bias if head is not None else None
    need_grad = torch.is_grad_enabled() and (student_hidden.requires_grad
                                             or student_weight.requires_grad
                                             or (bias is not None and bias.requires_grad))
    if need_grad:
        loss = _CrossTokenizer.apply(student_hidden, ws, bias, teacher, plan, opts)
    else:
        loss, _ = xtok_rows(student_hidden, ws, teacher, plan, need_grad=False, **opts)
    if not return_components:
        return loss
    ce = ce_sum.detach()
    return loss, {"divergence": loss.detach() - ce_weight * ce, "ce": ce,
                  "spans": len(plan.first_s)}
