"""The loss benchmark's probes: where one call's time goes (bench_loss.py's diagnostic flags).

    python bench/bench_loss.py --bt 8192 --breakdown    # GEMMs and row kernels apart
    python bench/bench_loss.py --profile --bt 2048      # kernel time, idle gaps, per kernel
    python bench/bench_loss.py --host --bt 2048         # the host's issue time, idle vs busy
    python bench/bench_loss.py --timeline --bt 2048     # host functions and kernels, one clock
    python bench/bench_loss.py --sparse-kernel          # the cached row kernel alone
    python bench/bench_loss.py --tune                   # the row kernels' block sizes
"""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

import torch
from bench_loss import DT, K, V, _time, clear_grads, make_inputs, methods


def breakdown(bt):
    """Where distill's time goes at one BT (live FKL): GEMMs as the op runs them, kernel alone."""
    from distill.ops import divergence_triton
    from distill.ops.chunked import choose_chunk_size

    x = make_inputs(bt)
    hs, ws, ht, wt = (x[k].detach() for k in ("hs", "ws", "ht", "wt"))
    c = choose_chunk_size(bt, V, True, hs.device)
    zs = torch.empty(c, V, device="cuda")
    zt = torch.empty(c, V, device="cuda")
    gh, gw = torch.empty_like(hs), torch.zeros_like(ws)
    dz = zs.view(DT)[:, V:]

    def gemms(which):
        for s in range(0, bt, c):
            h = hs[s:s + c]
            if "fwd" in which:
                torch.mm(h, ws.T, out_dtype=torch.float32, out=zs[:len(h)])
                torch.mm(ht[s:s + c], wt.T, out_dtype=torch.float32, out=zt[:len(h)])
            if "bwd" in which:
                torch.mm(dz[:len(h)], ws, out=gh[s:s + c])
                gw.addmm_(dz[:len(h)].T, h)

    zs.normal_(0, 3)
    zt.normal_(0, 3)
    out = {"chunk": c}
    for which in ("fwd", "bwd", "fwd+bwd"):
        out[f"chunked GEMMs {which} ms"] = _time(lambda which=which: gemms(which))
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        zs.normal_(0, 3)
        ms = _time(_kernel_call(zs, zt, None, kind)) * ((bt + c - 1) // c)
        out[f"kernel {kind} {divergence_triton.CONFIG['live']}, all chunks ms"] = ms
        passes = 26 if kind == "jsd" else 18  # bytes per logit: 2 or 3 reads of 8, a 2 write
        out[f"kernel {kind} GB/s at {passes} B per logit"] = bt * V * passes / ms / 1e6
    zs.normal_(0, 3)
    ms = _time(_kernel_call(zs, None, (x["ids"][:c], x["lps"][:c]), "forward_kl"))
    out[f"sparse kernel {divergence_triton.CONFIG['sparse']}, per chunk of {c} ms"] = ms
    return out


def profile(bt, names=("GEMM floor (4 live)", "distill live forward_kl")):
    """Per method: event-timed ms, the sum of its kernels' times, the idle gaps between
    them, and the time per kernel name, from a torch.profiler trace of one run."""
    x = make_inputs(bt)
    leaves = [x["hs"], x["ws"]]
    lines = [f"BT={bt}"]
    for name in names:
        fn, _ = methods(x, None)[name]
        ms = _time(fn, 5, before=lambda: clear_grads(leaves))
        clear_grads(leaves)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        clear_grads(leaves)
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                         key=lambda e: e.time_range.start)
        busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
        span = (kernels[-1].time_range.end - kernels[0].time_range.start) / 1e3
        gaps = sorted(((b.time_range.start - a.time_range.end) / 1e3, a.name[:40], b.name[:40])
                      for a, b in zip(kernels, kernels[1:]))[::-1]
        per = {}
        for e in kernels:
            n, t = per.get(e.name[:60], (0, 0.0))
            per[e.name[:60]] = (n + 1, t + e.time_range.elapsed_us() / 1e3)
        lines.append(f"{name}: events {ms:.2f} ms, kernels {busy:.2f} ms, span {span:.2f} ms, "
                     f"gaps {span - busy:.2f} ms, largest:")
        lines += [f"   gap {g:6.3f} ms after {a} before {b}" for g, a, b in gaps[:8]]
        lines += [f"   {t:8.3f} ms {n:4d}x {k}" for k, (n, t) in
                  sorted(per.items(), key=lambda kv: -kv[1][1])]
    return "\n".join(lines)


def host(bt, names, reps=9, top=25):
    """Per method: the host's time to issue one call (the Python until fn() returns, the
    device not waited for) against the call's whole time; the call's device time (CUDA
    events) started on an idle device and behind ~20 ms of queued work (where the host's
    launches hide: the difference is what the host costs a call), then a cProfile of one call's
    host side, by own time: where the launch overhead the device waits for comes from."""
    import cProfile
    import pstats

    x = make_inputs(bt)
    leaves = [x["hs"], x["ws"]]
    lines = [f"BT={bt}"]
    for name in names:
        fn, _ = methods(x, None)[name]
        fn()
        torch.cuda.synchronize()
        issue, whole, idle, busy = [], [], [], []
        for _ in range(reps):
            clear_grads(leaves)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            issue.append(1e3 * (t1 - t0))
            whole.append(1e3 * (time.perf_counter() - t0))
            for behind, out in ((False, idle), (True, busy)):
                clear_grads(leaves)
                torch.cuda.synchronize()
                if behind:  # the device spins while the host issues the call: no idle gaps
                    torch.cuda._sleep(40_000_000)
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                fn()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end))
        clear_grads(leaves)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        torch.cuda.synchronize()
        clear_grads(leaves)
        stats = pstats.Stats(prof).stats  # (file, line, fn) -> (cc, calls, own, cumulative, _)
        lines.append(f"{name}: host issue {statistics.median(issue):.2f} ms of "
                     f"{statistics.median(whole):.2f} ms; device time started idle "
                     f"{statistics.median(idle):.3f} ms, started behind queued work "
                     f"{statistics.median(busy):.3f} ms; the profiled call's functions, "
                     "by own time (us own / us cumulative / calls):")
        for (file, line, func), (_, calls, own, cum, _) in sorted(
                stats.items(), key=lambda kv: -kv[1][2])[:top]:
            lines.append(f"   {1e6 * own:8.1f} {1e6 * cum:8.1f} {calls:5d}  "
                         f"{Path(file).name}:{line}({func})")
    return "\n".join(lines)


def timeline(bt, names, depth=24, min_us=8.0):
    """Per method: one call's host and device on one clock (a torch.profiler trace with the
    Python functions): each distill / Triton / autograd function of at least `min_us` up to
    `depth` calls deep, each launch and each kernel, in ms from the call's start. Shows what
    the host does before the first GEMM reaches the device, and where the device waits."""
    import tempfile

    x = make_inputs(bt)
    leaves = [x["hs"], x["ws"]]
    lines = [f"BT={bt}"]
    keep = ("distill/", "triton/runtime", "triton/tools", "autograd", "bench_loss")
    for name in names:
        fn, _ = methods(x, None)[name]
        for _ in range(2):
            clear_grads(leaves)
            fn()
        clear_grads(leaves)
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts, with_stack=True) as prof:
            torch.zeros(1, device="cuda")  # the profiler's first launch costs ~2 ms: not here
            torch.cuda.synchronize()
            with torch.profiler.record_function("timed call"):
                fn()
            torch.cuda.synchronize()
        clear_grads(leaves)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            events = [e for e in json.loads(Path(f.name).read_text())["traceEvents"]
                      if e.get("ph") == "X" and "dur" in e]
        call = next(e for e in events if e["name"] == "timed call"
                    and e.get("cat") == "user_annotation")
        t0, t1 = call["ts"], call["ts"] + call["dur"]
        rows, stack = [], []
        for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            cat = e.get("cat", "")
            if cat in ("kernel", "gpu_memset", "gpu_memcpy"):
                rows.append((e["ts"], f"   GPU {e['dur'] / 1e3:7.3f}  {e['name'][:60]}"))
                continue
            if not t0 <= e["ts"] <= t1:
                continue
            if cat in ("cuda_runtime", "cuda_driver"):
                if "aunch" in e["name"] or "Memcpy" in e["name"] or "ynchron" in e["name"]:
                    rows.append((e["ts"], f"   cpu {e['dur'] / 1e3:7.3f}  "
                                          f"{'  ' * len(stack)}<{e['name']}>"))
                continue
            if cat != "python_function":
                continue
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            level = len(stack)
            stack.append(e["ts"] + e["dur"])
            if level <= depth and e["dur"] >= min_us and any(k in e["name"] for k in keep):
                label = re.sub(r".*site-packages/", "", e["name"])
                label = re.sub(r".*/distill/", "distill/", label)
                rows.append((e["ts"], f"   cpu {e['dur'] / 1e3:7.3f}  {'  ' * level}{label}"))
        lines.append(f"{name}: call {(t1 - t0) / 1e3:.3f} ms on the host "
                     "(ms from its start, duration, what)")
        lines += [f"{(ts - t0) / 1e3:8.3f} {text}" for ts, text in sorted(rows)]
    return "\n".join(lines)


def sparse_kernel(rounds=15, rows=2048, configs=((4096, 8), (2048, 8))):
    """The cached row kernel alone on one chunk of random logits, each (BLOCK, num_warps)
    with and without its loads one block ahead, in shuffled rounds (the logits restored
    before each call: the kernel writes its gradient over them)."""
    import random

    from distill.ops import divergence_triton
    from distill.ops.spec import DivergenceSpec

    g = torch.Generator(device="cuda").manual_seed(0)
    z0 = torch.randn(rows, V, device="cuda", generator=g) * 3
    ids = torch.randint(0, V, (rows, K), device="cuda", generator=g).int()
    lps = (torch.log_softmax(torch.randn(rows, K, device="cuda", generator=g), -1)
           - 0.1).to(DT)
    zs, w = torch.empty_like(z0), torch.full((rows,), 1.0 / rows, device="cuda")
    fns = {}
    for kind in ("forward_kl", "reverse_kl"):
        spec = DivergenceSpec(kind)
        for prefetch in (True, False):
            for cfg in configs:
                fns[f"{kind} prefetch={prefetch} {cfg}"] = (
                    lambda spec=spec, p=prefetch, cfg=cfg:
                    divergence_triton.rows_loss_and_grad(
                        zs, None, ids, lps, None, spec, True, row_scale=w, grad_dtype=DT,
                        row_config=cfg, prefetch=p))
    times = {name: [] for name in fns}
    order = random.Random(0)
    for _ in range(rounds + 1):  # the first round compiles
        names = list(fns)
        order.shuffle(names)
        for name in names:
            zs.copy_(z0)
            times[name].append(_time(fns[name], reps=1, warm=False))
    gb = rows * V * 10 / 1e9  # pass 1 reads 4 B a logit, pass 2 reads 4 and writes 2
    lines = [f"cached row kernel, {rows} rows x V={V}, K={K}: median of {rounds} rounds"]
    for name, t in times.items():
        med = statistics.median(t[1:])
        lines.append(f"   {name:40s} {med:7.3f} ms  {gb / med:5.2f} TB/s at 10 B/logit")
    return "\n".join(lines)


def _kernel_call(zs, zt, cached, kind):
    from distill.ops import divergence_triton
    from distill.ops.spec import DivergenceSpec

    ids, lps = cached or (None, None)
    spec = DivergenceSpec(kind)
    return lambda: divergence_triton.rows_loss_and_grad(zs, zt, ids, lps, None, spec, True,
                                                        grad_dtype=DT)


def tune(candidates=((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16))):
    """Pick (BLOCK, num_warps) of each row kernel at this V, on one chunk of random logits."""
    from distill.ops import divergence_triton
    from distill.ops.chunked import choose_chunk_size

    c = choose_chunk_size(1 << 20, V, True, torch.device("cuda"))
    zs, zt = torch.randn(c, V, device="cuda") * 3, torch.randn(c, V, device="cuda") * 3
    ids = torch.randint(0, V, (c, K), device="cuda")
    lps = torch.log_softmax(torch.randn(c, K, device="cuda"), -1) - 0.1
    found = {}
    for which, zt_, cached in (("live", zt, None), ("sparse", None, (ids, lps))):
        times = {}
        for cfg in candidates:
            divergence_triton.CONFIG[which] = cfg
            times[cfg] = _time(_kernel_call(zs, zt_, cached, "forward_kl"), reps=5)
        best = min(times, key=times.get)
        divergence_triton.CONFIG[which] = best
        found[which] = dict(best=best, ms={str(k): round(v, 3) for k, v in times.items()})
    return found
