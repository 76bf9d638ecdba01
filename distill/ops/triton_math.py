"""Triton device functions for the row kernels: online softmax statistics, and the few
that keep the row math exact when one logit dominates (docs/notes/kernels.md).

A softmax normalizer is carried as (max, rest): the row's sum of exp is
exp(max) * (1 + rest), so the largest entry's 1 is never added to the small terms, which
fp32 would round away; log1p and expm1 finish it without cancellation.

Tempered softmaxes keep their max in logit space (m = max z; T > 0 keeps the order) and
form every exponent as (z - m) * inv_t: z - m is exact near the max (Sterbenz) and only a
small number is rounded. Never z * inv_t - m: at |z| / T ~ 1e4 the product's half-ulp
(~1e-3) lands in every exponent, differently wherever the compiler fuses it into an FMA
(docs/notes/kernels.md, "Conditioning").
"""

import triton
import triton.language as tl


@triton.jit
def _online(m, s, z, inv_t):
    """Fold a block z into a running (max z, sum of exp((z - max) * inv_t))."""
    m_new = tl.maximum(m, tl.max(z, 0))
    return m_new, s * tl.exp((m - m_new) * inv_t) + tl.sum(tl.exp((z - m_new) * inv_t), 0)


@triton.jit
def _logaddexp(x, y):
    hi = tl.maximum(x, y)
    return hi + tl.log(1.0 + tl.exp(tl.minimum(x, y) - hi))


@triton.jit
def _log1p(x):
    """log(1 + x) for x >= 0, to fp32's relative accuracy where x is tiny (a series there:
    log(1 + x) would round x away, and the GPU's log is not exact near 1)."""
    s = x * (1.0 - x * (0.5 - x * (1.0 / 3 - x * (0.25 - x * (0.2 - x * (1.0 / 6 - x / 7))))))
    return tl.where(x < 0.0625, s, tl.log(1.0 + x))


@triton.jit
def _expm1(x):
    """exp(x) - 1 for x <= 0, to fp32's relative accuracy where x is tiny."""
    s = x * (1.0 + x / 2 * (1.0 + x / 3 * (1.0 + x / 4 * (1.0 + x / 5 * (1.0 + x / 6 * (
        1.0 + x / 7))))))
    return tl.where(x > -0.0625, s, tl.exp(x) - 1.0)


@triton.jit
def _fold_rest(m, r, bm, br, inv_t):
    """Merge two (max, rest) pairs, each standing for exp(max * inv_t) * (1 + rest): the
    largest entry's 1 is never added to the small terms, where fp32 would round them away."""
    up = bm > m
    r_up = br + (1.0 + r) * tl.exp((m - bm) * inv_t)
    r_keep = r + (1.0 + br) * tl.exp((bm - m) * inv_t)
    r_new = tl.where(up, r_up, r_keep)
    return tl.maximum(m, bm), tl.where(bm == float("-inf"), r, r_new)


@triton.jit
def _rest_of(x, offs, inv_t):
    """(max, sum of exp((x - max) * inv_t) over the entries but the argmax) of a block."""
    bm, bi = tl.max(x, 0, return_indices=True)
    e = tl.exp((x - bm) * inv_t)
    return bm, tl.sum(tl.where((offs == bi) | (x == float("-inf")), 0.0, e), 0)


@triton.jit
def _track_ref(rm, ri, rg, acc, z, g, base, offs):
    """Running largest logit (rm at index ri, its gradient rg) and the sum `acc` of every
    other gradient entry: the largest entry's exact gradient is minus that sum. Three
    block reductions; a per-lane partial sum instead of the third costs 16-32 registers a
    thread, which halves the programs an SM holds (sm_90, ptxas)."""
    bm, bi = tl.max(z, 0, return_indices=True)
    hit = offs == bi
    g_bi = tl.sum(tl.where(hit, g, 0.0), 0)
    up = bm > rm
    acc += tl.sum(tl.where(hit, 0.0, g), 0) + tl.where(up, rg, g_bi)  # rg: the dethroned
    return tl.maximum(rm, bm), tl.where(up, base + bi, ri), tl.where(up, g_bi, rg), acc


@triton.jit
def _lane_ref(acc, first, hit, g, idx):
    """The largest logit's bookkeeping when its value is known (`hit`: z equals the row's
    max), with no reduction: each lane keeps the index of its first hit (`first`, -1
    before) and sums every other gradient entry into `acc`, later hits of the lane (ties)
    included. After the pass one lane's hit is the row's; the others' gradients are
    recomputed and added. Two BLOCK-shaped carries: BLOCK / (32 num_warps) registers each."""
    new = hit & (first < 0)
    return acc + tl.where(new, 0.0, g), tl.where(new, idx, first)
