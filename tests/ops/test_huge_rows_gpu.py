"""GPU only: the live row math on the "huge" inputs of test_gpu_every_regime (bf16,
V = 32000, 64 rows, |z| up to ~4e4, T = 0.7), row by row and stage by stage, so that one
run says where a loss error comes from: the GEMM's logits, its tile stats, the row
kernel with the stats or with its own pass 1, with or without the gradient written over
the logits, the divergence or the cross-entropy, or the chunked op around them.

Each row's loss is held to 1e-5 relative (EXTREME_LOSS_TOL) plus the fp32 rounding of
the tempered logits (TEMPERED_ULPS, twice), its CE likewise; the message lists every
stage's worst rows.
"""

import pytest
import torch

from distill.losses import linear_divergence
from tests.losses.helpers import EXTREME_LOSS_TOL, TEMPERED_ULPS, extreme_inputs, run_both
from tests.oracle import oracle_per_token

T, CE_WEIGHT = 0.7, 0.4


def _worst(name, err, tol, rows=3):
    bad = (err.abs() - tol).argsort(descending=True)[:rows].tolist()
    cells = ", ".join(f"row {i}: {err[i].item():+.4f} (tol {tol[i].item():.3f})" for i in bad)
    return f"{name}: max |err| {err.abs().max().item():.4f}; {cells}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl"])
def test_gpu_huge_rows_stage_by_stage(kind):
    from distill.ops.divergence_triton import rows_loss_and_grad
    from distill.ops.logits_gemm import logits_and_stats
    from distill.ops.spec import DivergenceSpec

    # drawn first, as in test_gpu_every_regime (same seed): the same rows
    x = extreme_inputs("huge", n=64, v=32000, gap=0.0, dtype=torch.bfloat16, device="cuda")
    keep = x["labels"] != -100
    hs, ht, lab = x["student_hidden"][keep], x["teacher_hidden"][keep], x["labels"][keep]
    ws, wt = x["student_weight"], x["teacher_weight"]
    spec = DivergenceSpec(kind, temperature=T, ce_weight=CE_WEIGHT)  # the kernel's argument
    zs64, zt64 = hs.double() @ ws.double().T, ht.double() @ wt.double().T
    div, ce = oracle_per_token(zs64.cpu(), zt64.cpu(), labels=lab.cpu(), kind=kind,
                               temperature=T, ce_weight=CE_WEIGHT)
    ref = (div + CE_WEIGHT * ce).to(zs64.device)
    ce_ref = torch.logsumexp(zs64, -1) - zs64.gather(1, lab[:, None])[:, 0]
    scale = torch.maximum(zs64.abs().amax(1), zt64.abs().amax(1)) / T
    tol = EXTREME_LOSS_TOL[0] * ref.abs() + 2 * TEMPERED_ULPS * scale
    tol_ce = EXTREME_LOSS_TOL[0] * ce_ref.abs() + 2 * TEMPERED_ULPS * scale
    c, v = zs64.shape
    lines, ok = [], True

    zs, zt = torch.empty(c, v, device="cuda"), torch.empty(c, v, device="cuda")
    st_s = logits_and_stats(hs, ws, zs, inv_t=1 / T, untempered=True)
    st_t = logits_and_stats(ht, wt, zt, inv_t=1 / T)
    gemm_err = max((zs.double() - zs64).abs().max().item(),
                   (zt.double() - zt64).abs().max().item())
    lines.append(f"GEMM logits max |err| {gemm_err:.3g} (exact: one-hot hidden)")
    ok &= gemm_err == 0
    for stats in (True, False):
        for need_grad in (False, True):
            ce = torch.empty(c, device="cuda")
            loss, _ = rows_loss_and_grad(
                zs.clone(), zt.clone(), None, None, lab, spec, need_grad,
                grad_dtype=torch.bfloat16, ce_out=ce, stats=(st_s, st_t) if stats else None)
            err, err_ce = loss.double() - ref, ce.double() - ce_ref
            name = f"stats={stats} grad={need_grad}"
            lines += [_worst(name + " loss", err.cpu(), tol.cpu()),
                      _worst(name + " ce", err_ce.cpu(), tol_ce.cpu())]
            ok &= bool((err.abs() <= tol).all() and (err_ce.abs() <= tol_ce).all())
    for chunk in (24, 64):
        (lg, _), (lr, _) = run_both(x, linear_divergence, kind=kind, temperature=T,
                                    ce_weight=CE_WEIGHT, chunk_size=chunk)
        lines.append(f"op chunk={chunk}: loss {lg.item():.4f} vs {lr.item():.4f}")
        ok &= abs(lg.item() - lr.item()) <= EXTREME_LOSS_TOL[0] * abs(lr.item()) + 1e-6
    assert ok, "\n".join(lines)
