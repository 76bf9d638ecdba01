"""Random realistic inputs and the float64 oracle comparison shared by loss and op tests.

The oracle is tests/oracle.py, which imports nothing from distill: `run_both` runs the code
under test and the oracle on the same inputs, `assert_close` compares the losses and every
gradient row by row (each row of d hidden is one position, each row of d weight one vocab
entry), each row held to its own size.
"""

from __future__ import annotations

import math

import torch

from tests.oracle import Head, assert_rows_close, head_logits, oracle_loss


def make_inputs(n=41, v=1271, hs=48, ht=40, k=None, dtype=torch.float32, device="cpu",
                ignore_frac=0.3, logit_std=4.0):
    """Hidden states and weights scaled so logits have std ~logit_std (a trained model's)."""
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * std)

    x = dict(
        student_hidden=rnd(n, hs),
        student_weight=rnd(v, hs, std=logit_std / hs**0.5),
        labels=torch.randint(0, v, (n,), generator=g),
    )
    x["labels"][torch.rand(n, generator=g) < ignore_frac] = -100
    if k is None:
        x["teacher_hidden"] = rnd(n, ht)
        x["teacher_weight"] = rnd(v, ht, std=logit_std / ht**0.5)
    else:
        tl = rnd(n, v, std=logit_std)
        logp = torch.log_softmax(tl, -1)
        top = logp.topk(k, dim=-1)
        x["target_ids"], x["target_logprobs"] = top.indices, top.values
    out = {}
    for name, t in x.items():
        if t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.to(device)
    return out


# the keywords of linear_divergence that define the loss: the oracle takes them too
ORACLE_KEYWORDS = ("kind", "beta", "temperature", "ce_weight", "temperature_squared",
                   "sparse_mode", "divergence_weight", "ignore_index", "vocab_size")


def oracle_head(head):
    """The oracle's own Head for a distill HeadTransform (the same numbers, float64)."""
    if head is None:
        return None
    bias = None if head.bias is None else head.bias.detach().double()
    return Head(bias=bias, scale=float(head.scale), softcap=head.softcap)


class OracleResult(tuple):
    """(loss, {name: grad}) of the oracle, with `row_scales` (see gradient_row_scales)."""

    row_scales: object  # (rtol, dtype) -> {name: (rows,)}


def run_both(inputs, fn, grad_scale=1.0, **kw):
    """(loss, grads) from `fn` and from the float64 oracle, on the same inputs; grads of
    student_hidden and student_weight. The oracle's result also carries the scale each
    gradient row is held to (`assert_close`)."""
    def grads_of(f, cast):
        leaves = {}
        args = {}
        for name, t in inputs.items():
            t = t.detach()
            if t.is_floating_point():
                t = t.to(cast) if cast else t
            if name in ("student_hidden", "student_weight"):
                t = t.clone().requires_grad_(True)
                leaves[name] = t
            args[name] = t
        loss = f(args)
        (loss * grad_scale).backward()
        return loss.detach(), {k: v.grad for k, v in leaves.items()}

    oracle_kw = {k: kw[k] for k in ORACLE_KEYWORDS if k in kw}
    for side in ("student_head", "teacher_head"):
        if side in kw:
            oracle_kw[side] = oracle_head(kw[side])
    ref = OracleResult(grads_of(lambda a: oracle_loss(**a, **oracle_kw), torch.float64))
    ref.row_scales = lambda rtol, dtype: gradient_row_scales(inputs, grad_scale, oracle_kw,
                                                             rtol, dtype)
    got = grads_of(lambda a: fn(**a, **kw), None)
    return got, ref


# The op's softmax and divergence math is fp32 whatever the inputs: each entry of d logits
# carries a rounding error of a few fp32 units times the size of the terms it is built
# from (q, p and their logs), however much those terms cancel (a JSD with a small beta,
# where log q - log m is tiny next to log q). FP32_TERM_ULPS of them are allowed per term.
FP32_TERM_ULPS = 4 * 2.0**-24
# fp16 inputs: d logits enter the GEMMs in fp16, where entries below 2^-24 (the smallest
# subnormal) are lost: a token-weighted gradient has such entries
UNDERFLOW = {torch.float16: 2.0**-24}


def gradient_row_scales(inputs, grad_scale, oracle_kw, rtol, dtype=torch.float32):
    """{name: (rows,)} the scale each gradient row is held to (assert_close): the norm of
    the sum of the magnitudes of the products the row sums (d hidden = C W, d weight =
    C.T H, C the oracle's gradient of the logits: a row whose terms cancel is only as
    accurate as its largest terms), plus the fp32 rounding of C's own terms and fp16's
    underflow (divided by rtol: absolute floors in the units assert_rows_close uses)."""
    x = {k: v.detach().cpu() for k, v in inputs.items()}
    x = {k: v.double() if v.is_floating_point() else v for k, v in x.items()}
    h, w = x["student_hidden"], x["student_weight"]
    z = (h @ w.T).T.contiguous().requires_grad_(True)  # hidden = I, weight = the logits.T
    loss = oracle_loss(**{**x, "student_hidden": torch.eye(len(h), dtype=torch.float64),
                          "student_weight": z}, **oracle_kw)
    (loss * grad_scale).backward()
    c = z.grad.T.abs() + _rounding_of_terms(x, z.detach().T, grad_scale, oracle_kw) / rtol
    c = c + UNDERFLOW.get(dtype, 0.0) / rtol
    dw = c.T @ h.abs()
    return {"student_hidden": (c @ w.abs()).norm(dim=1), "student_weight": dw.norm(dim=1),
            "student_weight columns": dw.norm(dim=0)}


def _rounding_of_terms(x, z, grad_scale, kw):
    """(N, V') FP32_TERM_ULPS x the size of the terms each entry of d logits is built from:
    w_i (q + p)(1 + |log q| + |log p|) / T for the divergence (p the teacher's probability
    at that entry; a tail id's share of the tail bucket when cached), w_i ce r for the CE
    of the untempered student r; times the head's derivative."""
    t, vocab = kw.get("temperature", 1.0), kw.get("vocab_size") or z.shape[1]
    head = kw.get("student_head")
    raw = z[:, :vocab]
    a = head_logits(torch.eye(len(z), dtype=torch.float64), raw.T, head)
    d_head = torch.ones_like(a) if head is None else head.scale * (
        torch.ones_like(a) if head.softcap is None else 1 - (a / head.softcap) ** 2)
    labels = x.get("labels")
    trained = torch.ones(len(z), dtype=torch.bool) if labels is None else (
        labels != kw.get("ignore_index", -100))
    weights = x.get("weights")
    wts = (trained.double() / max(int(trained.sum()), 1) if weights is None
           else weights.abs() * trained)
    logq = torch.log_softmax(a / t, -1)
    if "teacher_hidden" in x:
        zt = head_logits(x["teacher_hidden"], x["teacher_weight"], kw.get("teacher_head"),
                         vocab)
        p = torch.softmax(zt / t, -1)
    else:
        lp = x["target_logprobs"]
        p = torch.zeros_like(a).scatter(-1, x["target_ids"].long(), lp.exp())
        in_k = torch.zeros_like(a, dtype=torch.bool).scatter(-1, x["target_ids"].long(), True)
        q = logq.exp()
        q_tail = (q * ~in_k).sum(-1, keepdim=True)
        p_tail = (1 - lp.exp().sum(-1, keepdim=True)).clamp_min(0)
        share = torch.where(q_tail > 0, p_tail / q_tail.clamp_min(1e-300), 0.0)
        p = torch.where(in_k, p, q * share)
    q = logq.exp()
    logp = torch.where(p > 0, p.clamp_min(1e-300).log().abs(), 0.0)
    terms = (q + p) * (1 + logq.abs() + logp) / t
    terms = terms + kw.get("ce_weight", 0.0) * torch.softmax(a, -1)
    out = torch.zeros_like(z)
    out[:, :vocab] = FP32_TERM_ULPS * abs(grad_scale) * wts[:, None] * terms * d_head
    return out


def assert_close(got, ref, dtype):
    """The loss within the dtype's tolerance; each gradient row within 10x its rtol of the
    oracle's, relative to the terms the row sums (gradient_row_scales, carried by the
    result of run_both); d weight also per hidden unit (its columns)."""
    from tests.conftest import TOLERANCES

    rtol, atol = TOLERANCES[dtype]
    (lg, gg), (lr, gr) = got, ref
    torch.testing.assert_close(lg.double().cpu(), lr.double().cpu(), rtol=rtol, atol=atol)
    row_rtol = row_tolerance(dtype)
    scales = ref.row_scales(row_rtol, dtype)
    for name in gr:
        assert gg[name] is not None, f"grad {name}: none"
        assert_rows_close(gg[name], gr[name], row_rtol, 1e-30, f"grad {name}", scales[name])
        if name == "student_weight":
            assert_rows_close(gg[name].T, gr[name].T, row_rtol, 1e-30,
                              "grad student_weight columns", scales[name + " columns"])


def row_tolerance(dtype):
    from tests.conftest import TOLERANCES

    return max(TOLERANCES[dtype][0], 1e-7) * 10


class AllocationRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (op name, shape) of every tensor an op returns (`calls`) and of those in
    new memory (`created`: views and out= results excluded), to check that a skipped
    gradient costs no buffer of its size and no GEMM."""

    def __init__(self):
        super().__init__()
        self.calls, self.created = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        given = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.calls.append((func.__name__, tuple(t.shape)))
                if t.untyped_storage().data_ptr() not in given:
                    self.created.append(self.calls[-1])
        return out

    def shapes(self, op_prefix="", new_memory=True):
        seen = self.created if new_memory else self.calls
        return [shape for name, shape in seen if name.startswith(op_prefix)]


def frozen_head_grads(inputs, fn, trainable, **kw):
    """Loss, {name: .grad} and the allocations of fn with only `trainable` requiring grad."""
    args, leaves = {}, {}
    for name, t in inputs.items():
        t = t.detach()
        if name in ("student_hidden", "student_weight"):
            t = t.clone().requires_grad_(name in trainable)
            leaves[name] = t
        args[name] = t
    with AllocationRecorder() as rec:
        loss = fn(**args, **kw)
        (loss * 0.5).backward()
    return loss.detach(), {k: v.grad for k, v in leaves.items()}, rec


EXTREME_CASES = ("student", "teacher", "both", "opposite", "huge", "onehot", "onehot_inf")


def extreme_logits(case, n, v, gap, generator):
    """(student, teacher) float64 logits (n, v) of one regime at the extremes: a logit
    `gap` above O(1) noise for a confident student (random teacher), teacher, both on one
    token or on two different ones; logits spread over +-1e4 ("huge"); a one-hot teacher
    (gap 1e4; cached as log-probs 0 and -1e4, or 0 and -inf with "onehot_inf")."""
    def noise():
        return torch.randn(n, v, generator=generator, dtype=torch.float64)

    def top(z, ids, g):
        return z.scatter_add(-1, ids[:, None], torch.full((n, 1), g, dtype=torch.float64))

    tok = torch.randint(0, v, (n,), generator=generator)
    other = (tok + torch.randint(1, v, (n,), generator=generator)) % v
    zs, zt = noise(), noise()
    if case == "huge":
        return zs * 1e4, zt * 1e4
    if case == "student":  # on the teacher's favourite (a cached id) in every other row
        tok[::2] = zt[::2].argmax(-1)
    if case in ("student", "both", "opposite"):
        zs = top(zs, tok, gap)
    if case in ("teacher", "both", "onehot", "onehot_inf"):
        zt = top(zt, tok, gap if case in ("teacher", "both") else 1e4)
    if case == "opposite":
        zt = top(zt, other, gap)
    return zs, zt


def extreme_inputs(case, n=12, v=61, gap=40.0, k=None, dtype=torch.float32, device="cpu",
                   ignore_frac=0.25):
    """Inputs whose logits are exactly `extreme_logits`: each hidden state is a one-hot
    row (H = n) and the head's column i holds row i's logits, so the GEMM is exact in any
    dtype and d weight's column i is row i's own gradient (w_i * d loss_i / d logits)."""
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    zs, zt = extreme_logits(case, n, v, gap, g)
    eye = torch.eye(n, dtype=torch.float64)
    x = dict(student_hidden=eye, student_weight=zs.T.contiguous(),
             labels=torch.randint(0, v, (n,), generator=g))
    x["labels"][torch.rand(n, generator=g) < ignore_frac] = -100
    if k is None:
        x.update(teacher_hidden=eye.clone(), teacher_weight=zt.T.contiguous())
    else:
        top = torch.log_softmax(zt.to(dtype).double(), -1).topk(k, dim=-1)
        lp = top.values
        if case == "onehot_inf":  # exact zeros: log-probs 0 and -inf
            lp = lp.masked_fill(lp < -1e3, -math.inf)
        x.update(target_ids=top.indices, target_logprobs=lp)
    return {name: (t.to(dtype) if t.is_floating_point() else t).to(device)
            for name, t in x.items()}


# At the extremes a row's gradient can be ~exp(-60) while its neighbour's is O(1), so
# gradients are compared row by row, each relative to its own size (extreme_inputs makes
# d weight's column i row i's gradient). fp32: the row math is accurate to ~1e-5 relative
# (logits up to 1e4 cost |z| * eps in each exp); bf16: the stored gradient is rounded to
# 2^-9. Below 1e-30 a true gradient underflows fp32 (exp(-1e4) is 0). The loss is a sum of
# per-token terms each rounded at fp32's eps (JSD's log m of a near one-hot mixture).
EXTREME_RTOL = {torch.float32: 2e-4, torch.bfloat16: 1e-2}
EXTREME_LOSS_TOL = (1e-5, 1e-6)  # (rtol, atol in nats)
# Conditioning of the tempered logits: any fp32 kernel forms a = fl(z / T), off by half an
# ulp, up to 2^-24 |a|; the softmax of a row depends on the differences a_i - a_max, so
# each q_i (and the row's gradient, q - p or q (G - c)) carries a relative error up to
# 2^-23 max|a| (two roundings), i.e. 4e-3-8e-3 at |z| ~ 4e4, T = 0.7 (the "huge" regime),
# whatever the kernel does after. Only a row with two entries within ~100 of each other
# feels it (else the row is exactly one-hot); it is added per row, twice for slack (the
# untempered CE's softmax rounds its own z the same way). At O(1)-60 logits it is ~2e-5,
# far below the 80-97% errors of the pre-fix kernels (docs/notes/kernels.md).
TEMPERED_ULPS = 2 * 2.0**-23


def row_logit_scale(inputs, temperature):
    """max |z| / min(T, 1) per row of the student's and teacher's logits (n,)."""
    zs = inputs["student_hidden"].double() @ inputs["student_weight"].double().T
    scale = zs.abs().amax(1)
    if "teacher_hidden" in inputs:
        zt = inputs["teacher_hidden"].double() @ inputs["teacher_weight"].double().T
        scale = torch.maximum(scale, zt.abs().amax(1))
    return scale.cpu() / min(temperature, 1.0)


def assert_close_extreme(got, ref, inputs, dtype, temperature=1.0):
    """Loss, d weight row by row, d hidden entrywise against the float64 oracle.

    d hidden = d weight.T @ weight: each entry is held to rtol times the sum of the
    magnitudes of its products, the accuracy a dot product of rounded factors promises.
    """
    rtol = EXTREME_RTOL[dtype]
    row_rtol = rtol + TEMPERED_ULPS * row_logit_scale(inputs, temperature)  # (n,)
    (lg, gg), (lr, gr) = got, ref
    lg, lr = lg.double().cpu(), lr.double().cpu()
    assert torch.isfinite(lg), f"loss {lg}"
    assert (lg - lr).abs() <= EXTREME_LOSS_TOL[0] * lr.abs() + EXTREME_LOSS_TOL[1], (lg, lr)
    gw, rw = gg["student_weight"].double().cpu(), gr["student_weight"].double().cpu()
    assert torch.isfinite(gw).all()
    err = (gw - rw).norm(dim=0)
    bad = err > row_rtol * rw.norm(dim=0) + 1e-30
    assert not bad.any(), (f"d weight: rows {bad.nonzero().flatten().tolist()} relative error "
                           f"{(err / rw.norm(dim=0))[bad].tolist()}")
    w = inputs["student_weight"].double().cpu()
    gh, rh = gg["student_hidden"].double().cpu(), gr["student_hidden"].double().cpu()
    bound = row_rtol[:, None] * (rw.abs().T @ w.abs()) + 1e-30
    bad = (gh - rh).abs() > bound
    assert not bad.any(), (f"d hidden: {int(bad.sum())} entries off, worst "
                           f"{((gh - rh).abs() / bound).max().item():.2f}x the bound")
