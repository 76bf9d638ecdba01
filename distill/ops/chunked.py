"""The fused linear divergence's chunk loop: chunked GEMMs + a row kernel, gradients in forward.

For each chunk of trained rows: project student (and teacher) hidden states to fp32
logits, let the row kernel compute the loss and d loss / d logits (Triton on CUDA, the
PyTorch math in `divergence_torch.py` on CPU), then fold that gradient into d hidden and
d weight. Only (chunk x V) logits exist at any time. Because the op knows the per-token
weights up front, backward only scales the stored gradients by grad_output.

On CUDA with a live teacher the logits come from `logits_gemm` (a Triton GEMM whose
epilogue also emits per-tile softmax statistics, so the row kernel reads each row once),
and the gradients of FOLD_GROUP chunks are folded together. Elsewhere the GEMMs are
cuBLAS / PyTorch and the gradient is written over the chunk's logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distill.ops.divergence_torch import rows_loss_and_grad as torch_rows
from distill.ops.spec import HeadTransform, check_row_fixup

# Bytes the op may hold per chunk: fp32 logits (student + teacher) and, when chunks are
# folded in groups, the group's gradient buffer; (nearly) all its memory beyond the grads.
CHUNK_BUDGET_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}
# With a live teacher, the gradients of FOLD_GROUP consecutive chunks go to one buffer and
# meet the weight in one GEMM of K = FOLD_GROUP x chunk rows: fewer read-modify-writes of
# the whole d weight (docs/notes/kernels.md). Cached chunks are larger already.
FOLD_GROUP = {"live": 2, "cached": 1}
_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Tuning:
    """Knobs of the CUDA path for benchmarks and tuning (the defaults are the measured best;
    docs/notes/kernels.md): chunks folded per d weight GEMM (None: FOLD_GROUP), the Triton
    logits GEMM with the softmax-stats epilogue (live teacher), its tile config
    (BM, BN, BK, num_warps, num_stages, tma_store; None: logits_gemm.CONFIG), how the row
    kernels find the largest logit they write last (spec.ROW_FIXUPS),
    their (BLOCK, num_warps) (None: divergence_triton.CONFIG), and whether the cached row
    kernel loads each block one ahead (its two passes stream the row with little math per
    byte: issued early, a load's latency hides under the math of the block before)."""

    fold_group: int | None = None
    stats_gemm: bool = True
    gemm_config: tuple[int, int, int, int, int, int] | None = None
    row_fixup: str = "lane"
    row_config: tuple[int, int] | None = None
    prefetch: bool = True

    def __post_init__(self):
        if self.fold_group is not None and self.fold_group < 1:
            raise ValueError(f"fold_group must be >= 1, got {self.fold_group}")
        if self.gemm_config is not None and len(self.gemm_config) != 6:
            raise ValueError(f"gemm_config={self.gemm_config!r}: give six integers, "
                             "BM, BN, BK, num_warps, num_stages, tma_store")
        check_row_fixup(self.row_fixup)
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"prefetch={self.prefetch!r}: give True or False")
        if self.row_config is not None and (
                len(self.row_config) != 2 or self.row_config[0] < 16
                or self.row_config[0] & (self.row_config[0] - 1)
                or self.row_config[1] not in (1, 2, 4, 8, 16, 32)):
            raise ValueError(f"row_config={self.row_config!r}: give (BLOCK, num_warps), "
                             "BLOCK a power of two >= 16, num_warps a power of two <= 32")


DEFAULT_TUNING = Tuning()


@dataclass
class Targets:
    """What the student is compared with, already restricted to the trained rows."""

    teacher_hidden: torch.Tensor | None = None  # (n, Ht)
    teacher_weight: torch.Tensor | None = None  # (V, Ht)
    teacher_head: HeadTransform | None = None
    ids: torch.Tensor | None = None  # (n, K) int64
    logprobs: torch.Tensor | None = None  # (n, K)


def resolve_backend(device: torch.device, backend: str = "auto") -> str:
    """'triton' on CUDA, 'torch' on CPU, unless asked otherwise."""
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"unknown backend {backend!r}: use 'auto', 'torch' or 'triton'")
    return backend


def pick_rows_fn(backend: str):
    """The row kernel of a backend: Triton, or the PyTorch math."""
    if backend == "torch":
        return torch_rows
    from distill.ops.divergence_triton import rows_loss_and_grad as triton_rows

    return triton_rows


def fold_group(live: bool, tuning: Tuning = DEFAULT_TUNING) -> int:
    """Chunks whose gradients are folded into d hidden / d weight together (Triton path)."""
    if tuning.fold_group is not None:
        return tuning.fold_group
    return FOLD_GROUP["live" if live else "cached"]


def choose_chunk_size(n_rows: int, vocab: int, live: bool, device: torch.device,
                      group: int = 1, grad_bytes: int = 2) -> int:
    """Rows per chunk: the chunk's fp32 logits (and, with group > 1, the group's gradient
    buffer of group x chunk rows) fill the budget, whatever N is."""
    budget = CHUNK_BUDGET_BYTES["cuda" if device.type == "cuda" else "cpu"]
    per_row = vocab * 4 * (2 if live else 1) + (vocab * grad_bytes * group if group > 1 else 0)
    chunk = max(1, budget // per_row)
    if chunk >= 256:
        chunk -= chunk % 128  # whole GEMM tiles
    return max(1, min(n_rows, chunk))


def _gemm_fp32(a, b, out):
    """a @ b into the fp32 `out`, accumulating in fp32 from 16-bit operands on CUDA."""
    if a.is_cuda and a.dtype == b.dtype and a.dtype in _HALF:
        # fp32 out of the GEMM: bf16 logits lose the small probabilities' gradients.
        try:
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        except (TypeError, RuntimeError):  # torch without the out= overload
            return out.copy_(torch.mm(a, b, out_dtype=torch.float32))
    return torch.mm(a.float(), b.float(), out=out)


def project(hidden, weight, head: HeadTransform | None, out):
    """fp32 logits (C, V) of one chunk, and the tanh of the soft-cap (for the chain rule)."""
    z = _gemm_fp32(hidden, weight.T, out)
    if head is None:
        return z, None
    if head.bias is not None:
        z += head.bias.float()
    if head.scale != 1.0:
        z *= head.scale
    if head.softcap is None:
        return z, None
    u = torch.tanh(z / head.softcap)
    return u * head.softcap, u


def chain_head(dz, u, head: HeadTransform | None):
    """d loss / d (hidden @ weight.T) from d loss / d logits."""
    if head is None:
        return dz
    if u is not None:
        dz = dz * (1 - u * u)
    return dz * head.scale if head.scale != 1.0 else dz


def fold(dz, h, ws, grad_h, grad_w, first):
    """grad_h = dz @ ws (this chunk's rows), grad_w (+)= dz.T @ h, without (C, V) copies.

    The first chunk writes grad_w instead of adding to it: no memset of a weight-sized
    buffer, no read of its zeros. A gradient given as None is not needed (a frozen head,
    a hidden state that is a leaf without grad): its GEMM is skipped.
    """
    if grad_h is None:
        pass
    elif dz.dtype == ws.dtype == grad_h.dtype:
        torch.mm(dz, ws, out=grad_h)
    else:
        grad_h.copy_(dz @ ws.to(dz.dtype))
    if grad_w is None:
        return
    if grad_w.dtype == dz.dtype == h.dtype:
        torch.mm(dz.T, h, out=grad_w) if first else grad_w.addmm_(dz.T, h)
    elif dz.is_cuda and dz.dtype == h.dtype and dz.dtype in _HALF:
        # fp32_weight_grad: accumulate in fp32 without an fp32 copy of dz
        if first:
            _gemm_fp32(dz.T, h, grad_w)
        else:
            try:
                torch.addmm(grad_w, dz.T, h, out_dtype=torch.float32, out=grad_w)
            except (TypeError, RuntimeError):  # torch without the out= overload
                grad_w += torch.mm(dz.T, h, out_dtype=torch.float32)
    elif first:
        torch.mm(dz.T.to(grad_w.dtype), h.to(grad_w.dtype), out=grad_w)
    else:
        grad_w.addmm_(dz.T.to(grad_w.dtype), h.to(grad_w.dtype))


def _stats_gemm_options(backend, hs, ws, targets: Targets, spec, labels, ce_sum,
                        student_head, tuning: Tuning):
    """(1 / T, untempered?) when the logits come from the Triton GEMM that also emits the
    softmax stats (live teacher, no head transforms, operands it takes), else None."""
    # Live teacher only: for cached targets pass 1 reads 4 B per logit, less than the
    # Triton GEMM costs over cuBLAS (docs/notes/kernels.md).
    if backend != "triton" or targets.teacher_hidden is None:
        return None
    if student_head is not None or targets.teacher_head is not None:
        return None
    if not tuning.stats_gemm:
        return None
    from distill.ops import logits_gemm
    from distill.ops.divergence_triton import untempered_stats

    # auto on CUDA: 16-bit operands (fp32 stays on cuBLAS); asked for: any, e.g. tests on CPU
    fast = hs.dtype in _HALF or not hs.is_cuda
    if not (fast and logits_gemm.supported(hs, ws)
            and logits_gemm.supported(targets.teacher_hidden, targets.teacher_weight)):
        return None
    return 1.0 / spec.temperature, untempered_stats(spec, labels, ce_sum), tuning.gemm_config


def _take_rows(x: torch.Tensor | None, sl: slice) -> torch.Tensor | None:
    return x[sl] if x is not None else None


def _chunk_logits(h, ws, targets: Targets, sl, zs_buf, zt_buf, student_head, stats_opts):
    """One chunk's fp32 logits: (student, teacher or None, the student soft-cap's tanh or
    None, the (student, teacher) tile stats or None)."""
    c = h.shape[0]
    if stats_opts is not None:
        from distill.ops.logits_gemm import logits_and_stats

        inv_t, untempered, config = stats_opts
        zs, zt = zs_buf[:c], zt_buf[:c]
        tile, store = (config[:5], config[5]) if config else (None, None)
        st_t = logits_and_stats(targets.teacher_hidden[sl], targets.teacher_weight, zt,
                                inv_t=inv_t, config=tile, tma_store=store)
        st_s = logits_and_stats(h, ws, zs, inv_t=inv_t, untempered=untempered, config=tile,
                                tma_store=store)
        return zs, zt, None, (st_s, st_t)
    zs, us = project(h, ws, student_head, zs_buf[:c])
    zt = None
    if targets.teacher_hidden is not None:
        zt, _ = project(targets.teacher_hidden[sl], targets.teacher_weight,
                         targets.teacher_head, zt_buf[:c])
    return zs, zt, us, None


def fused_rows(hs, ws, targets: Targets, labels, weights, spec, *, need_grad, chunk_size,
               fp32_weight_grad, backend="auto", student_head=None, ce_sum=None,
               needs=(True, True, True), tuning: Tuning = DEFAULT_TUNING):
    """Loss sum_i w_i loss_i over the given rows, and (grad_hidden, grad_weight, grad_bias).

    `ce_sum`, a 0-dim fp32 tensor, receives sum_i w_i ce_i when given (for logging the
    divergence and the cross-entropy apart). With `need_grad`, `needs` says which of the
    three gradients to compute; the others are None and cost nothing (a frozen LM head,
    e.g. under LoRA, skips the d weight GEMM and its weight-sized buffer).
    """
    n, vocab = hs.shape[0], ws.shape[0]
    backend = resolve_backend(hs.device, backend)
    rows_fn = pick_rows_fn(backend)
    live = targets.teacher_hidden is not None
    loss = None  # the first chunk's sum starts it: no fill kernel before the first GEMM
    grad_h = grad_w = grad_b = None
    need_h, need_w, need_b = needs if need_grad else (False, False, False)
    need_b = need_b and student_head is not None and student_head.bias is not None
    need_grad = need_h or need_w or need_b
    if need_h:
        grad_h = torch.empty_like(hs)
    if need_w:
        wdtype = torch.float32 if (fp32_weight_grad or not hs.is_cuda) else ws.dtype
        alloc = torch.zeros if n == 0 else torch.empty  # the first fold writes it all
        grad_w = alloc(ws.shape, dtype=wdtype, device=ws.device)
    if need_b:
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=ws.device)
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=hs.device), (grad_h, grad_w, grad_b)
    # Without a head transform the row kernel itself applies the token weights and writes
    # the gradient in the GEMMs' dtype (over the student logits, or into the fold buffer):
    # no (C, V) temporaries.
    in_kernel = student_head is None
    gdtype = ws.dtype if (hs.is_cuda and ws.dtype in _HALF and in_kernel) else torch.float32
    # folding chunks together only saves d weight accumulations
    group = fold_group(live, tuning) if (in_kernel and need_w and backend == "triton") else 1
    chunk = min(n, chunk_size or choose_chunk_size(n, vocab, live, hs.device, group,
                                                   gdtype.itemsize))
    stats_opts = _stats_gemm_options(backend, hs, ws, targets, spec, labels, ce_sum,
                                     student_head, tuning)
    # one buffer per model, reused by every chunk: memory stays flat in N
    zs_buf = torch.empty((chunk, vocab), dtype=torch.float32, device=hs.device)
    zt_buf = torch.empty_like(zs_buf) if live else None
    span = min(n, chunk * group)  # rows whose gradients meet the weight in one GEMM
    dz_buf = torch.empty((span, vocab), dtype=gdtype, device=hs.device) if group > 1 else None
    ce_rows = torch.empty(chunk, dtype=torch.float32, device=hs.device)
    for f0 in range(0, n, span):
        fsl = slice(f0, min(n, f0 + span))
        for start in range(f0, fsl.stop, chunk):
            sl = slice(start, min(fsl.stop, start + chunk))
            c, h = sl.stop - start, hs[sl]
            zs, zt, us, stats = _chunk_logits(h, ws, targets, sl, zs_buf, zt_buf,
                                              student_head, stats_opts)
            lab = labels[sl] if labels is not None else None
            w = weights[sl]
            opts = dict(ce_out=ce_rows[:c] if (ce_sum is not None and lab is not None) else None)
            if in_kernel:
                opts.update(row_scale=w, grad_dtype=gdtype)
            if backend == "triton":
                opts.update(row_fixup=tuning.row_fixup, row_config=tuning.row_config,
                            prefetch=tuning.prefetch)
            if stats is not None:
                opts["stats"] = stats
            if dz_buf is not None:
                opts["grad_out"] = dz_buf[start - f0:sl.stop - f0]
            row_loss, dz = rows_fn(zs, zt, _take_rows(targets.ids, sl),
                                   _take_rows(targets.logprobs, sl), lab, spec, need_grad,
                                   **opts)
            part = (row_loss @ w).float()
            loss = part if loss is None else loss.add_(part)
            if opts["ce_out"] is not None:
                ce_sum += opts["ce_out"] @ w
            if not need_grad or dz_buf is not None:
                continue
            if not in_kernel:
                dz = chain_head(dz * w[:, None], us, student_head)  # (C, V) fp32
                if grad_b is not None:
                    grad_b += dz.sum(0)
                dz = dz.to(ws.dtype) if hs.is_cuda else dz
            fold(dz, h, ws, _take_rows(grad_h, sl), grad_w, first=start == 0)
        if need_grad and dz_buf is not None:
            fold(dz_buf[:fsl.stop - f0], hs[fsl], ws, _take_rows(grad_h, fsl), grad_w,
                  first=f0 == 0)
    return loss, (grad_h, grad_w, grad_b)
