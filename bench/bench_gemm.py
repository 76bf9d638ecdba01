"""The logits GEMM alone: cuBLAS against the Triton GEMM with the softmax-stats epilogue.

One chunk of the fused op's forward (C rows, H = 4096 unless --hidden, V = 128256, bf16 in,
fp32 out),
median ms and TFLOP/s per variant, plus the error of the Triton logits and stats against
cuBLAS / torch. Decides whether pass 1 of the row kernel can move into the GEMM
(docs/notes/kernels.md).

    python bench/bench_gemm.py --out bench_out/gemm
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).parent))
from bench_loss import _time  # noqa: E402

from distill.ops.logits_gemm import logits_and_stats  # noqa: E402

V = 128256
CONFIGS = [  # (BM, BN, BK, warps, stages), tma_store
    ((128, 256, 64, 8, 3), 0),
    ((128, 256, 64, 8, 4), 0),
    ((128, 256, 64, 8, 2), 0),
    ((64, 256, 64, 4, 2), 0),
    ((64, 256, 64, 4, 3), 0),
    ((64, 256, 64, 4, 4), 0),
    ((128, 128, 64, 4, 3), 0),
    ((128, 128, 64, 4, 4), 0),
    ((128, 256, 128, 8, 2), 0),
]
VARIANTS = {"stats": {}}


@triton.jit
def _plain_kernel(a_desc, b_desc, z_ptr, stride_z, C, V, H, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr):
    """The same main loop as logits_gemm with a bare fp32 store: the epilogue's share."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(C, BM)
    pid_m, pid_n = pid % num_m, pid // num_m
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BK)):
        a = a_desc.load([pid_m * BM, k * BK])
        b = b_desc.load([pid_n * BN, k * BK])
        acc = tl.dot(a, b.T, acc)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    tl.store(z_ptr + rows[:, None] * stride_z + cols[None, :], acc,
             mask=(rows < C)[:, None] & (cols < V)[None, :])


def plain(a, b, z, cfg):
    bm, bn, bk, warps, stages = cfg
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b, [bn, bk])
    c, v = z.shape
    grid = (triton.cdiv(c, bm) * triton.cdiv(v, bn),)
    return _plain_kernel[grid](a_desc, b_desc, z, z.stride(0), c, v, a.shape[1], BM=bm,
                               BN=bn, BK=bk, num_warps=warps, num_stages=stages)


def resources(compiled):
    """Registers, spills and shared memory of a compiled kernel (what limits occupancy)."""
    try:
        return dict(regs=compiled.n_regs, spills=compiled.n_spills,
                    smem=compiled.metadata.shared)
    except AttributeError:
        return {}


def _compiled_stats_kernels():
    """The stats GEMM's compiled variants so far (Triton's per-device cache), by id."""
    from distill.ops import logits_gemm

    try:
        return {id(k): k for cache in logits_gemm._logits_stats_kernel.device_caches.values()
                for k in cache[0].values()}
    except (AttributeError, IndexError, TypeError):
        return {}


def _ref_stats(z, inv_t, bn):
    c, v = z.shape
    nt = triton.cdiv(v, bn)
    a = torch.nn.functional.pad(z.double() * inv_t, (0, nt * bn - v), value=float("-inf"))
    a = a.view(c, nt, bn)
    m = a.amax(-1)
    return m, (a - m[..., None]).exp().sum(-1)


def run(c, reps, configs, H=4096):
    g = torch.Generator(device="cuda").manual_seed(c)
    a = (torch.randn(c, H, device="cuda", generator=g)).bfloat16()
    b = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    z = torch.empty(c, V, device="cuda")
    flop = 2 * c * V * H
    rows = {}

    def rec(name, ms):
        rows[name] = dict(ms=round(ms, 4), tflops=round(flop / ms / 1e9, 1))
        print(f"C={c} {name:60s} {ms:8.3f} ms {flop / ms / 1e9:7.1f} TFLOP/s", flush=True)

    rec("cublas bf16 out", _time(lambda: torch.mm(a, b.T), reps))
    rec("cublas fp32 out", _time(lambda: torch.mm(a, b.T, out_dtype=torch.float32, out=z), reps))
    ref = z.clone()
    inv_t = 0.5
    for cfg, tma in configs:
        for vname, kw in VARIANTS.items():
            name = f"triton {cfg} tma_store={tma} {vname}"
            try:
                def fn(cfg=cfg, kw=kw, tma=tma):
                    return logits_and_stats(a, b, z, inv_t=inv_t, config=cfg, tma_store=tma,
                                            **kw)
                z.fill_(float("nan"))
                seen = _compiled_stats_kernels()
                st = fn()
                new = [k for i, k in _compiled_stats_kernels().items() if i not in seen]
                m, s = _ref_stats(ref, inv_t, cfg[1])
                err = max(((z - ref).norm() / ref.norm()).item(),
                          (st[0] - m).abs().max().item(), ((st[1] - s) / s).abs().max().item())
                rec(name, _time(fn, reps))
                rows[name]["err"] = err
                rows[name].update(resources(new[0]) if new else {})
                pname = f"triton {cfg} plain fp32 store (no stats)"
                if pname not in rows:
                    z.fill_(float("nan"))
                    compiled = plain(a, b, z, cfg)
                    perr = ((z - ref).norm() / ref.norm()).item()
                    rec(pname, _time(lambda cfg=cfg: plain(a, b, z, cfg), reps))
                    rows[pname].update(err=perr, **resources(compiled))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile
                rows[name] = dict(error=repr(exc)[:300])
                print(f"C={c} {name:55s} FAILED {repr(exc)[:200]}", flush=True)
    return rows


def parse_config(text: str):
    """"BM,BN,BK,warps,stages,tma_store" -> ((BM, BN, BK, warps, stages), tma_store)."""
    values = tuple(int(v) for v in text.split(","))
    if len(values) != 6:
        raise SystemExit(f"--configs {text}: give BM,BN,BK,warps,stages,tma_store")
    return values[:5], values[5]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--c", type=int, nargs="+", default=[640, 1024])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=4096, help="H, the GEMM's K")
    p.add_argument("--out", type=Path, default=Path("bench_out/gemm"))
    p.add_argument("--configs", nargs="*", help="BM,BN,BK,warps,stages,tma_store (default: all)")
    args = p.parse_args()
    configs = [parse_config(t) for t in args.configs] if args.configs else CONFIGS
    args.out.mkdir(parents=True, exist_ok=True)
    res = {str(c): run(c, args.reps, configs, args.hidden) for c in args.c}
    res["env"] = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                      triton=triton.__version__, hidden=args.hidden)
    (args.out / "bench_gemm.json").write_text(json.dumps(res, indent=1))
    for c, rows in res.items():
        if c == "env" or not isinstance(rows, dict) or "cublas bf16 out" not in rows:
            continue
        best = min((r["ms"], k) for k, r in rows.items() if "ms" in r and "stats" in k)
        print(f"C={c}: cublas bf16 {rows['cublas bf16 out']['ms']:.3f} ms, fp32 "
              f"{rows['cublas fp32 out']['ms']:.3f} ms, best stats GEMM {best[0]:.3f} ms "
              f"({best[1]})")
        for k, r in rows.items():
            if "regs" in r:
                print(f"  {k:60s} {r['ms']:7.3f} ms  {r['regs']:3d} regs  "
                      f"{r['spills']} spills  {r['smem'] // 1024:3d} KiB smem")


if __name__ == "__main__":
    main()
