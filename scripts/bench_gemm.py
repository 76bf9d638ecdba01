"""The logits GEMM alone: cuBLAS against the Triton GEMM with the softmax-stats epilogue.

One chunk of the fused op's forward (C rows, H = 4096, V = 128256, bf16 in, fp32 out),
median ms and TFLOP/s per variant, plus the error of the Triton logits and stats against
cuBLAS / torch. Decides whether pass 1 of the row kernel can move into the GEMM
(docs/notes/kernels.md).

    python scripts/bench_gemm.py --out bench_out/gemm
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from bench_loss import _time  # noqa: E402

from distill.ops.logits_gemm import logits_and_stats  # noqa: E402

H, V = 4096, 128256
CONFIGS = [  # (BM, BN, BK, warps, stages), tma_store
    ((128, 256, 64, 8, 4), 0),
    ((128, 256, 64, 8, 4), 4),
    ((128, 256, 64, 8, 3), 0),
    ((128, 256, 64, 8, 3), 2),
    ((128, 256, 64, 8, 3), 4),
    ((128, 128, 64, 4, 3), 0),
    ((128, 128, 64, 4, 3), 2),
    ((128, 128, 64, 8, 4), 1),
    ((128, 128, 64, 8, 4), 2),
]
VARIANTS = {"stats": {}}


def _ref_stats(z, inv_t, bn):
    c, v = z.shape
    nt = triton.cdiv(v, bn)
    a = torch.nn.functional.pad(z.double() * inv_t, (0, nt * bn - v), value=float("-inf"))
    a = a.view(c, nt, bn)
    m = a.amax(-1)
    return m, (a - m[..., None]).exp().sum(-1)


def run(c, reps):
    g = torch.Generator(device="cuda").manual_seed(c)
    a = (torch.randn(c, H, device="cuda", generator=g)).bfloat16()
    b = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    z = torch.empty(c, V, device="cuda")
    flop = 2 * c * V * H
    rows = {}

    def rec(name, ms):
        rows[name] = dict(ms=round(ms, 4), tflops=round(flop / ms / 1e9, 1))
        print(f"C={c} {name:55s} {ms:8.3f} ms {flop / ms / 1e9:7.1f} TFLOP/s", flush=True)

    rec("cublas bf16 out", _time(lambda: torch.mm(a, b.T), reps))
    rec("cublas fp32 out", _time(lambda: torch.mm(a, b.T, out_dtype=torch.float32, out=z), reps))
    ref = z.clone()
    inv_t = 0.5
    for cfg, tma in CONFIGS:
        for vname, kw in VARIANTS.items():
            name = f"triton {cfg} tma_store={tma} {vname}"
            try:
                def fn(cfg=cfg, kw=kw, tma=tma):
                    return logits_and_stats(a, b, z, inv_t=inv_t, config=cfg, tma_store=tma,
                                            **kw)
                z.fill_(float("nan"))
                st = fn()
                m, s = _ref_stats(ref, inv_t, cfg[1])
                err = max(((z - ref).norm() / ref.norm()).item(),
                          (st[0] - m).abs().max().item(), ((st[1] - s) / s).abs().max().item())
                rec(name, _time(fn, reps))
                rows[name]["err"] = err
            except Exception as exc:  # noqa: BLE001 - a config that does not compile
                rows[name] = dict(error=repr(exc)[:300])
                print(f"C={c} {name:55s} FAILED {repr(exc)[:200]}", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--c", type=int, nargs="+", default=[640, 1024])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("bench_out/gemm"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res = {str(c): run(c, args.reps) for c in args.c}
    res["env"] = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                      triton=triton.__version__)
    (args.out / "bench_gemm.json").write_text(json.dumps(res, indent=1))
    for c, rows in res.items():
        if c == "env":
            continue
        best = min((r["ms"], k) for k, r in rows.items() if "ms" in r and "triton" in k)
        print(f"C={c}: cublas fp32 {rows['cublas fp32 out']['ms']:.3f} ms, best triton "
              f"{best[0]:.3f} ms ({best[1]})")


if __name__ == "__main__":
    main()
