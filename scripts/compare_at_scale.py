"""The demo's comparison at a larger scale, on a GPU: a teacher trained there, then the
distilled student against SeqKD and supervised KD at equal steps, prompts and lr grid.

    python scripts/compare_at_scale.py --out /tmp/scale [--teacher-steps 2500] [--seeds 0 1 2]

1. `scripts/make_demo_assets.py --device cuda` builds the demo's data with longer
   permutations (`--lengths`, default 12-20 letters: longer answers, where a small
   student's early mistakes compound) and trains a larger teacher (`--teacher`) on the
   same graded answers as the bundled one; the student config is larger too (`--student`).
2. Every arm runs the real command, `python -m distill.train +experiment=onpolicy_demo
   trainer=gpu paths.demo=<the new assets>` (+baseline=seqkd|supervised_kd for the
   baselines), `--parallel` of them at once, each with a timeout (the GPU time-slices
   between processes: twelve 1000-step runs at once did not finish in 280 s).
3. Each run's summary gives the accuracy on the held-out test split; the table (mean over
   seeds per arm and lr) is printed last and written to <out>/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"distilled": [], "seqkd": ["+baseline=seqkd"],
        "supervised_kd": ["+baseline=supervised_kd"]}
# the scripts import the package from this checkout (its root first on the path)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get(
    "PYTHONPATH")]))}
ACCURACY = re.compile(r"^\s+(teacher|distilled student)\s+([\d.]+)%", re.M)


def build_assets(args) -> Path:
    assets = args.out / "assets"
    cmd = [sys.executable, str(ROOT / "scripts" / "make_demo_assets.py"), "--out", str(assets),
           "--device", args.device, "--threads", "4", "--steps", str(args.teacher_steps),
           "--batch-size", str(args.teacher_batch), "--lr", str(args.teacher_lr),
           "--eval-every", "1000",
           "--n-perm", str(args.n_perm), "--perm-lengths", "4", str(args.lengths[1]),
           "--demo-perm-lengths", *map(str, args.lengths),
           "--eval-tokens", str(args.lengths[1] + 2),
           "--teacher", json.dumps(args.teacher), "--student", json.dumps(args.student)]
    with open(args.out / "assets.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT,
                       timeout=args.teacher_timeout, cwd=ROOT, env=ENV)
    return assets


def launch(args, assets: Path, arm: str, lr: str, seed: int) -> tuple[str, subprocess.Popen]:
    name = f"{arm}_lr{lr}_s{seed}"
    out = args.out / "runs" / name
    out.mkdir(parents=True, exist_ok=True)
    tokens = str(args.lengths[1] + 2)  # the longest answer, its eos, one spare
    cmd = ["timeout", "-k", "10", str(args.run_timeout), sys.executable, "-m", "distill.train",
           "+experiment=onpolicy_demo", "trainer=" + ("gpu" if args.device == "cuda" else "cpu"),
           f"paths.demo={assets}",
           f"paths.output_dir={out}", "callbacks.checkpoint=null",
           "callbacks.progress.refresh_rate=50", f"seed={seed}", f"optimizer.lr={lr}",
           f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.steps}",
           f"loss.on_policy.max_new_tokens={tokens}", f"evaluate.max_new_tokens={tokens}",
           *ARMS[arm]]
    (out / "command.txt").write_text(" ".join(cmd[4:]) + "\n")
    with open(out / "stdout.txt", "w") as log:  # the child keeps its own copy of the file
        return name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                      env=ENV)


STEPS = re.compile(r"optimizer steps:\s+(\d+)\s+\((\d+) s\)")
TOKENS = re.compile(r"trained tokens:\s+(\d+)")


def scores(stdout: str) -> dict:
    found = {k: float(v) for k, v in ACCURACY.findall(stdout)}
    if steps := STEPS.search(stdout):
        found["steps"], found["train_s"] = int(steps[1]), int(steps[2])
    if tokens := TOKENS.search(stdout):
        found["trained_tokens"] = int(tokens[1])
    return found


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script")
    p.add_argument("--lengths", type=int, nargs=2, default=[12, 20])
    p.add_argument("--teacher", type=json.loads, default={
        "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 8, "intermediate_size": 1536})
    p.add_argument("--student", type=json.loads, default={
        "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 768})
    p.add_argument("--teacher-steps", type=int, default=2500)
    p.add_argument("--teacher-lr", type=float, default=1e-3)
    p.add_argument("--teacher-batch", type=int, default=128)
    p.add_argument("--n-perm", type=int, default=60000)
    p.add_argument("--teacher-timeout", type=int, default=240)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--lrs", nargs="+", default=["1e-3", "2e-3"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--run-timeout", type=int, default=300)
    p.add_argument("--parallel", type=int, default=2,
                   help="runs at once (one GPU time-slices between processes)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    start = time.time()
    assets = build_assets(args)
    print(f"assets and teacher: {time.time() - start:.0f} s", flush=True)
    # seed-major, arms alternating: a budget cut short still leaves comparable pairs
    queue = [(arm, lr, seed) for seed in args.seeds for lr in args.lrs for arm in args.arms]
    running, results = [], {}
    while queue or running:
        while queue and len(running) < args.parallel:
            running.append(launch(args, assets, *queue.pop(0)))
        time.sleep(2)
        for name, proc in [r for r in running if r[1].poll() is not None]:
            running.remove((name, proc))
            text = (args.out / "runs" / name / "stdout.txt").read_text(errors="replace")
            results[name] = {"rc": proc.returncode, **scores(text)}
            if proc.returncode:  # the end of its progress bar says how far it came
                results[name]["last_output"] = text[-300:]
            print(name, results[name], flush=True)
    print(f"all runs: {time.time() - start:.0f} s", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))

    teacher = next((r["teacher"] for r in results.values() if "teacher" in r), None)
    print(f"\nteacher {teacher}%  ({args.teacher}); student {args.student}; "
          f"{args.steps} steps, lengths {args.lengths}")
    print("| arm | lr | seeds | mean | train s | trained tokens |\n|---|---|---|---|---|---|")
    for arm in args.arms:
        for lr in args.lrs:
            rows = [results.get(f"{arm}_lr{lr}_s{s}", {}) for s in args.seeds]
            got = [r.get("distilled student") for r in rows]
            mean = f"{statistics.mean(got):.1f}" if None not in got else "-"
            print(f"| {arm} | {lr} | {' / '.join(str(g) for g in got)} | {mean} | "
                  f"{' / '.join(str(r.get('train_s')) for r in rows)} | "
                  f"{' / '.join(str(r.get('trained_tokens')) for r in rows)} |")


if __name__ == "__main__":
    main()
