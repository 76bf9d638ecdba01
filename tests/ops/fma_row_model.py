"""A float64 model of the live row math on test_gpu_every_regime's inputs (seed 0, bf16,
V = 32000, 64 rows, T = 0.7, ce_weight 0.4), one softmax formulation per column, to tell
which one the H200 ran (docs/notes/kernels.md, "Contraction at |z| / T ~ 1e4").

The GPU contracts a * b - c into one FMA (Triton's default fp fusion); numpy never does,
so the interpreter cannot show it. Here an FMA is the exactly rounded z * inv_t - m: a
bf16 times an fp32 is exact in float64, and so is the difference with m.

    PYTHONPATH=. python tests/ops/fma_row_model.py [huge|onehot]
"""

import sys

import numpy as np
import torch

from tests.losses.helpers import extreme_inputs
from tests.oracle import oracle_loss

T, CE_WEIGHT = 0.7, 0.4
F32 = np.float32
INV_T = F32(1.0 / T)


def fma(a, b, c):
    return (a.astype(np.float64) * np.float64(b) + c.astype(np.float64)).astype(F32)


def log_softmax(z, mode):
    """fp32 log softmax(z / T) rows as each formulation computes them."""
    if mode == "exact":
        a = z.astype(np.float64) / T
        a = a - a.max(1, keepdims=True)
        return a - np.log(np.exp(a).sum(1, keepdims=True))
    if mode in ("unfused", "before", "after"):  # max of the rounded products fl(z / T)
        a = (z * INV_T).astype(F32)
        m = a.max(1, keepdims=True)
        s = np.exp(a - m).astype(F32).sum(1, keepdims=True, dtype=F32)  # the stats' sum
        ls = np.log(s).astype(F32)
        if mode == "unfused":
            return ((a - m).astype(F32) - ls).astype(F32)
        if mode == "before":  # before fd10ae4: fma(z, inv_t, -(m + log s))
            return fma(z, INV_T, -(m + ls).astype(F32))
        return (fma(z, INV_T, -m) - ls).astype(F32)  # fd10ae4: fma(z, inv_t, -m) - log s
    m = z.max(1, keepdims=True)  # the fix: max z, exponents (z - m) * inv_t
    d = (z - m).astype(F32)
    ls = np.log(np.exp((d * INV_T).astype(F32)).sum(1, keepdims=True, dtype=F32)).astype(F32)
    if mode == "fix":
        return ((d * INV_T).astype(F32) - ls).astype(F32)
    return fma(d, INV_T, -ls)  # "fix_fma": its last subtraction contracted


def mean_loss(kind, zs, zt, labels, mode):
    """The op's loss: the mean over labelled rows of divergence + ce_weight * CE."""
    lq = log_softmax(zs, mode).astype(np.float64)
    lp = log_softmax(zt, mode).astype(np.float64)
    q, p = np.exp(lq), np.exp(lp)
    div = (p * (lp - lq)).sum(1) if kind == "forward_kl" else (q * (lq - lp)).sum(1)
    z = zs.astype(np.float64)
    m = z.max(1)
    ce = m - z[np.arange(len(z)), np.maximum(labels, 0)] + np.log(np.exp(z - m[:, None]).sum(1))
    valid = labels != -100
    return ((div + CE_WEIGHT * ce) * valid).sum() / valid.sum(), div * valid


def main(case):
    torch.manual_seed(0)  # tests/conftest.py's autouse seed
    x = extreme_inputs(case, n=64, v=32000, gap=0.0, dtype=torch.bfloat16, device="cpu")
    zs = (x["student_hidden"].double() @ x["student_weight"].double().T).numpy().astype(F32)
    zt = (x["teacher_hidden"].double() @ x["teacher_weight"].double().T).numpy().astype(F32)
    labels = x["labels"].numpy()
    modes = ("exact", "unfused", "before", "after", "fix", "fix_fma")
    for kind in ("forward_kl", "reverse_kl") if case == "huge" else ("forward_kl",):
        args = {k: (v.double() if v.is_floating_point() else v) for k, v in x.items()}
        ref = oracle_loss(**args, kind=kind, temperature=T, ce_weight=CE_WEIGHT).item()
        out = {mode: mean_loss(kind, zs, zt, labels, mode) for mode in modes}
        print(f"{case} {kind}: reference {ref:.4f}; "
              + ", ".join(f"{mode} {loss:.4f}" for mode, (loss, _) in out.items()))
        err = out["after"][1] - out["exact"][1]
        worst = np.argsort(-np.abs(err))[:4]
        print(f"  fd10ae4's worst rows {worst.tolist()}: {err[worst].round(2).tolist()} nats")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "huge")
