"""Benchmark the fused linear divergence against its floor and its peers (one H200).

    python bench/bench_loss.py --out bench_out            # what docs/benchmarks.md shows
    python bench/bench_loss.py --bt 8192 --breakdown      # where distill's time goes

For each BT (tokens), in bf16 with H=4096, V=128256: forward+backward into the student
hidden states and LM-head weight, median time of several runs (CUDA events) and peak
memory above the inputs and their gradients (torch.cuda.max_memory_allocated delta).
Rows: the GEMM floor (the matrix products alone: 4 live, 3 cached), distill (live FKL /
RKL / JSD, cached top-64 FKL), torch eager and torch.compile on the full logits, Liger
Kernel's LigerFusedLinearJSD (jsd_beta 0 / 1 / 0.5) and LigerFusedLinearKLDivLoss (dense
target). Writes results.json, table.md and loss_bench.png to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from distill.losses import linear_divergence

H, V, K = 4096, 128256, 64
DT = torch.bfloat16
GIB = 1 << 30


def make_inputs(bt, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, std=1.0, grad=False):
        t = (torch.randn(*shape, device="cuda", generator=g) * std).to(DT)
        return t.requires_grad_(grad)

    # hidden ~ N(0, 1) after the final norm, weights scaled so logits have std ~3
    x = dict(hs=rnd(bt, H, grad=True), ws=rnd(V, H, std=3 / H**0.5, grad=True),
             ht=rnd(bt, H), wt=rnd(V, H, std=4 / H**0.5))
    with torch.no_grad():  # cached top-k of the teacher, computed in slices
        ids, lps = [], []
        for s in range(0, bt, 2048):
            lp = torch.log_softmax((x["ht"][s:s + 2048] @ x["wt"].T).float(), -1)
            top = lp.topk(K, -1)
            ids.append(top.indices.int())
            lps.append(top.values.to(DT))
        x["ids"], x["lps"] = torch.cat(ids), torch.cat(lps)
    return x


def _gemm_floor(x, live):
    hs, ws = x["hs"].detach(), x["ws"].detach()
    z = hs @ ws.T
    if live:
        x["ht"] @ x["wt"].T
    z @ ws  # d hidden
    z.T @ hs  # d weight


def methods(x, liger):
    """name -> (fn doing forward + backward, live?)."""
    hs, ws, ht, wt = x["hs"], x["ws"], x["ht"], x["wt"]
    out = {
        "GEMM floor (4 live)": (lambda: _gemm_floor(x, True), True),
        "GEMM floor (3 cached)": (lambda: _gemm_floor(x, False), False),
    }
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        out[f"distill live {kind}"] = (
            lambda kind=kind: linear_divergence(hs, ws, teacher_hidden=ht, teacher_weight=wt,
                                                kind=kind).backward(), True)
    out["distill cached top-64 forward_kl"] = (
        lambda: linear_divergence(hs, ws, target_ids=x["ids"], target_logprobs=x["lps"],
                                  kind="forward_kl").backward(), False)
    out["torch eager FKL (full logits)"] = (lambda: _eager_fkl(hs, ws, ht, wt).backward(), True)
    out["torch.compile FKL (full logits)"] = (
        lambda: _compiled_fkl(hs, ws, ht, wt).backward(), True)
    if liger is not None:
        jsd_cls, kl_cls = liger
        for beta in (0.0, 1.0, 0.5):
            loss = jsd_cls(jsd_beta=beta)
            out[f"Liger FusedLinearJSD beta={beta}"] = (
                lambda loss=loss: loss(hs, ws, ht, wt, None).backward(), True)
        if kl_cls is not None:
            kl = kl_cls()
            out["Liger FusedLinearKLDiv (dense target)"] = (
                lambda: kl(hs, ws, x["dense"]).backward(), False)
    return out


def _eager_fkl(hs, ws, ht, wt):
    logq = torch.log_softmax((hs @ ws.T).float(), -1)
    with torch.no_grad():
        logp = torch.log_softmax((ht @ wt.T).float(), -1)
    return F.kl_div(logq, logp, log_target=True, reduction="batchmean")


_compiled_fkl = torch.compile(_eager_fkl)


def clear_grads(leaves):
    for t in leaves:
        t.grad = None


def peak_mib(fn, leaves):
    """Warm `fn` up (compilation, autotuning, cuBLAS handles), then its peak memory in MiB
    above the inputs and the gradients it leaves."""
    clear_grads(leaves)
    fn()
    clear_grads(leaves)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves if t.grad is not None)
    return (torch.cuda.max_memory_allocated() - base - grads) / (1 << 20)


def measure(fn, leaves, reps):
    """(median ms, peak MiB above inputs + grads)."""
    peak = peak_mib(fn, leaves)
    median = _time(fn, reps, before=lambda: clear_grads(leaves), warm=False)
    clear_grads(leaves)
    return median, peak


def skip_reason(name, bt, args):
    if ("eager" in name or "compile" in name) and bt > args.max_full_logits_bt:
        return f"skipped: full logits at BT>{args.max_full_logits_bt}"
    return None


def run(args):
    liger = _load_liger()
    results = []
    for bt in args.bt:
        x = make_inputs(bt)
        if liger is not None and liger[1] is not None:
            x["dense"] = torch.zeros(bt, V, device="cuda", dtype=DT).scatter_(
                1, x["ids"].long(), x["lps"].float().exp().to(DT))
        leaves = [x["hs"], x["ws"]]
        for name, (fn, live) in methods(x, liger).items():
            if args.only and not any(s in name for s in args.only):
                continue
            row = dict(bt=bt, name=name, live=live)
            reason = skip_reason(name, bt, args)
            if reason:
                row["skipped"] = reason
            else:
                t0 = time.time()
                try:
                    row["ms"], row["mib"] = measure(fn, leaves, args.reps)
                except torch.OutOfMemoryError:
                    row["skipped"] = "OOM"
                    torch.cuda.empty_cache()
                row["wall_s"] = round(time.time() - t0, 1)
            if "floor" in name:
                row.pop("mib", None)
            results.append(row)
            print(json.dumps(row), flush=True)
        del x
        torch.cuda.empty_cache()
    return results


def _load_liger():
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD
    except ImportError:
        print("liger-kernel not installed: its rows are left out")
        return None
    try:
        from liger_kernel.transformers import LigerFusedLinearKLDivLoss
    except ImportError:
        LigerFusedLinearKLDivLoss = None
    return LigerFusedLinearJSD, LigerFusedLinearKLDivLoss


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


def _time(fn, reps=10, before=None, warm=True):
    """Median ms of `fn` over `reps` runs, CUDA events; `before` runs untimed each time."""
    if warm:
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def write_reports(results, out: Path, env: dict):
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(env=env, results=results), indent=1))
    (out / "table.md").write_text(table(results))
    plot(results, out / "loss_bench.png", env["gpu"])


def table(results):
    bts = sorted({r["bt"] for r in results})
    names = list(dict.fromkeys(r["name"] for r in results))
    by = {(r["bt"], r["name"]): r for r in results}
    lines = ["| method | " + " | ".join(f"BT={b}" for b in bts) + " |",
             "|---|" + "---|" * len(bts)]
    for name in names:
        cells = []
        for b in bts:
            r = by.get((b, name))
            floor = by.get((b, "GEMM floor (4 live)" if (r or {}).get("live", True)
                            else "GEMM floor (3 cached)"), {})
            if r is None:
                cells.append("")
            elif "skipped" in r:
                cells.append(r["skipped"])
            else:
                cell = f"{r['ms']:.1f} ms"
                if "floor" not in name and floor.get("ms"):
                    cell += f" ({r['ms'] / floor['ms']:.2f}x)"
                if "mib" in r:
                    cell += f" / {r['mib']:.0f} MiB"
                cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results, path, gpu):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.get_cmap("tab20").colors
    for i, name in enumerate(dict.fromkeys(r["name"] for r in results)):
        rows = [r for r in results if r["name"] == name and "ms" in r]
        if not rows:
            continue
        kw = dict(marker="o", label=name, color=colors[i % len(colors)],
                  linestyle="-" if "distill" in name else ("--" if "floor" in name else ":"))
        bts = [r["bt"] for r in rows]
        ax_t.plot(bts, [r["ms"] for r in rows], **kw)
        if "floor" not in name:
            ax_m.plot(bts, [r["mib"] / 1024 for r in rows], **kw)
    for ax, ylabel in ((ax_t, "forward+backward, median ms"), (ax_m, "peak extra GiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("BT (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=7)
    fig.suptitle(f"fused linear divergence, bf16, H={H}, V={V}, {gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def environment():
    import triton

    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, cuda=torch.version.cuda)
    try:
        import importlib.metadata as md

        env["liger_kernel"] = md.version("liger-kernel")
    except Exception:  # noqa: BLE001 - not installed
        env["liger_kernel"] = None
    return env


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bt", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--only", nargs="*", help="substrings of the method names to run")
    p.add_argument("--max-full-logits-bt", type=int, default=16384,
                   help="eager / compile build the full logits: skip them above this BT")
    p.add_argument("--breakdown", action="store_true", help="time GEMMs and kernels apart")
    p.add_argument("--tune", action="store_true", help="pick the row kernels' block sizes first")
    p.add_argument("--host", action="store_true",
                   help="host time to issue a call, and its cProfile (--only: full names)")
    p.add_argument("--timeline", action="store_true",
                   help="one call's host functions, launches and kernels on one clock "
                        "(--only: full names)")
    p.add_argument("--sparse-kernel", action="store_true",
                   help="the cached row kernel alone: block sizes, with and without prefetch")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler table of one step per BT: the live floor and forward "
                        "KL, or the methods --only names in full")
    args = p.parse_args()
    env = environment()
    if args.tune:
        env["tuned"] = tune()
    from distill.ops import divergence_triton

    env["kernel_config"] = {k: list(v) for k, v in divergence_triton.CONFIG.items()}
    print(json.dumps(env))
    if args.host:
        for bt in args.bt:
            print(host(bt, args.only or ["distill live forward_kl"]))
        return
    if args.sparse_kernel:
        print(sparse_kernel())
        return
    if args.timeline:
        for bt in args.bt:
            print(timeline(bt, args.only or ["distill live forward_kl"]))
        return
    if args.profile:
        for bt in args.bt:
            print(profile(bt, *([tuple(args.only)] if args.only else [])))
        return
    if args.breakdown:
        for bt in args.bt:
            res = breakdown(bt)
            print(json.dumps(res, indent=1))
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"breakdown_{bt}.json").write_text(json.dumps(res, indent=1))
        return
    results = run(args)
    write_reports(results, args.out, env)
    print(table(results))


if __name__ == "__main__":
    main()
