"""Logits GEMM with the softmax statistics in its epilogue (Triton).

z = hidden @ weight.T in fp32, written to a (C, V) buffer, and, for each row and each
BLOCK_N-column tile, the tile's max of z and sum of exp((z - max) / T) (and of
exp(z - max), for the cross-entropy when T != 1). The row kernel then combines V / BN
tile statistics per row instead of streaming the whole row once more: the first of its
passes over the logits disappears.

Stats layout, (P, C, NT) fp32, NT = cdiv(V, BN): planes 0, 1 are the max of z and the
tempered sum; with `untempered`, planes 2, 3 are the max and the untempered sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

# BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages; measured on an H200 at H = 4096,
# V = 128256 by scripts/bench_gemm.py (docs/notes/kernels.md)
CONFIG = {"gemm": (128, 256, 64, 8, 4),
          # logits store: 0 = per-thread stores; n = TMA stores of n column sub-tiles
          # (when the rows are 16-byte aligned)
          "tma_store": 0}


@triton.jit
def _tile_max_sum(z, valid, inv_t):
    """Row max of z and sum of exp((z - max) * inv_t) of a (BM, BN) tile, invalid entries
    excluded; the max stays in logit space (triton_math's docstring says why)."""
    z = tl.where(valid, z, float("-inf"))
    m = tl.max(z, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return m, tl.sum(tl.exp((z - m_safe[:, None]) * inv_t), 1)


@triton.jit
def _halves(x, BM: tl.constexpr, BN: tl.constexpr):
    """The left and right (BM, BN // 2) halves of a (BM, BN) tile."""
    return tl.split(tl.permute(tl.reshape(x, (BM, 2, BN // 2)), (0, 2, 1)))


@triton.jit
def _store_logits(acc, z_ptr, stride_z, z_desc, off_m, off_n, rows64, cols, valid,
                  BM: tl.constexpr, BN: tl.constexpr, TMA_STORE: tl.constexpr):
    """The fp32 tile to z: per-thread masked stores, or TMA stores of 1, 2 or 4 sub-tiles
    (the copy engine clips the edges)."""
    if TMA_STORE == 0:
        tl.store(z_ptr + rows64[:, None] * stride_z + cols[None, :], acc, mask=valid)
    elif TMA_STORE == 1:
        z_desc.store([off_m, off_n], acc)
    elif TMA_STORE == 2:
        a0, a1 = _halves(acc, BM, BN)
        z_desc.store([off_m, off_n], a0)
        z_desc.store([off_m, off_n + BN // 2], a1)
    else:
        a0, a1 = _halves(acc, BM, BN)
        a00, a01 = _halves(a0, BM, BN // 2)
        a10, a11 = _halves(a1, BM, BN // 2)
        z_desc.store([off_m, off_n], a00)
        z_desc.store([off_m, off_n + BN // 4], a01)
        z_desc.store([off_m, off_n + BN // 2], a10)
        z_desc.store([off_m, off_n + 3 * BN // 4], a11)


@triton.jit
def _epilogue(acc, z_ptr, stride_z, z_desc, st_ptr, C, V, NT, inv_t, off_m, pid_n,
              UNTEMPERED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              TMA_STORE: tl.constexpr):
    """Store a (BM, BN) fp32 logits tile and its rows' (max, sum exp) for tile pid_n."""
    rows = off_m + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rmask = rows < C
    valid = rmask[:, None] & (cols < V)[None, :]
    rows64 = rows.to(tl.int64)
    _store_logits(acc, z_ptr, stride_z, z_desc, off_m, pid_n * BN, rows64, cols, valid,
                  BM, BN, TMA_STORE)
    plane = C * NT
    sp = st_ptr + rows64 * NT + pid_n
    m, s = _tile_max_sum(acc, valid, inv_t)
    tl.store(sp, m, mask=rmask)
    tl.store(sp + plane, s, mask=rmask)
    if UNTEMPERED:
        m1, s1 = _tile_max_sum(acc, valid, 1.0)
        tl.store(sp + 2 * plane, m1, mask=rmask)
        tl.store(sp + 3 * plane, s1, mask=rmask)


@triton.jit
def _logits_stats_kernel(
    a_desc, b_desc,  # (C, H) hidden, (V, H) weight: TMA descriptors
    z_ptr, stride_z, z_desc,  # (C, V) fp32 out (a descriptor too, if TMA_STORE)
    st_ptr,  # (P, C, NT) fp32 out
    C, V, H, NT, inv_t,
    UNTEMPERED: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA_STORE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(C, BM)
    # consecutive programs share a weight tile: the weight streams from memory once
    pid_m = pid % num_m
    pid_n = pid // num_m
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BK)):
        a = a_desc.load([pid_m * BM, k * BK])
        b = b_desc.load([pid_n * BN, k * BK])
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    _epilogue(acc, z_ptr, stride_z, z_desc, st_ptr, C, V, NT, inv_t, pid_m * BM, pid_n,
              UNTEMPERED, BM, BN, TMA_STORE)


def _tma_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor needs contiguous, 16-byte aligned rows."""
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and (
        t.data_ptr() % 16 == 0)


def supported(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton GEMM takes these operands."""
    ok_dtype = hidden.dtype == weight.dtype and hidden.dtype in (
        torch.bfloat16, torch.float16, torch.float32)
    return ok_dtype and _tma_ok(hidden) and _tma_ok(weight)


def logits_and_stats(hidden, weight, out, *, inv_t=1.0, untempered=False, config=None,
                     tma_store=None):
    """z = hidden @ weight.T into the fp32 `out` (C, V); returns the (P, C, NT) stats.
    `config` (BM, BN, BK, num_warps, num_stages) and `tma_store` default to CONFIG."""
    bm, bn, bk, warps, stages = config or CONFIG["gemm"]
    tma_store = CONFIG["tma_store"] if tma_store is None else tma_store
    c, h = hidden.shape
    v = weight.shape[0]
    nt = triton.cdiv(v, bn)
    planes = 2 + 2 * untempered
    stats = torch.empty((planes, c, nt), dtype=torch.float32, device=hidden.device)
    if c == 0:
        return stats
    a_desc = TensorDescriptor.from_tensor(hidden, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    if tma_store and not _tma_ok(out):
        tma_store = 0  # rows not 16-byte aligned: per-thread stores
    z_desc = TensorDescriptor.from_tensor(out, [bm, bn // max(tma_store, 1)]) if tma_store else 0
    args = (a_desc, b_desc, out, out.stride(0), z_desc, stats, c, v, h, nt, inv_t)
    meta = dict(UNTEMPERED=untempered, BM=bm, BN=bn, BK=bk, TMA_STORE=tma_store, num_warps=warps,
                num_stages=stages, PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32")
    _logits_stats_kernel[(triton.cdiv(c, bm) * nt,)](*args, **meta)
    return stats
