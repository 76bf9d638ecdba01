"""Every combination of the speed levers on distill's step, beside the teacher forward with
the same levers, each combination in a process of its own.

    python bench/bench_levers.py --out $OUT/levers               # GPU: the llama pair
    python bench/bench_levers.py --tiny --out /tmp/levers        # CPU: the code path, tiny

The levers (distill/models/levers.py): gradient checkpointing of the student, torch.compile of each
decoder layer of both models, Liger's RMSNorm / SwiGLU / RoPE in both. compile with Liger is
refused before anything loads (distill.run.config says why), so it is listed, not timed. Each
combination builds the pair in memory at real shapes (bench/bench_train_steps.py: random
weights, fp32 student under bf16 autocast, bf16 teacher), applies the levers as a run does
(`apply_levers`), then times the teacher forward alone and distill's whole step (objective,
backward, clipping, AdamW) on the same batch: median of --reps after warm-up calls, which
for compiled layers include the compilation. Reports ms, tokens/s, MFU (6 N_student +
2 N_teacher over the dense bf16 peak, bench_train's count), the step over the teacher
forward, and the allocator's peak; writes levers.json under --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

# name -> the `speed:` settings of the combination
COMBOS = {
    "none": {},
    "checkpointing": {"gradient_checkpointing": True},
    "compile": {"compile": True},
    "compile + checkpointing": {"compile": True, "gradient_checkpointing": True},
    "liger": {"liger": True},
    "liger + checkpointing": {"liger": True, "gradient_checkpointing": True},
}
REFUSED = {"compile + liger": "refused before loading (distill.run.config: speed.compile=true "
                              "with speed.liger=true)"}


def setup(args, speed: dict, cuda: bool):
    """The pair built in memory at real shapes (tiny on CPU), the levers of `speed` applied
    as a run applies them, distill's module and one batch: (run, student, teacher, module,
    batch, what was applied). bench/profile_step.py builds its step the same way."""
    import torch
    from bench_train_steps import build, make_batch, make_module

    from distill.models.levers import Speed, apply_levers

    run = SimpleNamespace(args=args, device=torch.device("cuda" if cuda else "cpu"), cuda=cuda)
    student, teacher = build(args.pair, run)
    applied = apply_levers(Speed(**speed), student, teacher.model)
    module = make_module(student, teacher, student.config.vocab_size)
    batch = make_batch(args.rows, args.seq, student.config.vocab_size, run.device)
    return run, student, teacher, module, batch, applied


def rates(kind: str, ms: float, student, teacher, args) -> dict:
    """ms, tokens/s and MFU (6 N_student + 2 N_teacher, bench_train's count) of one step
    kind ("teacher": the teacher forward; "live": distill's step)."""
    from bench_train import PEAK_TFLOPS, flops_per_token

    tokens = args.rows * args.seq
    dense, _ = flops_per_token(kind, student, teacher.model, args.seq)
    return {"ms": ms, "tokens_per_s": tokens / ms * 1e3,
            "mfu": tokens / ms * 1e3 * dense / PEAK_TFLOPS / 1e12}


def measure(args, name: str) -> dict:
    """One combination, in this process: the teacher forward and distill's step."""
    import torch
    from bench_train import timed_ms
    from bench_train_steps import distill_step, teacher_step

    cuda = torch.cuda.is_available() and not args.tiny
    speed = dict(COMBOS[name])
    if speed.get("liger") and not cuda:
        return {"skipped": "Liger's kernels need a CUDA GPU"}
    if speed.get("compile") and args.tiny:
        speed["compile_backend"] = "aot_eager"  # no C++ compiler needed on the CPU
    run, student, teacher, module, batch, applied = setup(args, speed, cuda)
    out = {"applied": applied}
    warm = 3 if speed.get("compile") else 1
    for kind, make in (("teacher", teacher_step), ("live", distill_step)):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        row = rates(kind, timed_ms(make(module, batch, run), run, warm, args.reps), student,
                    teacher, args)
        row["wall_s"] = time.perf_counter() - t0
        if cuda:
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["teacher forward" if kind == "teacher" else "step"] = row
    out["step / teacher forward"] = out["step"]["ms"] / out["teacher forward"]["ms"]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_out/levers"))
    p.add_argument("--pair", default="llama", choices=["llama", "qwen"])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--combos", default=",".join(COMBOS))
    p.add_argument("--timeout", type=float, default=240, help="seconds per combination")
    p.add_argument("--tiny", action="store_true", help="CPU, tiny shapes: the code path only")
    p.add_argument("--phase", default="all", help="all | one:<combination> (internal)")
    args = p.parse_args(argv)
    if args.tiny:
        args.rows, args.seq, args.reps = min(args.rows, 2), min(args.seq, 32), min(args.reps, 2)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase.startswith("one:"):
        name = args.phase[4:]
        (args.out / f"{name}.json").write_text(json.dumps(measure(args, name)))
        return {}
    results = dict(REFUSED)
    for name in args.combos.split(","):
        cmd = [sys.executable, __file__, "--phase", f"one:{name}", "--out", str(args.out),
               "--pair", args.pair, "--rows", str(args.rows), "--seq", str(args.seq),
               "--reps", str(args.reps), *(["--tiny"] if args.tiny else [])]
        log = args.out / f"{name}.log"
        try:
            with open(log, "w") as f:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        got = args.out / f"{name}.json"
        results[name] = json.loads(got.read_text()) if got.exists() else {
            "skipped": f"failed (rc {rc}): {log}"}
        (args.out / "levers.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return results


def table(results: dict) -> str:
    lines = ["| levers | teacher forward ms | step ms | tokens/s | MFU (6N + 2N) | "
             "step / teacher forward | peak GiB |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if not isinstance(r, dict) or "step" not in r:
            why = r if isinstance(r, str) else r.get("skipped")
            lines.append(f"| {name} | {why} | | | | | |")
            continue
        s, t = r["step"], r["teacher forward"]
        peak = f"{s['peak_gib']:.1f}" if "peak_gib" in s else "-"
        lines.append(f"| {name} | {t['ms']:.0f} | {s['ms']:.0f} | {s['tokens_per_s']:,.0f} | "
                     f"{s['mfu']:.1%} | {r['step / teacher forward']:.2f}x | {peak} |")
    timed = [(n, r) for n, r in results.items() if isinstance(r, dict) and "step" in r]
    if timed:
        name, best = max(timed, key=lambda x: x[1]["step"]["tokens_per_s"])
        lines.append(f"\nfastest: {name}: MFU {best['step']['mfu']:.1%} (target >= 60%), "
                     f"step / teacher forward {best['step / teacher forward']:.2f}x "
                     "(target <= 1.55x)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
