"""Where distill's whole step spends its GPU time, by kernel group, beside the teacher forward.

    python bench/profile_step.py --out $OUT/prof --compile       # GPU: the llama pair
    python bench/profile_step.py --out /tmp/prof --tiny          # CPU: the code path

The lever table (bench/bench_levers.py) says how long the step takes; this says what fills
it. One process builds the pair at real shapes (bench/bench_train_steps.py), applies the
levers, times the teacher forward and the step (median of --reps after warm-up), then
profiles one teacher forward and two steps and sums each kernel's device time into groups
(GEMMs, attention, distill's loss kernels, inductor's fused kernels, eager elementwise,
the optimizer's foreach kernels, copies...). Beside it, three small A/Bs that decide
levers: the attention backends of sdpa at both models' shapes, foreach against fused
AdamW on the student's parameters, and the logits GEMM of the loss (distill's Triton GEMM
with the softmax-stats epilogue against cuBLAS) at both hidden sizes. Prints tables;
writes profile.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

# (group, pattern) in order: the first pattern that matches a kernel's name names its group
GROUPS = [
    ("distill loss: logits GEMM + stats", r"_logits_stats_kernel"),
    ("distill loss: row kernels", r"_live_fwd_kernel|_sparse_fwd_kernel|_scale_kernel"),
    ("attention", r"flash|fmha|cudnn|attention|flex|sdpa"),
    ("GEMM (cuBLAS / CUTLASS)", r"gemm|nvjet|cutlass|xmma|cublas|Kernel2|s16816|sm90_"),
    ("optimizer + grad norm (foreach / fused)", r"multi_tensor|foreach|fused_adam|adam"),
    ("inductor fused (triton_*)", r"^triton_"),
    ("embedding / index / sort", r"embedding|index|scatter|gather|sort|radix|Sort"),
    ("reductions", r"reduce_kernel|Reduce"),
    ("elementwise (eager)", r"elementwise|vectorized|unrolled"),
    ("copies / fills", r"Memcpy|Memset|copy|fill|CatArray"),
]


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name):
            return group
    return "other"


def kernel_groups(trace: dict, steps: int) -> dict:
    """Per-step device ms by group, the top kernels, and busy / span."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e
              and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not events:
        return {}
    by_kernel = Counter()
    for e in events:
        by_kernel[e["name"]] += e["dur"]
    groups = Counter()
    for name, us in by_kernel.items():
        groups[group_of(name)] += us
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    busy = sum(by_kernel.values())
    return {"per_step_ms": {g: round(us / 1e3 / steps, 2) for g, us in groups.most_common()},
            "busy_ms_per_step": round(busy / 1e3 / steps, 2),
            "span_ms_per_step": round((end - start) / 1e3 / steps, 2),
            "top_kernels_ms_per_step": {n[:110]: round(us / 1e3 / steps, 2)
                                        for n, us in by_kernel.most_common(40)}}


def profile(fn, steps: int) -> dict:
    activities = [torch.profiler.ProfilerActivity.CUDA]  # kernels only: a small trace
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return kernel_groups(json.loads(path.read_text()), steps)


class Clocks:
    """nvidia-smi samples of SM clock, power and temperature while a block runs."""

    def __enter__(self):
        self.file = tempfile.NamedTemporaryFile("w+", suffix=".csv")
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                 "--format=csv,noheader,nounits", "-lms", "100"], stdout=self.file,
                stderr=subprocess.DEVNULL)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc):
        self.summary = {}
        if self.proc is None:
            return
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.file.seek(0)
        rows = [[float(x) for x in line.split(",")] for line in self.file
                if line.count(",") == 2 and "N/A" not in line]
        if rows:
            cols = list(zip(*rows))
            self.summary = {k: {"median": sorted(c)[len(c) // 2], "min": min(c), "max": max(c)}
                            for k, c in zip(("sm_mhz", "watts", "celsius"), cols)}


def median_ms(fn, warm: int, reps: int) -> float:
    """bench_train's timing (warm-up calls, then the median of CUDA-event timed calls)."""
    from bench_train import timed_ms

    return timed_ms(fn, SimpleNamespace(cuda=True), warm, reps)


# --- the A/Bs ------------------------------------------------------------------------------
def attention_backends(reps: int) -> list[dict]:
    """sdpa's backends at the llama student's (fwd + bwd, head dim 64) and teacher's (fwd,
    head dim 128) shapes: causal, 32 query heads on 8 key / value heads with enable_gqa, as
    transformers' sdpa path calls it when there is no mask."""
    from torch.nn.attention import SDPBackend

    rows = []
    for who, (b, h, s, d, train) in {"student": (16, 32, 2048, 64, True),
                                     "teacher": (16, 32, 2048, 128, False)}.items():
        q, k, v = (torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=train) for heads in (h, h // 4, h // 4))
        flops = 4 * b * h * s * s * d / 2 * (3.5 if train else 1)  # causal; bwd ~2.5x fwd
        for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
            run = functools.partial(_attention, q, k, v, getattr(SDPBackend, backend), train)
            try:
                ms = median_ms(run, 2, reps)
                rows.append({"who": who, "backend": backend, "ms": round(ms, 2),
                             "tflops": round(flops / ms / 1e9, 1)})
            except RuntimeError as err:
                rows.append({"who": who, "backend": backend, "error": str(err)[:160]})
    return rows


def _attention(q, k, v, backend, train: bool) -> None:
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    with sdpa_kernel([backend]):
        o = sdpa(q, k, v, is_causal=True, enable_gqa=True)
        if train:
            o.backward(torch.ones_like(o))


def optimizer_ab(student, reps: int) -> list[dict]:
    """clip_grad_norm_ + AdamW step on the student's fp32 parameters: foreach vs fused."""
    from distill.training.optim import adamw

    params = [p for p in student.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    rows = []
    for fused in (False, True):
        opt = adamw(params, lr=1e-5, weight_decay=0.01, fused=fused)
        ms = median_ms(functools.partial(_clip_and_step, params, opt), 2, reps)
        rows.append({"optimizer": "fused" if fused else "foreach", "ms": round(ms, 2)})
        opt.state.clear()
    for p in params:
        p.grad = None
    return rows


def _clip_and_step(params, opt) -> None:
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    opt.step()


def logits_gemm_ab(reps: int) -> list[dict]:
    """One 640-row chunk of the loss's logits GEMM at V = 128256: distill's Triton GEMM with
    the stats epilogue (fp32 out), cuBLAS fp32 out, cuBLAS bf16 out."""
    from distill.ops.logits_gemm import logits_and_stats

    rows = []
    for hidden in (2048, 4096):
        h = torch.randn(640, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(128256, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        out = torch.empty(640, 128256, device="cuda", dtype=torch.float32)
        cases = {"triton stats (fp32)": functools.partial(logits_and_stats, h, w, out),
                 "cuBLAS fp32 out": functools.partial(torch.mm, h, w.T,
                                                      out_dtype=torch.float32, out=out),
                 "cuBLAS bf16 out": functools.partial(torch.mm, h, w.T)}
        flops = 2 * 640 * 128256 * hidden
        for name, fn in cases.items():
            ms = median_ms(fn, 3, reps * 5)
            rows.append({"hidden": hidden, "gemm": name, "ms": round(ms, 3),
                         "tflops": round(flops / ms / 1e9, 1)})
    return rows


# --- main ----------------------------------------------------------------------------------
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_out/prof"))
    p.add_argument("--pair", default="llama", choices=["llama", "qwen"])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="speed.compile=true")
    p.add_argument("--foreach-adamw", action="store_true",
                   help="optimizer.fused=false (the default before fused AdamW on CUDA)")
    p.add_argument("--sdpa", default=None, help="an sdpa backend for the whole run "
                   "(FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION)")
    p.add_argument("--skip", default="", help="comma list of: step, attention, optimizer, gemm")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    out = {"args": {k: str(v) for k, v in vars(args).items()}}
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        out["gpu"] = torch.cuda.get_device_name()
    save = lambda: (args.out / "profile.json").write_text(json.dumps(out, indent=1))  # noqa: E731

    if "step" not in skip:
        out["step"] = step_profile(args, cuda)
        save()
    if cuda and "attention" not in skip:
        out["attention"] = attention_backends(args.reps * 3)
        save()
    if cuda and "gemm" not in skip:
        out["logits_gemm"] = logits_gemm_ab(args.reps)
        save()
    print(report(out))
    return out


def step_profile(args, cuda: bool) -> dict:
    from contextlib import nullcontext

    from bench_levers import rates, setup
    from bench_train_steps import distill_step, teacher_step

    if args.tiny:
        args.rows, args.seq = min(args.rows, 2), min(args.seq, 32)
    speed = {"compile": args.compile,
             "compile_backend": "aot_eager" if (args.compile and not cuda) else "inductor"}
    run, student, teacher, module, batch, applied = setup(args, speed, cuda)
    res = {"applied": applied}
    if args.foreach_adamw:
        from distill.training.optim import adamw
        params = [p for p in student.parameters() if p.requires_grad]
        module.optimizer = adamw(params, lr=1e-5, weight_decay=0.01, fused=False)
    ctx = nullcontext
    if args.sdpa and cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        # the chosen backend first, the others after it where it cannot take a call
        order = [getattr(SDPBackend, args.sdpa)] + [
            b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH) if b != getattr(SDPBackend, args.sdpa)]
        ctx = functools.partial(sdpa_kernel, order, set_priority=True)
    warm = 3 if args.compile else 1
    for kind, make in (("teacher", teacher_step), ("live", distill_step)):
        fn = functools.partial(_within, ctx, make(module, batch, run))
        if not cuda:
            for _ in range(warm + 1):
                fn()
            continue
        t0 = time.time()
        with Clocks() as clocks:
            ms = median_ms(fn, warm, args.reps)
        row = {k: round(v, 4) for k, v in rates(kind, ms, student, teacher, args).items()}
        row.update(wall_s=round(time.time() - t0, 1), clocks=clocks.summary,
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1),
                   profile=profile(fn, 1 if kind == "teacher" else 2))
        res["teacher forward" if kind == "teacher" else "step"] = row
    if cuda:
        res["step / teacher forward"] = round(res["step"]["ms"] / res["teacher forward"]["ms"], 3)
        if "optimizer" not in args.skip:
            res["optimizer"] = optimizer_ab(student, args.reps * 3)
    return res


def _within(ctx, fn) -> None:
    with ctx():
        fn()


def report(out: dict) -> str:
    lines = []
    st = out.get("step", {})
    if "step" in st:
        lines.append(f"applied: {st['applied']}; step {st['step']['ms']} ms "
                     f"(MFU {st['step']['mfu']:.1%}, {st['step']['tokens_per_s']} tok/s), "
                     f"teacher forward {st['teacher forward']['ms']} ms, ratio "
                     f"{st['step / teacher forward']}")
        for name in ("teacher forward", "step"):
            prof = st[name]["profile"]
            lines.append(f"\n| {name}: group | ms a step |\n|---|---|")
            lines += [f"| {g} | {ms} |" for g, ms in prof["per_step_ms"].items()]
            lines.append(f"| busy / span | {prof['busy_ms_per_step']} / "
                         f"{prof['span_ms_per_step']} |")
            lines.append(f"clocks: {st[name]['clocks']}")
    for key in ("optimizer", "attention", "logits_gemm"):
        rows = st.get(key) if key == "optimizer" else out.get(key)
        if rows:
            lines.append(f"\n{key}:")
            lines += [json.dumps(r) for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
