"""distill beside TRL on the same jobs: on-policy against `DistillationTrainer`, off-policy
against `GKDTrainer` (lmbda 0), for a Llama pair and a Qwen3 pair.

    python bench/bench_peers.py --out $OUT/peers --budget-s 520      # GPU: both pairs
    python bench/bench_peers.py --out $OUT/peers --pairs qwen3       # GPU: one pair a call
    python bench/bench_peers.py --out /tmp/peers --tiny              # CPU: tiny shapes

TRL is a benchmark-only dependency: `pip install trl==1.16.0` (or `pip install -e .[bench]`).

Models: random weights at real shapes, saved once per pair (bench/make_real_shape_models.py)
and loaded from the folders by all four runs. llama: a Llama-3.2-1B-shaped student (1.24B)
and a Llama-3.1-8B-shaped teacher (8.03B), V=128256; qwen3: a Qwen3-0.6B-shaped student
(0.60B) and a Qwen3-8B-shaped teacher (8.19B), both heads 151936 rows.

The jobs; both trainers of a job read the same rows in the same order:
- on-policy: 32 prompts of 128 tokens a step, sampled for in one call (8 a micro-batch x 4
  micro-batches), 128 new tokens each from the student (temperature 1, no top-k/top-p),
  scored by the teacher, generalized JSD beta 0.5 on the sampled tokens. distill: `python -m
  distill.train +experiment=hf_onpolicy loss.on_policy.fraction=1 ...` (its sampler);
  TRL: `DistillationTrainer` (always on-policy; transformers' generate, no vLLM).
- off-policy: 16 rows a step (4 a micro-batch x 4), each 1024-2048 tokens long, JSD beta
  0.5 on the answer tokens, no sampling. distill: `python -m distill.train
  +experiment=hf_sft loss.kind=jsd data.packing=false ...`; TRL: `GKDTrainer`, lmbda 0,
  full logits of both models.
Both sides: fp32 master weights under bf16 autocast, a bf16 teacher, no gradient
checkpointing, fused AdamW, clipping at norm 1 (each one's default), no checkpoints saved.

Each run is a process of its own (no memory carried over) with a time limit. Its clock is
distill's StepTimer (transformers' hooks drive it for TRL: bench/peers_trl.py): the median
optimizer step after `--warmup` steps and the allocator's peak (max_memory_allocated) over
those steps. The tokens a step (prompt + answer, padding excluded) show that both did the
same work. Prints one table per pair last; writes peers.json (after every run) and each
run's log under --out.

Time plan on one H200 (from this repository's earlier runs on the llama pair): a pair's
build ~20 s (the 8B teacher initialized on the GPU, ~16 GB of safetensors written; the
page cache then serves the four loads); each run ~35-45 s of start-up (Python, Lightning or
the Trainer, loading both models) plus its steps: distill on-policy 8 x ~0.8 s, TRL
on-policy 8 x ~4.8 s, distill off-policy 8 x ~0.9 s, GKD 8 x ~1.6 s. About 250 s for the
llama pair, somewhat more for qwen3 (TRL's generate through 28 layers to Llama's 16): ~530 s
for both. `--budget-s` bounds the whole call: a run that would start with less than
`--min-run-s` left is reported as not run, and each run's limit is the smaller of
`--timeout` and what is left. `--pairs llama` / `--pairs qwen3` split the pairs over calls.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

TIMER = "bench.step_timer.StepTimer"
PAIRS = {"llama": "Llama-3.2-1B-shaped student, Llama-3.1-8B-shaped teacher",
         "qwen3": "Qwen3-0.6B-shaped student, Qwen3-8B-shaped teacher"}
# (job, trainer) -> what the table calls it
RUNS = {("onpolicy", "distill"): "distill (hf_onpolicy, fraction 1)",
        ("onpolicy", "trl"): "TRL DistillationTrainer",
        ("offpolicy", "distill"): "distill (hf_sft, JSD)",
        ("offpolicy", "trl"): "TRL GKDTrainer (lmbda 0)"}
# job -> (distill's step at least this much faster, its peak at most this fraction or None)
TARGETS = {"onpolicy": (5.0, None), "offpolicy": (1.75, 0.60)}


@dataclass(frozen=True)
class Job:
    prompt_tokens: int = 128
    new_tokens: int = 128
    on_batch: int = 8
    on_accum: int = 4
    off_batch: int = 4
    off_accum: int = 4
    max_length: int = 2048
    steps: int = 8
    warmup: int = 3


TINY = Job(prompt_tokens=32, new_tokens=8, on_batch=4, on_accum=2, off_batch=2, off_accum=2,
           max_length=96, steps=3, warmup=1)


# --- rows of exact token lengths ---------------------------------------------------------
def filler(rng: random.Random, n: int) -> str:
    """Text of exactly `n` tokens for bench/make_real_shape_models' tokenizers: single
    letters between spaces, each one token, and a final "." when `n` is even."""
    if n <= 0:
        return ""
    text = " ".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range((n + 1) // 2))
    return text if n % 2 else text + "."


def length(tok, messages: list[dict], prompt: bool) -> int:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def fitted(tok, rng, prompt_tokens: int, total: int | None) -> list[dict]:
    """A one-turn conversation whose prompt (with the generation prompt) is `prompt_tokens`
    long and, with `total`, whose whole rendering is `total` long (else a one-token answer)."""
    def conv(user: str, answer: str) -> list[dict]:
        return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]

    user = filler(rng, prompt_tokens - length(tok, conv("", "")[:1], True))
    answer = "a" if total is None else filler(rng, total - length(tok, conv(user, ""), False))
    messages = conv(user, answer)
    got = (length(tok, messages[:1], True), length(tok, messages, False))
    if got[0] != prompt_tokens or (total is not None and got[1] != total):
        raise ValueError(f"a row of {got} tokens where ({prompt_tokens}, {total}) was wanted: "
                         "the tokenizer is not one of bench/make_real_shape_models'")
    return messages


def write_rows(tok, folder: Path, job: Job, kind: str, seed: int = 0) -> dict:
    """sft_train.jsonl of `kind`'s rows for `job.steps` steps and one more; returns the
    row lengths (whole rows) in order."""
    rng = random.Random(seed)
    if kind == "onpolicy":
        n = (job.steps + 1) * job.on_batch * job.on_accum
        rows = [fitted(tok, rng, job.prompt_tokens, None) for _ in range(n)]
    else:
        n = (job.steps + 1) * job.off_batch * job.off_accum
        lo = job.max_length // 2
        rows = [fitted(tok, rng, min(job.prompt_tokens, lo // 2),
                       rng.randint(lo, job.max_length)) for _ in range(n)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sft_train.jsonl").write_text(
        "".join(json.dumps({"messages": r}) + "\n" for r in rows))
    return {"rows": n, "lengths": [length(tok, r, False) for r in rows]}


# --- the four runs -----------------------------------------------------------------------
def distill_cmd(args, job: Job, kind: str, pair_dir: Path, data: Path, timer: Path,
                out: Path) -> list[str]:
    if kind == "onpolicy":
        mode = ["+experiment=hf_onpolicy", f"data.batch_size={job.on_batch}",
                f"trainer.accumulate_grad_batches={job.on_accum}",
                "loss.on_policy.fraction=1.0", f"loss.on_policy.max_new_tokens={job.new_tokens}",
                "loss.on_policy.temperature=1.0"]
    else:
        mode = ["+experiment=hf_sft", "loss.kind=jsd", "data.packing=false",
                f"data.batch_size={job.off_batch}",
                f"trainer.accumulate_grad_batches={job.off_accum}"]
    # the recipes' trainer=auto: bf16 autocast over fp32 weights on a GPU, fp32 on the CPU
    tiny = ["student.dtype=float32", "teacher.dtype=float32"] if args.tiny else []
    return [sys.executable, "-m", "distill.train", *mode, *tiny,
            f"student.name_or_path={pair_dir / 'student'}",
            f"teacher.name_or_path={pair_dir / 'teacher'}", f"paths.data={data}",
            f"paths.output_dir={out}", "data.val=null", "++data.shuffle=false",
            f"data.max_length={job.max_length}",
            "loss.beta=0.5", "loss.temperature=1.0", "loss.ce_weight=0.0",
            f"trainer.max_steps={job.steps}", f"trainer.val_check_interval={job.steps}",
            "callbacks.checkpoint=null", "callbacks.export=null",
            "callbacks.samples=null",  # TRL logs no completions by default either
            f"+callbacks.timer={{_target_:{TIMER},path:'{timer}',warmup:{job.warmup}}}"]


def trl_cmd(job: Job, kind: str, pair_dir: Path, data: Path, timer: Path,
            out: Path) -> list[str]:
    batch, accum = ((job.on_batch, job.on_accum) if kind == "onpolicy"
                    else (job.off_batch, job.off_accum))
    return [sys.executable, str(ROOT / "bench" / "peers_trl.py"),
            "--trainer", "distillation" if kind == "onpolicy" else "gkd",
            "--student", str(pair_dir / "student"), "--teacher", str(pair_dir / "teacher"),
            "--data", str(data / "sft_train.jsonl"), "--timer", str(timer),
            "--out", str(out), "--steps", str(job.steps), "--warmup", str(job.warmup),
            "--batch", str(batch), "--accum", str(accum),
            "--new-tokens", str(job.new_tokens), "--max-length", str(job.max_length)]


def run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout, env=dict(os.environ)).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[bench_peers] timed out after {timeout:.0f} s\n")
            rc = 124
    return rc, round(time.perf_counter() - t0, 1)


def measure(args, job: Job, pair: str, kind: str, who: str, deadline: float) -> dict:
    root, out = args.root / pair, args.out
    name = f"{pair}_{kind}_{who}"
    left = deadline - time.monotonic()
    if left < args.min_run_s:
        return {"skipped": f"not run: {max(left, 0):.0f} s of --budget-s left"}
    timer, run_dir, data = out / f"timer_{name}.json", root / "runs" / name, root / kind
    cmd = (distill_cmd(args, job, kind, root, data, timer, run_dir) if who == "distill"
           else trl_cmd(job, kind, root, data, timer, run_dir))
    if args.dry_run:
        return {"skipped": "dry run", "command": cmd}
    rc, wall = run(cmd, out / f"{name}.log", min(args.timeout, left))
    result = {"rc": rc, "wall_s": wall, "command": cmd}
    if timer.exists():
        result.update(json.loads(timer.read_text()))
    return result


# --- the table ---------------------------------------------------------------------------
def verdict(speedup: float | None, memory: float | None, target: tuple) -> str:
    """met / missed against (speed-up at least, memory fraction at most or None)."""
    want_speed, want_memory = target
    if speedup is None:
        return "not measured"
    if want_memory is not None and memory is None:
        return "memory not measured"
    ok = speedup >= want_speed and (want_memory is None or memory <= want_memory)
    return "met" if ok else "missed"


def target_text(target: tuple) -> str:
    speed, memory = target
    return f">= {speed}x" + (f" at <= {memory:.0%} memory" if memory is not None else "")


def comparison(runs: dict, kind: str, tiny: bool = False) -> dict:
    """distill / TRL for one job: speed-up (TRL's step / distill's), memory fraction."""
    ours, theirs = runs.get(f"{kind}_distill", {}), runs.get(f"{kind}_trl", {})
    speedup = memory = None
    if "median_ms" in ours and "median_ms" in theirs:
        speedup = theirs["median_ms"] / ours["median_ms"]
    if "peak_allocated_gib" in ours and "peak_allocated_gib" in theirs:
        memory = ours["peak_allocated_gib"] / theirs["peak_allocated_gib"]
    return {"speedup": speedup, "memory_fraction": memory,
            "target": target_text(TARGETS[kind]),
            "verdict": ("not judged (tiny shapes)" if tiny
                        else verdict(speedup, memory, TARGETS[kind]))}


def table(pair: str, result: dict) -> str:
    lines = [f"{pair}: {PAIRS[pair]}", "",
             "| job | trainer | step s | peak GiB | tokens / step | distill / TRL speed | "
             "memory fraction | target | |", "|---|---|---|---|---|---|---|---|---|"]
    for (kind, who), name in RUNS.items():
        r = result["runs"].get(f"{kind}_{who}", {})
        if "median_ms" in r:
            step = f"{r['median_ms'] / 1000:.2f}"
            peak = f"{r['peak_allocated_gib']:.1f}" if "peak_allocated_gib" in r else "-"
            tokens = f"{r['median_tokens']:,.0f}"
        else:
            step = r.get("skipped") or f"failed (rc {r.get('rc')}, see the log)"
            peak = tokens = "-"
        cells = ["", "", "", ""]
        if who == "distill":
            c = result["comparisons"][kind]
            cells = [f"{c['speedup']:.2f}x" if c["speedup"] is not None else "-",
                     f"{c['memory_fraction']:.2f}" if c["memory_fraction"] is not None else "-",
                     c["target"], c["verdict"]]
        job = "on-policy" if kind == "onpolicy" else "off-policy"
        lines.append(f"| {job} | {name} | {step} | {peak} | {tokens} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


# --- a pair ------------------------------------------------------------------------------
def build(args, job: Job, pair: str) -> dict:
    import torch
    from make_real_shape_models import build_pair
    from transformers import AutoTokenizer

    root = args.root / pair
    info = {}
    if not (root / "teacher" / "config.json").exists():
        info = build_pair(pair, args.root, args.tiny, "cuda" if torch.cuda.is_available()
                          else "cpu")
    tok = AutoTokenizer.from_pretrained(root / "student")
    for kind in ("onpolicy", "offpolicy"):
        info[f"{kind}_rows"] = write_rows(tok, root / kind, job, kind)
    return info


def bench_pair(args, job: Job, pair: str, deadline: float, save) -> dict:
    result = {"pair": pair, "models": PAIRS[pair], "job": asdict(job), "runs": {}}
    if deadline - time.monotonic() < args.min_run_s:
        result["skipped"] = "not built: --budget-s spent"
    else:
        result["build"] = {} if args.dry_run else build(args, job, pair)
        for kind in ("onpolicy", "offpolicy"):
            for who in ("distill", "trl"):
                result["runs"][f"{kind}_{who}"] = measure(args, job, pair, kind, who, deadline)
                save()
        if not (args.keep or args.dry_run):
            shutil.rmtree(args.root / pair, ignore_errors=True)
    result["comparisons"] = {kind: comparison(result["runs"], kind, args.tiny)
                             for kind in TARGETS}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_out/peers"))
    p.add_argument("--root", type=Path, default=Path("/tmp/distill_peers"),
                   help="model folders and rows (each pair's deleted after it, unless --keep)")
    p.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    p.add_argument("--tiny", action="store_true", help="tiny shapes and rows (CPU)")
    p.add_argument("--steps", type=int, default=None, help="steps a run (8; tiny 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (3; tiny 1)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a run at most")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for the whole call")
    p.add_argument("--min-run-s", type=float, default=None,
                   help="a run starts only with this much of the budget left (60; tiny 0)")
    p.add_argument("--keep", action="store_true", help="keep the model folders")
    p.add_argument("--dry-run", action="store_true",
                   help="build nothing, run nothing: peers.json gets each run's command")
    args = p.parse_args(argv)
    job = TINY if args.tiny else Job()
    job = Job(**{**asdict(job), **{k: v for k, v in (("steps", args.steps),
                                                       ("warmup", args.warmup)) if v}})
    if job.steps <= job.warmup:
        p.error(f"--steps {job.steps} must exceed --warmup {job.warmup}: no step is timed")
    if args.min_run_s is None:
        args.min_run_s = 0 if args.tiny else 60
    args.out.mkdir(parents=True, exist_ok=True)
    args.root.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (args.budget_s if args.budget_s else float("inf"))
    results: dict = {}

    def save():
        (args.out / "peers.json").write_text(json.dumps(results, indent=1))

    for pair in args.pairs:
        results[pair] = bench_pair(args, job, pair, deadline, save)
        save()
    if args.dry_run:
        for pair in args.pairs:
            for r in results[pair]["runs"].values():
                print(" ".join(r["command"]))
        return 0
    for pair in args.pairs:
        print("\n" + table(pair, results[pair]), flush=True)
    missing = [f"{pair} {name}" for pair in args.pairs for name, r in
               results[pair]["runs"].items() if "median_ms" not in r]
    if missing or any("skipped" in results[p] for p in args.pairs):
        print(f"\nnot measured: {', '.join(missing) or 'a pair not built'}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
