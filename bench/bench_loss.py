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


def _time(fn, reps=10, before=None, warm=True, lead=None):
    """Median ms of `fn` over `reps` runs, CUDA events; `before` runs untimed each time, and
    `lead` (work queued on the device, not waited for) right before the start event."""
    if warm:
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        if lead is not None:
            lead()
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
    import loss_probes as probes  # after parsing: it imports this file as a module

    if args.tune:
        env["tuned"] = probes.tune()
    from distill.ops import divergence_triton

    env["kernel_config"] = {k: list(v) for k, v in divergence_triton.CONFIG.items()}
    print(json.dumps(env))
    if args.host:
        for bt in args.bt:
            print(probes.host(bt, args.only or ["distill live forward_kl"]))
        return
    if args.sparse_kernel:
        print(probes.sparse_kernel())
        return
    if args.timeline:
        for bt in args.bt:
            print(probes.timeline(bt, args.only or ["distill live forward_kl"]))
        return
    if args.profile:
        for bt in args.bt:
            print(probes.profile(bt, *([tuple(args.only)] if args.only else [])))
        return
    if args.breakdown:
        for bt in args.bt:
            res = probes.breakdown(bt)
            print(json.dumps(res, indent=1))
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"breakdown_{bt}.json").write_text(json.dumps(res, indent=1))
        return
    results = run(args)
    write_reports(results, args.out, env)
    print(table(results))


if __name__ == "__main__":
    main()
