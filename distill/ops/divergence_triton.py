"""Row-wise divergence math in Triton: loss and d(loss)/d(logits), one program per row.

The CUDA implementation of the op's inner step (`divergence_torch.py` is the CPU one and
the spec of the semantics). One idea: the logits are read as few times as possible.
Pass 1 streams the row once with an online max / sum (both softmaxes, and the untempered
student's for the cross-entropy); the last pass streams it again, computes the loss terms
and writes the gradient. JSD needs <q, G> before it can write, so it reads once more.

The gradient may be written over the student logits it comes from: as fp32 in place, or
as bf16/fp16 into one half of each fp32 row (a strided (C, V) view the GEMMs read
directly). The writing pass walks the row in the direction that only overwrites bytes it
has already read, with a barrier between the loads and the stores of each block, because
another warp of the program may still need the bytes a store lands on. Walking the last
pass backwards also re-reads first the blocks pass 1 read last, which are still in L2.

At the extremes (one logit tens of units above the rest) nothing is a difference of
numbers near 1 (docs/notes/kernels.md): normalizers are kept as (max, rest) and finished
with log1p; the cached path sets the K ids' logits to -inf in the row before pass 1, which
then sums the tail directly; the writing pass tracks the row's largest logit and writes its
entry last, as minus the sum of all the others.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distill.ops.sparse_triton import _sparse_fwd_kernel
from distill.ops.spec import TAIL_FLOOR, DivergenceSpec, check_row_fixup
from distill.ops.triton_math import _lane_ref, _logaddexp, _online, _track_ref

_KIND = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}
# (BLOCK, num_warps) per row program, measured on an H200 at V=128256 (docs/notes/kernels.md);
# scripts/bench_loss.py --tune re-measures them. Registers a thread (sm_90, ptxas) decide
# the programs an SM holds: the live kernel's per-lane bookkeeping ("lane" below) holds two
# BLOCK-shaped carries, 73-80 registers at 2048 (3 programs per SM), 128 and spills at 4096;
# "block" needed 100-128 at 4096 (2 programs; 188 for JSD with the CE: 1), 48-80 at 2048. The
# cached kernel's measured 8192 is halved since the largest-logit bookkeeping (issue 10):
# 121-127 registers at 4096 ("lane"; "block" 111-128), 2 programs per SM
# (docs/notes/kernels.md, "Fourth session", has the table). Since it loads each block one
# ahead (Tuning.prefetch), 2048 is its fastest: 0.88 ms a 2048-row chunk against 0.92 at
# 4096 (1.09 at 4096 without the prefetch; kernels.md, "Seventh session").
CONFIG = {"live": (2048, 8), "sparse": (2048, 8)}
# spec.ROW_FIXUPS, how the writing pass finds the largest logit: "lane" tests z == the
# row's max (known from pass 1 or the tile stats) and keeps per-lane sums, reduced once per
# row; "block" (the first version) takes three block reductions per block
# (triton_math._track_ref). docs/notes/kernels.md has both costs.
MAX_K = 16384  # top-k ids held in registers by one program


@triton.jit
def _merge_tiles(st_ptr, plane, NT, inv_t, BLOCK_T: tl.constexpr):
    """(max z, sum of exp((z - max) * inv_t)) of a row from its tiles' planes; see
    logits_gemm."""
    offs = tl.arange(0, BLOCK_T)
    m_run = tl.zeros((), tl.float32) + float("-inf")
    s_run = tl.zeros((), tl.float32)
    for i in range(0, tl.cdiv(NT, BLOCK_T)):
        idx = i * BLOCK_T + offs
        mask = idx < NT
        m = tl.load(st_ptr + idx, mask=mask, other=float("-inf"))
        s = tl.load(st_ptr + plane + idx, mask=mask, other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        s_run = s_run * tl.exp((m_run - m_new) * inv_t) + tl.sum(
            s * tl.exp((m - m_new) * inv_t), 0)
        m_run = m_new
    return m_run, s_run


@triton.jit
def _live_terms(zs, zt, idx, mask, label, ms, ls, mt, lt, m1, l1, c, inv_t, gf, lb, l1b,
                beta, ce_weight, KIND: tl.constexpr, CE_GRAD: tl.constexpr,
                CE_SEP: tl.constexpr):
    """The writing pass at entries idx: (each entry's KL term, its gradient before the row
    scale). Also called after the pass, at zs = ms, for a tie of the largest logit."""
    logq = (zs - ms) * inv_t - ls
    logp = (zt - mt) * inv_t - lt
    q, p = tl.exp(logq), tl.exp(logp)
    if KIND == 0:
        term = tl.where(mask & (p > 0), p * (logp - logq), 0.0)
        da = q - p  # not q * (G - <q, G>): G = -p / q overflows where q underflows
    elif KIND == 1:
        term = tl.where(mask & (q > 0), q * (logq - logp), 0.0)
        da = q * (tl.where(q > 0, logq - logp, 0.0) - c)
    else:  # JSD's terms came from its pass 2
        term = tl.zeros_like(q)
        da = q * (tl.where(q > 0, (1.0 - beta) * (logq - _logaddexp(logp + lb, logq + l1b)),
                           0.0) - c)
    g = gf * da
    if CE_GRAD:
        sm = q
        if CE_SEP:
            sm = tl.exp((zs - m1) - l1)
        g += ce_weight * (sm - tl.where(idx == label, 1.0, 0.0))
    return term, tl.where(mask, g, 0.0)


@triton.jit
def _live_fwd_kernel(
    zs_ptr,  # (C, V) fp32 student logits
    zt_ptr,  # (C, V) fp32 teacher logits
    dz_ptr,  # (C, V) fp32/bf16/fp16 out: row_scale * d loss / d zs (may alias zs)
    loss_ptr,  # (C,) fp32 out: factor * divergence + ce_weight * ce
    ce_ptr,  # (C,) fp32 out: cross-entropy of the untempered student (if WRITE_CE)
    labels_ptr,  # (C,) int64 hard labels (if HAS_CE)
    scale_ptr,  # (C,) fp32 row scale of the gradient (if HAS_SCALE)
    sts_ptr, NT, plane_s,  # (P, C, NT) tile stats of the student logits (if STATS)
    stt_ptr, plane_t,  # and of the teacher's
    V, stride_s, stride_t, stride_d,
    inv_t, beta, ce_weight, factor,
    KIND: tl.constexpr, HAS_CE: tl.constexpr, CE_GRAD: tl.constexpr, CE_SEP: tl.constexpr,
    WRITE_CE: tl.constexpr, HAS_SCALE: tl.constexpr, NEED_GRAD: tl.constexpr,
    ALIAS: tl.constexpr, STATS: tl.constexpr, LANE: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    zs_row = zs_ptr + row * stride_s
    zt_row = zt_ptr + row * stride_t
    dz_row = dz_ptr + row * stride_d
    offs = tl.arange(0, BLOCK)
    nb = (V + BLOCK - 1) // BLOCK
    ninf = float("-inf")
    zero = tl.zeros((), tl.float32)
    ms, ss, mt, st, m1, s1, w_rkl = zero + ninf, zero, zero + ninf, zero, zero + ninf, zero, zero
    if STATS:  # the GEMMs' epilogues did pass 1 per tile: merge the tiles
        sts_row = sts_ptr + row * NT
        ms, ss = _merge_tiles(sts_row, plane_s, NT, inv_t, BLOCK_T)
        mt, st = _merge_tiles(stt_ptr + row * NT, plane_t, NT, inv_t, BLOCK_T)
        if CE_SEP:
            m1, s1 = _merge_tiles(sts_row + 2 * plane_s, plane_s, NT, 1.0, BLOCK_T)
    # pass 1: normalizers of q = softmax(zs / T), p = softmax(zt / T) (and softmax(zs)),
    # each max in logit space, every exponent (z - max) * inv_t (triton_math says why)
    w_sh = zero  # reverse KL: what w_rkl lacks of <q, log q - log p> - (log sums)
    for i in range(0, 0 if STATS else nb):
        idx = i * BLOCK + offs
        mask = idx < V
        zs = tl.load(zs_row + idx, mask=mask, other=ninf)
        zt = tl.load(zt_row + idx, mask=mask, other=ninf)
        ms_new = tl.maximum(ms, tl.max(zs, 0))
        e_s = tl.exp((zs - ms_new) * inv_t)
        alpha = tl.exp((ms - ms_new) * inv_t)
        ss = ss * alpha + tl.sum(e_s, 0)
        if KIND == 1:
            # <q, (zs - zt) / T> online: the reverse-KL gradient needs it in the last pass
            d = tl.where(mask, (zs - zt) * inv_t, 0.0)
            w_rkl = w_rkl * alpha + tl.sum(e_s * d, 0)
        ms = ms_new
        mt, st = _online(mt, st, zt, inv_t)
        if CE_SEP:
            m1, s1 = _online(m1, s1, zs, 1.0)
    if not STATS:
        w_sh = (mt - ms) * inv_t
    if STATS and KIND == 1:
        for i in range(0, nb):  # <q, log q - log p> up to the log sums, the maxes known
            idx = i * BLOCK + offs
            mask = idx < V
            zs = tl.load(zs_row + idx, mask=mask, other=ninf)
            zt = tl.load(zt_row + idx, mask=mask, other=ninf)
            d = tl.where(mask, (zs - ms) * inv_t - (zt - mt) * inv_t, 0.0)
            w_rkl += tl.sum(tl.exp((zs - ms) * inv_t) * d, 0)
    # log q = (zs - ms) / T - log sum, never z / T - (max + log sum): with |z| / T ~ 1e4
    # every rounding at that size (~1e-3) would scale every p, q of a row with two
    # comparable entries (docs/notes/kernels.md, "Conditioning")
    ls, lt = tl.log(ss), tl.log(st)
    l1 = ls  # with m1: the untempered student's (max, log sum) for the CE
    if CE_SEP:
        l1 = tl.log(s1)
    else:
        m1 = ms
    c = w_rkl / ss + (w_sh + (lt - ls))  # reverse KL's <q, G> (only used by KIND == 1)
    ce = zero
    label = 0
    if HAS_CE:
        label = tl.load(labels_ptr + row)
        # read before the last pass may overwrite it
        ce = (m1 - tl.load(zs_row + label)) + l1

    rs = 1.0
    if HAS_SCALE:
        rs = tl.load(scale_ptr + row)
    gf = factor * inv_t
    lb, l1b = tl.log(beta), tl.log(1.0 - beta)
    div = zero
    if KIND == 2:
        # JSD: the loss and c = <q, G>, G = (1 - beta) (log q - log m), before any write
        cq = zero
        for i in range(0, nb):
            idx = (nb - 1 - i) * BLOCK + offs  # backwards: pass 1 left the row's end in L2
            mask = idx < V
            logq = (tl.load(zs_row + idx, mask=mask, other=ninf) - ms) * inv_t - ls
            logp = (tl.load(zt_row + idx, mask=mask, other=ninf) - mt) * inv_t - lt
            q, p = tl.exp(logq), tl.exp(logp)
            logm = _logaddexp(logp + lb, logq + l1b)
            tq = tl.where(mask & (q > 0), q * (logq - logm), 0.0)
            tp = tl.where(mask & (p > 0), p * (logp - logm), 0.0)
            div += tl.sum(beta * tp + (1.0 - beta) * tq, 0)
            cq += tl.sum(tq, 0)
        c = (1.0 - beta) * cq
    rm, ri, rg, acc = zero + ninf, tl.zeros((), tl.int32), zero, zero
    acc_l = tl.zeros((BLOCK,), tl.float32)  # LANE: per-lane sums, the lanes' first hits
    first = tl.full((BLOCK,), -1, tl.int32)
    if NEED_GRAD or KIND != 2:
        # last pass: the KL terms and the gradient; backwards, except after JSD's pass 2
        for i in range(0, nb):
            base = (i if KIND == 2 else nb - 1 - i) * BLOCK
            idx = base + offs
            mask = idx < V
            zs = tl.load(zs_row + idx, mask=mask, other=ninf)
            zt = tl.load(zt_row + idx, mask=mask, other=ninf)
            term, g = _live_terms(zs, zt, idx, mask, label, ms, ls, mt, lt, m1, l1, c,
                                  inv_t, gf, lb, l1b, beta, ce_weight, KIND, CE_GRAD,
                                  CE_SEP)
            if KIND != 2:
                div += tl.sum(term, 0)
            if NEED_GRAD:
                if LANE:  # ms is an element of the row: no reduction finds it
                    acc_l, first = _lane_ref(acc_l, first, (zs == ms) & mask, g, idx)
                else:
                    rm, ri, rg, acc = _track_ref(rm, ri, rg, acc, zs, g, base, offs)
                if HAS_SCALE:
                    g = g * rs
                if ALIAS:
                    tl.debug_barrier()  # the store may land on logits another warp reads
                tl.store(dz_row + idx, g.to(dz_ptr.dtype.element_ty), mask=mask)
    if NEED_GRAD:
        if LANE:
            # the largest hit is the entry written last; the other lanes' first hits (ties
            # with it) were left out of acc_l: their gradients, recomputed at zs = ms, join it
            ri = tl.max(first, 0)
            tied = (first >= 0) & (first != ri)
            zt = tl.load(zt_row + first, mask=tied, other=0.0)
            zs = tl.zeros((BLOCK,), tl.float32) + ms
            _, g = _live_terms(zs, zt, first, tied, label, ms, ls, mt, lt, m1, l1, c, inv_t,
                               gf, lb, l1b, beta, ce_weight, KIND, CE_GRAD, CE_SEP)
            acc = tl.sum(acc_l + g, 0)
        # the largest logit's exact gradient (~exp(-gap)) is minus the others' sum; its
        # own q_* (G_* - <q, G>) is a difference of nearly equal numbers
        tl.debug_barrier()
        tl.store(dz_row + ri, (-acc * rs).to(dz_ptr.dtype.element_ty), mask=ri >= 0)
    tl.store(loss_ptr + row, factor * div + ce_weight * ce)
    if WRITE_CE:
        tl.store(ce_ptr + row, ce)



@triton.jit(do_not_specialize=["n"])  # n == 1 would otherwise become a constexpr
def _scale_kernel(x_ptr, n, s_ptr, BLOCK: tl.constexpr):
    """x *= s in place, s read on the device; when s == 1 nothing is read or written."""
    s = tl.load(s_ptr).to(tl.float32)
    if s != 1.0:
        n64 = n.to(tl.int64)
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n64, step):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n64
            x = tl.load(x_ptr + offs, mask=mask)
            tl.store(x_ptr + offs, (x.to(tl.float32) * s).to(x.dtype), mask=mask)


def scale_(tensors, scale: torch.Tensor, programs: int = 1024, block: int = 4096) -> None:
    """Multiply contiguous tensors in place by the one-element tensor `scale` without
    reading it on the host: backward's grad_output, so no host sync (1 is the usual value:
    the programs then stop after one load)."""
    s = scale.detach().reshape(1).float()
    for x in tensors:
        if x is None or x.numel() == 0:
            continue
        if not x.is_contiguous():
            raise ValueError("scale_ takes contiguous tensors")
        grid = (min(programs, triton.cdiv(x.numel(), block)),)
        _scale_kernel[grid](x, x.numel(), s, BLOCK=block, num_warps=8)


def _grad_out(zs: torch.Tensor, dtype: torch.dtype, backwards: bool) -> torch.Tensor:
    """Where the gradient goes: over zs itself (fp32) or into one half of each fp32 row.

    A writer walking backwards may fill the upper half of a row (it has read those bytes
    by then), one walking forwards the lower half. The result is a (C, V) view with row
    stride 2V, which cuBLAS reads as it is.
    """
    if dtype == torch.float32:
        return zs
    v = zs.shape[1]
    halves = zs.view(dtype)  # (C, 2V)
    return halves[:, v:] if backwards else halves[:, :v]


def untempered_stats(spec: DivergenceSpec, labels, ce_out) -> bool:
    """Whether the row math needs the untempered student's softmax too (the CE at T != 1)."""
    return labels is not None and (bool(spec.ce_weight) or ce_out is not None) and (
        spec.temperature != 1.0)


def rows_loss_and_grad(zs, zt, target_ids, target_logprobs, labels, spec: DivergenceSpec,
                       need_grad, *, row_scale=None, grad_dtype=torch.float32, ce_out=None,
                       stats=None, grad_out=None, row_fixup="lane", row_config=None,
                       prefetch=True):
    """Loss (C,) and d loss / d zs (C, V), as `divergence_torch.rows_loss_and_grad`.

    zs: (C, V) fp32 student logits, CONSUMED: the gradient is written over its memory
    (see `_grad_out`), and cached rows first get -inf at their K ids. zt: (C, V) fp32
    teacher logits, or target_ids / target_logprobs (C, K). `row_scale` (C,) multiplies
    each gradient row (the token weights); `grad_dtype` is the gradient's dtype;
    `ce_out` (C,) fp32 receives each row's cross-entropy when given. `stats` (live
    teacher only): the (student, teacher) tile statistics from
    `logits_gemm.logits_and_stats`, which replace the first pass. `grad_out`: a (C, V)
    tensor to write the gradient into instead of over zs. `row_fixup`: one of spec.ROW_FIXUPS;
    `row_config`: (BLOCK, num_warps) instead of CONFIG's. `prefetch`: the cached kernel
    loads each block of a row while it works on the one before.
    """
    c, v = zs.shape
    check_row_fixup(row_fixup)
    if zs.dtype != torch.float32 or zs.stride(1) != 1:
        raise ValueError("the row kernel needs fp32 logits with contiguous rows")
    loss = torch.empty(c, dtype=torch.float32, device=zs.device)
    live = zt is not None
    kind = _KIND[spec.kind]
    backwards = not (live and kind == 2)
    if grad_out is not None:
        dz = grad_out
    else:
        dz = _grad_out(zs, grad_dtype, backwards) if need_grad else zs
    if c == 0:
        return loss, dz if need_grad else None
    # labels come with ce_weight > 0, or to report the cross-entropy alone (ce_out)
    has_ce = labels is not None and (bool(spec.ce_weight) or ce_out is not None)
    flags = dict(
        HAS_CE=has_ce, CE_GRAD=has_ce and bool(spec.ce_weight) and need_grad,
        CE_SEP=has_ce and spec.temperature != 1.0, WRITE_CE=has_ce and ce_out is not None,
        HAS_SCALE=row_scale is not None, NEED_GRAD=need_grad,
        ALIAS=grad_out is None and dz.dtype != zs.dtype, LANE=row_fixup == "lane",
    )
    ptrs = (loss, ce_out if ce_out is not None else loss,
            labels if labels is not None else loss,
            row_scale.float() if row_scale is not None else loss)
    scalars = (1.0 / spec.temperature, spec.beta, float(spec.ce_weight),
               spec.divergence_factor)
    if live:
        block, warps = row_config or CONFIG["live"]
        # tile stats: (student, teacher) tensors, pointer and plane size of each
        st_s, st_t = stats if stats is not None else (loss, loss)
        nt = st_s.shape[-1] if stats is not None else 1
        if stats is not None and st_s.shape[0] < 2 + 2 * flags["CE_SEP"]:
            raise ValueError("the student's tile stats lack the untempered planes of the CE")
        planes = (st_s[0].numel(), st_t[0].numel()) if stats is not None else (0, 0)
        _live_fwd_kernel[(c,)](
            zs, zt, dz, *ptrs, st_s, nt, planes[0], st_t, planes[1],
            v, zs.stride(0), zt.stride(0), dz.stride(0), *scalars,
            KIND=kind, BLOCK=min(block, triton.next_power_of_2(v)), num_warps=warps,
            STATS=stats is not None, BLOCK_T=min(1024, triton.next_power_of_2(nt)), **flags,
        )
    else:
        if stats is not None:
            raise ValueError("tile stats are for a live teacher; cached rows take none")
        k = target_ids.shape[1]
        if k > MAX_K:
            raise ValueError(f"K={k} cached ids per row: the Triton kernel holds at most "
                             f"{MAX_K} in registers")
        block, warps = row_config or CONFIG["sparse"]
        _sparse_fwd_kernel[(c,)](
            zs, dz, target_ids, target_logprobs, *ptrs, v, k, zs.stride(0), dz.stride(0),
            target_ids.stride(0), target_logprobs.stride(0), *scalars, TAIL_FLOOR,
            KIND=kind, RENORM=spec.sparse_mode == "renormalize", HAS_TAIL=k < v,
            BLOCK=min(block, triton.next_power_of_2(v)), BLOCK_K=triton.next_power_of_2(k),
            PREFETCH=prefetch, num_warps=warps, **flags,
        )
    return loss, dz if need_grad else None
