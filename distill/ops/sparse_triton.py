"""The cached (top-k) row kernel: loss and d(loss)/d(logits) over the K ids and a tail.

One program per row. The K ids' logits are read into registers and set to -inf in the row
(the kernel consumes the logits), so pass 1 sums the tail, the entries off the top-k,
directly: never 1 - sum(q_k), which is 0 for a student whose top id is cached. The K + 1
categories are handled in registers; pass 2 writes every entry as its share of the tail,
then the K ids, then the row's largest logit as minus the sum of the others.
Launched by `divergence_triton.rows_loss_and_grad`.
"""

import triton
import triton.language as tl

from distill.ops.triton_math import (
    _expm1,
    _fold_rest,
    _lane_ref,
    _log1p,
    _logaddexp,
    _rest_of,
    _track_ref,
)


@triton.jit
def _categories(logq, lp, logq_t, p_t, kmask, beta, KIND: tl.constexpr):
    """Divergence over the K ids and the tail bucket, and d loss / d a of each category
    (da_k, da_t); the most likely category's from the others (they sum to zero)."""
    p, q = tl.exp(lp), tl.exp(logq)
    q_t = tl.exp(logq_t)
    lpt = tl.log(p_t)
    if KIND == 0:
        div = tl.sum(tl.where(kmask & (p > 0), p * (lp - logq), 0.0), 0)
        div += tl.where(p_t > 0, p_t * (lpt - logq_t), 0.0)
        da_k = q - p
        da_t = q_t - p_t
    else:
        if KIND == 1:
            gk = tl.where(q > 0, logq - lp, 0.0)
            gt = tl.where(q_t > 0, logq_t - lpt, 0.0)
            div = tl.sum(tl.where(kmask, q * gk, 0.0), 0) + q_t * gt
        else:
            logm = _logaddexp(lp + tl.log(beta), logq + tl.log(1.0 - beta))
            lmt = _logaddexp(lpt + tl.log(beta), logq_t + tl.log(1.0 - beta))
            tp = tl.sum(tl.where(kmask & (p > 0), p * (lp - logm), 0.0), 0)
            tp += tl.where(p_t > 0, p_t * (lpt - lmt), 0.0)
            gk = (1.0 - beta) * tl.where(q > 0, logq - logm, 0.0)
            gt = (1.0 - beta) * tl.where(q_t > 0, logq_t - lmt, 0.0)
            div = beta * tp + tl.sum(tl.where(kmask, q * gk, 0.0), 0) + q_t * gt
        c = tl.sum(tl.where(kmask, q * gk, 0.0), 0) + q_t * gt
        da_k = q * (gk - c)
        da_t = q_t * (gt - c)
    da_k = tl.where(kmask, da_k, 0.0)
    logq = tl.where(kmask, logq, float("-inf"))
    koffs = tl.arange(0, logq.shape[0])
    kref = tl.argmax(logq, 0)
    k_others = tl.sum(tl.where(koffs == kref, 0.0, da_k), 0)
    tail_ref = logq_t > tl.max(logq, 0)
    da_k_ref = tl.sum(tl.where(koffs == kref, da_k, 0.0), 0)
    da_k = tl.where(koffs == kref, tl.where(tail_ref, da_k, -(k_others + da_t)), da_k)
    da_t = tl.where(tail_ref, -(k_others + da_k_ref), da_t)
    return div, da_k, da_t


@triton.jit
def _sparse_fwd_kernel(
    zs_ptr,  # (C, V) fp32 student logits, consumed (the top-k entries become -inf)
    dz_ptr,  # (C, V) fp32/bf16/fp16 out: row_scale * d loss / d zs (may alias zs)
    ids_ptr,  # (C, K) int32/int64 cached top-k token ids
    lp_ptr,  # (C, K) fp16/bf16/fp32 their teacher log-probabilities (at T)
    loss_ptr,  # (C,) fp32 out: factor * divergence + ce_weight * ce
    ce_ptr,  # (C,) fp32 out: cross-entropy of the untempered student (if WRITE_CE)
    labels_ptr,  # (C,) int64 hard labels (if HAS_CE)
    scale_ptr,  # (C,) fp32 row scale of the gradient (if HAS_SCALE)
    V, K, stride_s, stride_d, stride_i, stride_l,
    inv_t, beta, ce_weight, factor, tail_floor,
    KIND: tl.constexpr, RENORM: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_CE: tl.constexpr,
    CE_GRAD: tl.constexpr, CE_SEP: tl.constexpr, WRITE_CE: tl.constexpr, HAS_SCALE: tl.constexpr,
    NEED_GRAD: tl.constexpr, ALIAS: tl.constexpr, LANE: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    zs_row = zs_ptr + row * stride_s
    dz_row = dz_ptr + row * stride_d
    offs = tl.arange(0, BLOCK)
    nb = (V + BLOCK - 1) // BLOCK
    ninf = float("-inf")
    zero = tl.zeros((), tl.float32)
    # the K ids in registers; then their logits are set to -inf in the row, so that pass 1
    # sums the tail (the entries off the top-k) directly instead of 1 - sum(q_k)
    koffs = tl.arange(0, BLOCK_K)
    kmask = koffs < K
    ids = tl.load(ids_ptr + row * stride_i + koffs, mask=kmask, other=0)
    lp = tl.load(lp_ptr + row * stride_l + koffs, mask=kmask, other=ninf).to(tl.float32)
    zk = tl.load(zs_row + ids, mask=kmask, other=ninf)
    label = 0
    zl = zero
    if HAS_CE:
        label = tl.load(labels_ptr + row)
        zl = tl.load(zs_row + label)
    tl.debug_barrier()
    tl.store(zs_row + ids, tl.zeros((BLOCK_K,), tl.float32) + ninf, mask=kmask)
    tl.debug_barrier()
    mt, rt, m1, r1 = zero + ninf, zero, zero + ninf, zero
    if PREFETCH:  # each block's load is issued one block ahead, under the math of the last
        ahead = tl.load(zs_row + offs, mask=offs < V, other=ninf)
    for i in range(0, nb):  # pass 1: the tail of softmax(zs / T) (and of softmax(zs))
        idx = i * BLOCK + offs
        if PREFETCH:
            zs = ahead
            ahead = tl.load(zs_row + idx + BLOCK, mask=idx + BLOCK < V, other=ninf)
        else:
            zs = tl.load(zs_row + idx, mask=idx < V, other=ninf)
        bm, br = _rest_of(zs, offs, inv_t)
        mt, rt = _fold_rest(mt, rt, bm, br, inv_t)
        if CE_SEP:
            bm, br = _rest_of(zs, offs, 1.0)
            m1, r1 = _fold_rest(m1, r1, bm, br, 1.0)
    mk, rk = _rest_of(zk, koffs, inv_t)
    ms, rs_ = _fold_rest(mt, rt, mk, rk, inv_t)
    # each log-sum-exp kept as (max z, log sum / exp(max / T)), the exponents
    # (z - max) / T, then the log sum: never z / T - (max / T + log sum), rounded at the
    # size of z / T (~4e-3 at |z| / T ~ 6e4; triton_math's docstring)
    ls = _log1p(rs_)  # the full normalizer, over ms
    lt = _log1p(rt)  # the tail's, over mt (mt = -inf without a tail)
    l1 = ls
    if CE_SEP:
        mk1, rk1 = _rest_of(zk, koffs, 1.0)
        m1, r1 = _fold_rest(m1, r1, mk1, rk1, 1.0)
        l1 = _log1p(r1)
    else:
        m1 = ms
    mp, rp = _rest_of(lp, koffs, 1.0)
    if RENORM:
        logq = (zk - mk) * inv_t - _log1p(rk)
        lp = lp - mp - _log1p(rp)
        logq_t, p_t = zero + ninf, zero
    else:
        logq = (zk - ms) * inv_t - ls
        logq_t = (mt - ms) * inv_t + (lt - ls)
        p_t = zero
        if HAS_TAIL:  # 1 - sum(p_k) as -expm1(log sum p_k): exact when the tail is tiny
            p_t = tl.maximum(-_expm1(tl.minimum(mp + _log1p(rp), 0.0)), 0.0)
        if KIND == 1:
            p_t = tl.maximum(p_t, tail_floor)  # else an empty teacher tail makes RKL infinite
    div, da_k, da_t = _categories(logq, lp, logq_t, p_t, kmask, beta, KIND)
    ce = zero
    if HAS_CE:
        ce = (m1 - zl) + l1
    tl.store(loss_ptr + row, factor * div + ce_weight * ce)
    if WRITE_CE:
        tl.store(ce_ptr + row, ce)
    if NEED_GRAD:
        _sparse_grad(zs_row, dz_row, dz_ptr, scale_ptr, row, V, ids, kmask, zk, label, mt,
                     lt, m1, l1, da_k, da_t, inv_t, factor * inv_t, ce_weight, CE_GRAD, HAS_SCALE,
                     ALIAS, BLOCK, RENORM, LANE, PREFETCH)


@triton.jit
def _tail_grad(zs, idx, mask, label, label_in_k, mt_safe, lt, m1, l1, g_t, inv_t, ce_weight,
               CE_GRAD: tl.constexpr):
    """Gradient of tail entries before the row scale: g_t, the tail's, in proportion to each
    entry's share of the tail, and the CE's. Also called after pass 2, at zs = mt, for a tie
    of the tail's largest logit."""
    g = g_t * tl.exp((zs - mt_safe) * inv_t - lt)
    if CE_GRAD:
        onehot = tl.where(idx == label, 1.0, 0.0) * (label_in_k == 0)  # else the ids
        g += ce_weight * (tl.exp((zs - m1) - l1) - onehot)
    return tl.where(mask, g, 0.0)


@triton.jit
def _sparse_grad(zs_row, dz_row, dz_ptr, scale_ptr, row, V, ids, kmask, zk, label, mt, lt,
                 m1, l1, da_k, da_t, inv_t, gf, ce_weight, CE_GRAD: tl.constexpr,
                 HAS_SCALE: tl.constexpr, ALIAS: tl.constexpr, BLOCK: tl.constexpr,
                 RENORM: tl.constexpr, LANE: tl.constexpr, PREFETCH: tl.constexpr):
    """Write the gradient: the tail entries share da_t in proportion to their part of the
    tail (pass 2, backwards), then the K ids, then the row's largest logit from the rest.
    With PREFETCH the block below is loaded while this one is written: the stores of a
    block b land at or above entry b * BLOCK (in place at the same entries, or a 16-bit
    gradient over the upper half of the fp32 row, ALIAS), never on a block below it."""
    offs = tl.arange(0, BLOCK)
    nb = (V + BLOCK - 1) // BLOCK
    ninf = float("-inf")
    zero = tl.zeros((), tl.float32)
    rs = 1.0
    if HAS_SCALE:
        rs = tl.load(scale_ptr + row)
    mt_safe = tl.where(mt == ninf, 0.0, mt)  # no tail: every zs below is -inf
    n_label_in_k = tl.sum(tl.where(kmask & (ids == label), 1, 0), 0)
    rm, ri, rg, acc = zero + ninf, tl.zeros((), tl.int32), zero, zero
    acc_l = tl.zeros((BLOCK,), tl.float32)  # LANE: per-lane sums, the lanes' first hits
    first = tl.full((BLOCK,), -1, tl.int32)
    if PREFETCH:
        last = (nb - 1) * BLOCK + offs
        ahead = tl.load(zs_row + last, mask=last < V, other=ninf)
    for i in range(0, nb):
        base = (nb - 1 - i) * BLOCK
        idx = base + offs
        mask = idx < V
        if PREFETCH:
            zs = ahead  # -inf at the K ids
            ahead = tl.load(zs_row + idx - BLOCK, mask=idx >= BLOCK, other=ninf)
        else:
            zs = tl.load(zs_row + idx, mask=mask, other=ninf)  # -inf at the K ids
        g = _tail_grad(zs, idx, mask, label, n_label_in_k, mt_safe, lt, m1, l1, gf * da_t,
                       inv_t, ce_weight, CE_GRAD)
        if LANE:
            # mt, the tail's max, is an element of the row. Without a tail (mt = -inf) the
            # K ids' -inf hit too: their g is 0 here, and a cached id is the largest
            acc_l, first = _lane_ref(acc_l, first, (zs == mt) & mask, g, idx)
        else:
            rm, ri, rg, acc = _track_ref(rm, ri, rg, acc, zs, g, base, offs)
        if HAS_SCALE:
            g = g * rs
        if ALIAS:
            tl.debug_barrier()  # the store may land on logits another warp reads
        tl.store(dz_row + idx, g.to(dz_ptr.dtype.element_ty), mask=mask)
    gk = gf * da_k
    if CE_GRAD:
        gk += ce_weight * (tl.exp((zk - m1) - l1) - tl.where(ids == label, 1.0, 0.0))
    gk = tl.where(kmask, gk, 0.0)
    # the largest logit is a cached id or in the tail: its gradient is minus the others'
    zk_m = tl.where(kmask, zk, ninf)
    kbest = tl.argmax(zk_m, 0)
    koffs = tl.arange(0, zk.shape[0])
    if LANE:
        rm = mt
        # the tail's entry written last, unless a cached id is larger: the other lanes'
        # first hits (ties with it, or all of them) were left out of acc_l
        ri = tl.where(tl.max(zk_m, 0) > mt, -1, tl.max(first, 0))
        tied = (first >= 0) & (first != ri)
        g = _tail_grad(tl.zeros((BLOCK,), tl.float32) + mt, first, tied, label, n_label_in_k,
                       mt_safe, lt, m1, l1, gf * da_t, inv_t, ce_weight, CE_GRAD)
        acc = tl.sum(acc_l + g, 0)
    top_in_k = tl.max(zk_m, 0) > rm
    k_others = tl.sum(tl.where(koffs == kbest, 0.0, gk), 0)
    gk = tl.where(koffs == kbest, tl.where(top_in_k, -(acc + rg + k_others), gk), gk)
    tl.debug_barrier()  # the top-k stores below must land after pass 2's
    tl.store(dz_row + ids, (gk * rs).to(dz_ptr.dtype.element_ty), mask=kmask)
    tl.debug_barrier()
    # renormalized top-k alone: the tail's entries are exactly 0 (pass 2 wrote them), so the
    # largest one is left as it is rather than set from the others' rounding
    if CE_GRAD or not RENORM:
        tl.store(dz_row + ri, (-(acc + tl.sum(gk, 0)) * rs).to(dz_ptr.dtype.element_ty),
                 mask=(tl.max(zk_m, 0) <= rm) & (ri >= 0))
