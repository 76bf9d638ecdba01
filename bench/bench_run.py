"""The run a user starts against the benchmark's step, with the same clock and memory counter.

    python bench/bench_run.py --out $OUT/run                     # GPU: the llama pair
    python bench/bench_run.py --out /tmp/run --tiny --steps 8    # CPU: the same code, tiny

For each variant (packed rows, unpacked rows, a cached teacher read from a real Arrow cache
the caching job writes first), two measurements, each in a subprocess of its own so that the
other's memory is gone:
- the run: `python -m distill.train +experiment=hf_sft trainer=gpu ...` on saved
  random-weight models at real shapes (bench/make_real_shape_models.py), with the
  StepTimer callback (bench/step_timer.py): each optimizer step's time,
  device-synchronized at both ends, tokens, and the allocator's peak after the warm-up;
- the step: the same models' shapes built in memory, the same batches (the run's own
  DistillDataModule and collate), the same levers, DistillModule's objective + backward +
  clipping + AdamW for each batch, timed the same way.
Prints one markdown table (tokens/s, ms per step, peak allocated, run/step ratio, the
compile/recompile counts of the run's log), then the runs' cached / packed and packed /
unpacked tokens/s where both ran, and writes bench_run.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

# profiled steps (--gaps), right after the warm-up; left out of the ratios with the step
# after them, whose time holds the trace's export in the run
GAP_STEPS = 2
VARIANTS = {  # name -> (packing, cached teacher)
    "packed": (True, False),
    "unpacked": (False, False),
    "cached": (True, True),  # packed rows, the teacher read from its cache
    "onpolicy": (False, False),  # every row rewritten by the student's own sample
}
ONPOLICY = ["loss.on_policy.fraction=1.0", "loss.on_policy.max_new_tokens=256",
            "data.max_length=512"]


def run_cmd(cmd: list[str], log: Path, timeout: float, env=None) -> int:
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        try:
            return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout, env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[bench_run] timed out after {timeout} s\n")
            return 124


def cache_dir(args, root: Path) -> Path:
    """The teacher cache: one with a validation split when the runs validate (a cache must
    hold every split a run reads), one without."""
    return root / ("cache_val" if args.val_every else "cache")


def overrides(args, root: Path, packing: bool, cached: bool) -> list[str]:
    pair = root / args.pair
    ov = ["+experiment=hf_sft", f"student.name_or_path={pair / 'student'}",
          f"teacher.name_or_path={pair / 'teacher'}", f"paths.data={root / 'data'}",
          f"data.packing={'true' if packing else 'false'}",
          f"data.max_length={args.max_length}", f"data.batch_size={args.batch_size}",
          "data.num_workers=2"]
    if not args.tiny:
        ov.append("trainer=gpu")
    else:
        ov += ["trainer=cpu", "student.dtype=float32", "teacher.dtype=float32"]
    if cached:
        ov += ["teacher=cached", f"cache.dir={cache_dir(args, root)}", "cache.top_k=64"]
    if args.onpolicy:
        ov += ONPOLICY
    if args.val_every:  # validation on the first val_batches batches of the train rows
        ov += [f"data.val=[{{name:val,kind:sft,path:'{root / 'data' / 'sft_train.jsonl'}'}}]",
               f"++trainer.limit_val_batches={args.val_batches}"]
    else:
        ov.append("data.val=null")
    return ov + list(args.overrides)


def cli_run(args, root, name, packing, cached) -> dict:
    timer = args.out / f"timer_{name}.json"
    out = root / "runs" / name.replace(", ", "_")
    cmd = [sys.executable, "-m", "distill.train", *overrides(args, root, packing, cached),
           f"paths.output_dir={out}", f"trainer.max_steps={args.steps}",
           f"trainer.val_check_interval={args.val_every or args.steps}",
           "callbacks.checkpoint=null",
           "callbacks.export=null", "trainer.log_every_n_steps=5",
           f"+callbacks.timer={{_target_:bench.step_timer.StepTimer,"
           f"path:'{timer}',warmup:{args.warmup}}}"]
    if args.gaps:  # the run's gap profile, of the steps the step bench profiles too
        cmd.append(f"+callbacks.gaps={{_target_:bench.gaps.GapProfile,"
                   f"path:'{args.out / f'gaps_run_{name}.json'}',start:{args.warmup},"
                   f"steps:{GAP_STEPS}}}")
    log = args.out / f"run_{name}.log"
    t0 = time.perf_counter()
    rc = run_cmd(cmd, log, args.timeout, env={"TORCH_LOGS": "recompiles"})
    result = {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1)}
    if timer.exists():
        result.update(json.loads(timer.read_text()))
    text = log.read_text(errors="replace")
    result["recompiles"] = text.count("Recompiling function")
    # after the warm-up steps: the progress bar's step count when each recompile was logged
    metrics = sorted(out.glob("logs/version_*/metrics.csv"))
    if metrics:
        import csv

        rows = list(csv.DictReader(metrics[-1].open()))
        for key in ("time/rollout_s", "time/train_s"):
            vals = [float(r[key]) for r in rows  # the steps after the warm-up
                    if r.get(key) and int(r.get("step") or 0) >= args.warmup]
            if vals:
                result[key] = statistics.median(vals)
    return result


def step_bench(args, root: Path, name: str, packing: bool, cached: bool) -> dict:
    """The benchmark's step on the run's own batches (this runs in its own process)."""
    import torch
    from bench_train_steps import distill_step, make_module
    from hydra import compose, initialize_config_module
    from transformers import AutoConfig, AutoModelForCausalLM

    from distill.data import DistillDataModule
    from distill.models.causal_lm import load_tokenizer
    from distill.models.levers import apply_levers
    from distill.run.config import parse
    from distill.training.teachers import CachedTeacher, LiveTeacher

    with initialize_config_module("distill.conf", version_base="1.3"):
        cfg = compose("train", overrides=overrides(args, root, packing, cached)
                      + [f"paths.output_dir={root / 'step_out'}"])
    run = parse(cfg)
    device = torch.device("cpu" if args.tiny else "cuda")
    tok = load_tokenizer(run.teacher.name_or_path)
    data = DistillDataModule(tok, run.data)
    data.setup("fit")
    data.for_device(device.type)  # the run's padding: its setup does this inside the Trainer
    torch.manual_seed(0)
    with torch.device(device):
        student = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(run.student.name_or_path)).float()
        if cached:
            teacher = CachedTeacher(run.cache.dir, run.teacher.name_or_path, run.cache.top_k,
                                    run.loss.temperature)
            teacher.prefetch_in(data)
        else:
            t_model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(run.teacher.name_or_path),
                dtype=torch.float32 if args.tiny else torch.bfloat16)
            teacher = LiveTeacher.from_model(t_model)
    apply_levers(run.speed, student, teacher.model, run.data.packing)
    module = make_module(student, teacher, len(tok), lr=1e-5)
    loader = data.train_dataloader()  # the run's own sampler and collate: the same batches

    class Run:  # what bench_train_steps.distill_step reads
        cuda = device.type == "cuda"

    Run.device = device
    from gaps import profiled

    ms, tokens, widths = [], [], []
    for i, batch in enumerate(loader):
        if i == args.warmup + args.bench_steps:
            break
        batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()
                 if k != "window"}
        step = distill_step(module, batch, Run)
        if Run.cuda:
            torch.cuda.synchronize()
        if args.gaps and i == args.warmup:
            gap_ctx = profiled(args.out / f"gaps_step_{name}.json")
            gap_ctx.__enter__()
        t0 = time.perf_counter()
        step()
        if Run.cuda:
            torch.cuda.synchronize()
        ms.append(1000 * (time.perf_counter() - t0))
        if args.gaps and i == args.warmup + GAP_STEPS - 1:
            gap_ctx.__exit__(None, None, None)
        tokens.append(int(batch["attention_mask"].sum()))
        widths.append(int(batch["input_ids"].shape[-1]))
        if i + 1 == args.warmup and Run.cuda:
            torch.cuda.reset_peak_memory_stats()
    steady = list(zip(ms, tokens))[args.warmup:]
    med = statistics.median(m for m, _ in steady)
    toks = statistics.median(t for _, t in steady)
    out = {"median_ms": med, "median_tokens": toks, "tokens_per_s": toks / med * 1000,
           "ms": ms, "tokens": tokens, "widths": widths}
    if Run.cuda:
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def build(args, root: Path) -> None:
    import make_real_shape_models as real

    root.mkdir(parents=True, exist_ok=True)
    if not (root / args.pair / "teacher" / "config.json").exists():
        import torch

        real.build_pair(args.pair, root, args.tiny, "cpu" if args.tiny else "cuda")
        if not args.tiny:
            torch.cuda.empty_cache()
    rows = args.steps * args.batch_size * 4 + 64  # more than the packed rows need
    real.make_chat_data(root / "data", rows, 8, args.tiny)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_out/run"))
    p.add_argument("--root", type=Path, default=Path("/tmp/distill_bench_run"))
    p.add_argument("--pair", default="llama")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bench-steps", type=int, default=None,
                   help="the step's timed batches after the warm-up (default: the run's)")
    p.add_argument("--gaps", action="store_true",
                   help="profile 2 steps of the run and of the step: the device's idle gaps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--phase", default="all", help="all | step:<variant> (internal)")
    p.add_argument("--onpolicy", action="store_true",
                   help="every run samples (the onpolicy variant's overrides)")
    p.add_argument("--no-step", default="", help="variants measured as runs only")
    p.add_argument("--val-every", type=int, default=0,
                   help="the runs validate every N steps (0: no validation)")
    p.add_argument("--val-batches", type=int, default=4)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.bench_steps is None:
        args.bench_steps = args.steps - args.warmup
    if args.tiny:
        args.batch_size, args.max_length = min(args.batch_size, 4), min(args.max_length, 256)
    args.out.mkdir(parents=True, exist_ok=True)
    root = args.root
    if args.phase.startswith("step:"):
        name = args.phase[5:]
        result = step_bench(args, root, name, *VARIANTS[name])
        (args.out / f"step_{name}.json").write_text(json.dumps(result))
        return 0
    build(args, root)
    results = {}
    for name in args.variants.split(","):
        packing, cached = VARIANTS[name]
        args.onpolicy = name == "onpolicy"
        if cached and not (cache_dir(args, root) / "metadata.json").exists():
            cmd = [sys.executable, "-m", "distill.run.cache",
                   *overrides(args, root, packing, cached), f"paths.output_dir={root / 'c'}"]
            rc = run_cmd(cmd, args.out / "cache_job.log", args.timeout)
            if rc:
                results[name] = {"skipped": f"the caching job failed (rc {rc})"}
                continue
        row = {"run": cli_run(args, root, name, packing, cached)}
        if name in args.no_step.split(",") or args.onpolicy:
            row["step"] = {}
            results[name] = row
            (args.out / "bench_run.json").write_text(json.dumps(results, indent=1))
            continue
        cmd = [sys.executable, __file__, "--phase", f"step:{name}", "--out", str(args.out),
               "--root", str(root), "--pair", args.pair, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--bench-steps", str(args.bench_steps),
               *(["--gaps"] if args.gaps else []),
               "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
               *(["--tiny"] if args.tiny else []), *args.overrides]
        rc = run_cmd(cmd, args.out / f"step_{name}.log", args.timeout)
        got = args.out / f"step_{name}.json"
        row["step"] = json.loads(got.read_text()) if got.exists() else {"rc": rc}
        skip = set(range(args.warmup, args.warmup + GAP_STEPS + 1)) if args.gaps else set()
        row["same_batches"] = same_batches(row["run"], row["step"], args.warmup, skip)
        results[name] = row
        (args.out / "bench_run.json").write_text(json.dumps(results, indent=1))
    print_table(results)
    return 0


def same_batches(run: dict, step: dict, warmup: int, skip: set[int]) -> dict | None:
    """tokens/s of the run and of the step over the batches both timed after the warm-up
    (the same batches: the step bench reads the run's own loader), all tokens over all time,
    the profiled steps left out."""
    n = min(len(run.get("ms", [])), len(step.get("ms", [])))
    idx = [i for i in range(warmup, n) if i not in skip]
    same = all(run.get(k, [])[:n] == step.get(k, [])[:n] for k in ("tokens", "widths"))
    if not idx or not same:
        return None  # not the same batches, or not padded alike: no ratio

    def rate(x):
        return sum(x["tokens"][i] for i in idx) / sum(x["ms"][i] for i in idx) * 1000
    return {"steps": len(idx), "run_tokens_per_s": rate(run), "step_tokens_per_s": rate(step),
            "ratio": rate(run) / rate(step)}


def print_table(results: dict) -> None:
    print("| variant | step alone: ms / tokens/s / peak | the run: ms / tokens/s / peak | "
          "run / step tokens/s (same batches) | run - step peak | recompiles after start |")
    print("|---|---|---|---|---|---|")
    for name, row in results.items():
        if "run" not in row:
            print(f"| {name} | {row.get('skipped')} | | | | |")
            continue
        s, r = row["step"], row["run"]

        def cell(x):
            if "tokens_per_s" not in x:
                return f"failed (rc {x.get('rc')})"
            peak = f"{x['peak_allocated_gib']:.1f} GiB" if "peak_allocated_gib" in x else "-"
            return f"{x['median_ms']:.0f} ms / {x['tokens_per_s']:,.0f} / {peak}"
        same = row.get("same_batches")
        ratio = (f"{same['ratio']:.3f} ({same['steps']} steps)" if same else "-")
        peaks = ("peak_allocated_gib" in r and "peak_allocated_gib" in s
                 and f"{r['peak_allocated_gib'] - s['peak_allocated_gib']:+.1f} GiB") or "-"
        extra = ""
        if "time/rollout_s" in r:
            share = r["time/rollout_s"] / (r["time/rollout_s"] + r.get("time/train_s", 0))
            extra = f" (rollout {r['time/rollout_s']:.2f} s = {100 * share:.0f}% of the step)"
        print(f"| {name} | {cell(s) if s else '-'} | {cell(r)}{extra} | {ratio} | {peaks} | "
              f"{r.get('recompiles', '-')} |")
    rate = {name: row["run"]["tokens_per_s"] for name, row in results.items()
            if "tokens_per_s" in row.get("run", {})}
    for a, b, target in (("cached", "packed", 2.6), ("packed", "unpacked", 1.0)):
        if a in rate and b in rate:  # the issue's targets for the runs of one call
            print(f"{a} / {b} run tokens/s: {rate[a] / rate[b]:.2f}x (target >= {target}x)")


if __name__ == "__main__":
    sys.exit(main())
