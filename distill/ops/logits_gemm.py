"""Logits GEMM with the softmax statistics in its epilogue (CUDA, Triton).

z = hidden @ weight.T in fp32, written to a (C, V) buffer, and, for each row and each
BLOCK_N-column tile, the tile's max and sum of exp of the tempered logits z / T (and of the
untempered ones, for the cross-entropy when T != 1). The row kernel then combines ~V / 256
tile statistics per row instead of streaming the whole row once more: the first of its
passes over the logits disappears.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _tile_stats(a, valid):
    """Row max and sum of exp(a - max) of a (BM, BN) tile, masked columns excluded."""
    a = tl.where(valid, a, float("-inf"))
    m = tl.max(a, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(a - m_safe[:, None]), 1)
    return m, s


@triton.jit
def _logits_stats_kernel(
    a_desc, b_desc,  # (C, H) hidden, (V, H) weight: TMA descriptors
    z_ptr, stride_z,  # (C, V) fp32 out
    st_ptr,  # (NSETS, 2, C, NT) fp32 out: max and sum-exp per row and column tile
    C, V, H, NT, inv_t,
    NSETS: tl.constexpr,  # 0: no stats, 1: tempered, 2: tempered and untempered
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    STORE_Z: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(C, BM)
    # consecutive programs share a weight tile: the 1 GB weight streams from HBM once
    pid_m = pid % num_m
    pid_n = pid // num_m
    off_m = pid_m * BM
    off_n = pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BK)):
        a = a_desc.load([off_m, k * BK])
        b = b_desc.load([off_n, k * BK])
        acc = tl.dot(a, b.T, acc)
    rows = off_m + tl.arange(0, BM)
    cols = off_n + tl.arange(0, BN)
    rmask = rows < C
    valid = rmask[:, None] & (cols < V)[None, :]
    if STORE_Z:
        zp = z_ptr + rows.to(tl.int64)[:, None] * stride_z + cols[None, :]
        tl.store(zp, acc, mask=valid)
    if NSETS >= 1:
        plane = C * NT
        sp = st_ptr + rows.to(tl.int64) * NT + pid_n
        m, s = _tile_stats(acc * inv_t, valid)
        tl.store(sp, m, mask=rmask)
        tl.store(sp + plane, s, mask=rmask)
        if NSETS == 2:
            m1, s1 = _tile_stats(acc, valid)
            tl.store(sp + 2 * plane, m1, mask=rmask)
            tl.store(sp + 3 * plane, s1, mask=rmask)


@triton.jit
def _logits_stats_persistent(
    a_desc, b_desc, z_ptr, stride_z, st_ptr, C, V, H, NT, inv_t,
    NSETS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    STORE_Z: tl.constexpr, NUM_SMS: tl.constexpr,
):
    num_m = tl.cdiv(C, BM)
    num_tiles = num_m * NT
    k_tiles = tl.cdiv(H, BK)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m = tile % num_m
        pid_n = tile // num_m
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, k_tiles):
            a = a_desc.load([off_m, k * BK])
            b = b_desc.load([off_n, k * BK])
            acc = tl.dot(a, b.T, acc)
        rows = off_m + tl.arange(0, BM)
        cols = off_n + tl.arange(0, BN)
        rmask = rows < C
        valid = rmask[:, None] & (cols < V)[None, :]
        if STORE_Z:
            zp = z_ptr + rows.to(tl.int64)[:, None] * stride_z + cols[None, :]
            tl.store(zp, acc, mask=valid)
        if NSETS >= 1:
            plane = C * NT
            sp = st_ptr + rows.to(tl.int64) * NT + pid_n
            m, s = _tile_stats(acc * inv_t, valid)
            tl.store(sp, m, mask=rmask)
            tl.store(sp + plane, s, mask=rmask)
            if NSETS == 2:
                m1, s1 = _tile_stats(acc, valid)
                tl.store(sp + 2 * plane, m1, mask=rmask)
                tl.store(sp + 3 * plane, s1, mask=rmask)


def logits_and_stats(hidden, weight, out, *, inv_t=1.0, nsets=1, config=(128, 256, 64, 8, 3),
                     store_z=True, persistent=False):
    """z = hidden @ weight.T into the fp32 `out` (C, V), and the per-tile softmax stats.

    Returns a (nsets, 2, C, NT) fp32 tensor: [set][0] tile maxima, [set][1] sums of exp.
    """
    bm, bn, bk, warps, stages = config
    c, h = hidden.shape
    v = weight.shape[0]
    nt = triton.cdiv(v, bn)
    stats = torch.empty((max(nsets, 1), 2, c, nt), dtype=torch.float32, device=hidden.device)
    a_desc = TensorDescriptor.from_tensor(hidden, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    args = (a_desc, b_desc, out, out.stride(0), stats, c, v, h, nt, inv_t)
    meta = dict(NSETS=nsets, BM=bm, BN=bn, BK=bk, STORE_Z=store_z, num_warps=warps,
                num_stages=stages)
    tiles = triton.cdiv(c, bm) * nt
    if persistent:
        sms = torch.cuda.get_device_properties(hidden.device).multi_processor_count
        _logits_stats_persistent[(min(sms, tiles),)](*args, NUM_SMS=sms, **meta)
    else:
        _logits_stats_kernel[(tiles,)](*args, **meta)
    return stats
