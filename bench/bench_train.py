"""Benchmark the whole distillation step at real scale (one GPU), or tiny on CPU (--tiny).

    python bench/bench_train.py --out $OUT/train        # Llama 1B+8B, Qwen2.5 0.5B+7B
    python bench/bench_train.py --tiny                  # the same code on CPU, tiny shapes

Random weights built on the device; the student keeps fp32 master weights and AdamW state
and runs under bf16 autocast (Lightning's bf16-mixed), the live teacher is bf16. A step is
Lightning's automatic-optimization inner calls: DistillModule.training_step, backward,
gradient clipping at norm 1, AdamW step, zero_grad. Rows, side by side in one run:
the teacher forward alone (the floor), the plain HF way (both models' full logits + torch
forward KL), distill's step (fused forward KL), distill's step on cached top-64 targets
(tensors already on the GPU, then from a DataLoader that prefetches them in workers), and
each lever (distill/models/levers.py) on distill's step. Reports median step time (CUDA events),
tokens/s, MFU, peak memory, and the largest micro-batch that fits (a bounded search).

MFU counts 6 N_student + 2 N_teacher FLOPs per token (N: the parameters in matrix products,
LM heads included, embeddings lookups not) over the H200's dense bf16 peak (989.4 TFLOP/s);
"MFU+attn" adds causal attention (6 L d T for the student, 2 L d T for the teacher, d the
attention width, T the sequence length). A row that does not fit the --budget-s time left
is skipped and says so. Prints one markdown table; writes bench_train.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_loss import _time  # noqa: E402  (one timing loop for every bench)
from bench_train_steps import (  # noqa: E402  (models, batches and the step kinds)
    TargetsOnDevice,
    build,
    distill_step,
    full_logits_step,
    loader_step,
    make_batch,
    make_module,
    teacher_step,
    top_k_targets,
)

from distill.models.levers import Speed, apply_levers, decoder_layers  # noqa: E402

PEAK_TFLOPS = 989.4  # H200 SXM dense bf16, datasheet
GIB = 1 << 30
class Run:
    """Device, shapes, the time budget and the rows measured so far."""

    def __init__(self, args):
        self.args, self.rows, self.t0 = args, [], time.time()
        self.device = torch.device("cpu" if args.tiny else "cuda")
        self.cuda = self.device.type == "cuda"
        self.reset = lambda: None  # drops what a failed step left (its gradients)

    def left(self) -> float:
        return self.args.budget_s - (time.time() - self.t0)

    def add(self, row: dict) -> None:
        row["at_s"] = round(time.time() - self.t0, 1)
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        if self.args.out:
            self.args.out.mkdir(parents=True, exist_ok=True)
            (self.args.out / "bench_train.json").write_text(
                json.dumps(dict(env=environment(self.cuda), rows=self.rows), indent=1))


# --- measuring ----------------------------------------------------------------------------
def timed_ms(fn, run: Run, warm: int, reps: int) -> float:
    for _ in range(warm):
        fn()
    if run.cuda:
        return _time(fn, reps, warm=False)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def matmul_params(model, head: bool = True) -> int:
    """Parameters that take part in matrix products: all but the embedding lookup (a tied
    head still multiplies); without the head for a base forward."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    n = total if tied else total - embed
    return n if head else n - model.get_output_embeddings().weight.numel()


def attention_flops(model, seq: int) -> float:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    width = c.num_attention_heads * head_dim
    return 2 * c.num_hidden_layers * width * seq  # causal forward, per token


def flops_per_token(kind: str, student, teacher, seq: int) -> tuple[float, float]:
    """(dense, attention) FLOPs per token of one row."""
    if kind == "teacher":
        return 2 * matmul_params(teacher, head=False), attention_flops(teacher, seq)
    dense = 6 * matmul_params(student)
    attn = 3 * attention_flops(student, seq)
    if kind == "live":
        dense += 2 * matmul_params(teacher)
        attn += attention_flops(teacher, seq)
    return dense, attn


def measure(run: Run, name: str, make_step, rows: int, flops: tuple, est_s: float,
            warm: int = 2, reps: int | None = None, **extra) -> dict | None:
    """Time one step kind at `rows` x seq tokens; None (and a skipped row) when the budget
    is short or it does not fit."""
    row = dict(name=name, rows=rows, seq=run.args.seq, **extra)
    if run.left() < est_s:
        row["skipped"] = f"time budget ({run.left():.0f} s left, needs ~{est_s:.0f} s)"
        run.add(row)
        return None
    t0 = time.time()
    run.reset()
    try:
        step = make_step(rows)
        if run.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        ms = timed_ms(step, run, warm, reps or run.args.reps)
        tokens = rows * run.args.seq
        row.update(ms=round(ms, 1), tokens_per_s=round(tokens / ms * 1e3),
                   mfu=round(tokens / ms * 1e3 * flops[0] / PEAK_TFLOPS / 1e12, 4),
                   mfu_attn=round(tokens / ms * 1e3 * sum(flops) / PEAK_TFLOPS / 1e12, 4))
        if run.cuda:
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 1)
    except torch.OutOfMemoryError:
        row["skipped"] = "OOM"
    except Exception as err:  # noqa: BLE001 - a lever that fails is a result, not a crash
        row["skipped"] = f"failed: {type(err).__name__}: {str(err)[:300]}"
    row["wall_s"] = round(time.time() - t0, 1)
    free(run)
    run.add(row)
    return row if "ms" in row else None


def free(run: Run) -> None:
    import gc

    gc.collect()
    if run.cuda:
        torch.cuda.empty_cache()


def largest_batch(run: Run, name: str, make_step, flops, est_per_row_s: float) -> None:
    """Try the --max-rows sizes in order, one step each; stop at the first that fails."""
    fits = None
    for rows in run.args.max_rows:
        r = measure(run, f"{name} [fit]", make_step, rows, flops, est_per_row_s * rows,
                    warm=1, reps=1, search=True)
        if r is None:
            break
        fits = rows
    run.add(dict(name=f"{name}: largest micro-batch", largest_rows=fits,
                 tried=run.args.max_rows, seq=run.args.seq, search=True))


# --- the run ------------------------------------------------------------------------------
def bench_pair(run: Run, pair: str, levers: bool) -> None:
    args, t0 = run.args, time.time()
    student, teacher = build(pair, run)
    vocab = student.config.vocab_size
    run.add(dict(name=f"{pair}: built", wall_s=round(time.time() - t0, 1),
                 student_params=sum(p.numel() for p in student.parameters()),
                 teacher_params=sum(p.numel() for p in teacher.parameters())))
    module = make_module(student, teacher, vocab)
    run.reset = lambda: module.optimizer.zero_grad(set_to_none=True)
    seq, rows = args.seq, args.rows

    def at(step_fn, mod=module):
        return lambda n: step_fn(mod, make_batch(n, seq, vocab, run.device), run)

    def flops(kind):
        return flops_per_token(kind, student, teacher.model, seq)

    def row(name, fn, kind, est, **kw):
        return measure(run, f"{pair}: {name}", fn, rows, flops(kind), est * run.scale, **kw)

    row("teacher forward alone (floor)", at(teacher_step), "teacher", 6)
    row("full logits + torch KL", at(full_logits_step), "live", 10)
    row("distill", at(distill_step), "live", 10)
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    row("distill, checkpointing", at(distill_step), "live", 10, lever="gradient_checkpointing")
    row("full logits, checkpointing", at(full_logits_step), "live", 10,
        lever="gradient_checkpointing")
    student.gradient_checkpointing_disable()

    ids, lps = top_k_targets(teacher, make_batch(rows, seq, vocab, run.device), vocab)
    cached = make_module(student, TargetsOnDevice(), vocab)
    cached.optimizer = module.optimizer  # one AdamW state for the student, whatever the row

    def cached_at(n, fn=distill_step):
        reps = -(-n * (seq - 1) // len(ids))
        cached.teacher.ids = ids.repeat(reps, 1)[:n * (seq - 1)]
        cached.teacher.logprobs = lps.repeat(reps, 1)[:n * (seq - 1)]
        return fn(cached, make_batch(n, seq, vocab, run.device), run)

    row("cached top-64, targets on the GPU", cached_at, "cached", 5)
    row("cached top-64, targets from a prefetching DataLoader (2 workers)",
        lambda n: loader_step(cached, make_batch(n, seq, vocab, run.device), run,
                              ids[:n * (seq - 1)], lps[:n * (seq - 1)], workers=2),
        "cached", 8)
    if levers:
        max_batches(run, pair, student, at, cached_at, flops)
        lever_rows(run, student, teacher, row, at)
    run.reset = lambda: None


def max_batches(run: Run, pair: str, student, at, cached_at, flops) -> None:
    per_row = 0.15 * run.scale  # seconds per 2048-token row and step, with margin
    for ckpt in (True, False):
        if ckpt:
            student.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        tag = ", checkpointing" if ckpt else ""
        largest_batch(run, f"{pair}: distill{tag}", at(distill_step), flops("live"), per_row)
        largest_batch(run, f"{pair}: full logits + torch KL{tag}", at(full_logits_step),
                      flops("live"), per_row)
        largest_batch(run, f"{pair}: cached top-64{tag} (live teacher still loaded)",
                      cached_at, flops("cached"), per_row / 3)
        student.gradient_checkpointing_disable()


def lever_rows(run: Run, student, teacher, row, at) -> None:
    t0 = time.time()
    applied = "not asked for (--levers)" if "compile" not in run.args.levers else _try(
        lambda: apply_levers(Speed(compile=True), student, teacher.model))
    if isinstance(applied, str):
        run.add(dict(name="lever compile", skipped=applied))
    else:
        # the first runs compile: their wall time is the compile cost
        row("teacher forward alone, compiled", at(teacher_step), "teacher", 60,
            lever="compile", warm=3)
        row("distill, compiled", at(distill_step), "live", 90, lever="compile", warm=3)
        run.add(dict(name="lever compile: wall time of both rows", wall_s=round(
            time.time() - t0, 1)))
        for model in (student, teacher.model):
            for layer in decoder_layers(model):
                layer._compiled_call_impl = None
        torch._dynamo.reset()
    for lever, speed in (("flash-attention varlen", Speed(attention="flash_attention_2")),
                         ("liger", Speed(liger=True))):  # liger patches for good: last
        if lever.split("-")[0] not in run.args.levers:
            continue
        applied = _try(lambda speed=speed: apply_levers(speed, student, teacher.model))
        if isinstance(applied, str):
            run.add(dict(name=f"lever {lever}", skipped=applied))
            continue
        row(f"teacher forward alone, {lever}", at(teacher_step), "teacher", 8, lever=lever)
        row(f"distill, {lever}", at(distill_step), "live", 12, lever=lever)


def _try(fn):
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - an unavailable lever is reported, not fatal
        return f"unavailable: {type(err).__name__}: {str(err)[:300]}"


def environment(cuda: bool) -> dict:
    import lightning
    import transformers

    env = dict(torch=torch.__version__, transformers=transformers.__version__,
               lightning=lightning.__version__)
    if cuda:
        env.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return env


def table(rows: list[dict]) -> str:
    lines = ["| step | micro-batch | ms | tokens/s | x floor | MFU (6N+2N) | MFU + attn | "
             "peak GiB |", "|---|---|---|---|---|---|---|---|"]
    floors = {r["name"].split(":")[0]: r["ms"] for r in rows
              if r["name"].endswith("teacher forward alone (floor)") and "ms" in r}
    for r in rows:
        if r.get("search") and "largest_rows" in r:
            lines.append(f"| {r['name']} | {r['largest_rows']} x "
                         f"{r.get('seq', '')} of {r['tried']} | | | | | | |")
        elif r.get("search") or "rows" not in r:
            continue
        elif "skipped" in r:
            lines.append(f"| {r['name']} | {r['rows']} x {r['seq']} | {r['skipped']} "
                         "| | | | | |")
        else:
            floor = floors.get(r["name"].split(":")[0])
            ratio = f"{r['ms'] / floor:.2f}x" if floor else ""
            lines.append(f"| {r['name']} | {r['rows']} x {r['seq']} | {r['ms']:.0f} | "
                         f"{r['tokens_per_s']:,} | {ratio} | {r['mfu']:.1%} | "
                         f"{r['mfu_attn']:.1%} | {r.get('peak_gib', '')} |")
    return "\n".join(lines)


def targets(rows: list[dict]) -> str:
    """The issue's targets, measured values side by side (met or not)."""
    by = {r["name"]: r for r in rows}
    lines = []
    for pair in dict.fromkeys(r["name"].split(":")[0] for r in rows if ":" in r["name"]):
        def get(name, key, pair=pair):
            return by.get(f"{pair}: {name}", {}).get(key)
        floor, step = get("teacher forward alone (floor)", "ms"), get("distill", "ms")
        best = min((r for r in rows if r["name"].startswith(f"{pair}: distill") and "ms" in r
                    and not r.get("search")), key=lambda r: r["ms"], default=None)
        if floor and step:
            lines.append(f"- {pair}: distill's step / teacher forward = {step / floor:.2f}x "
                         f"(target <= 1.5x), MFU {get('distill', 'mfu'):.1%} (target >= 55%)")
        if best and floor:
            lines.append(f"- {pair}: fastest distill row '{best['name']}': "
                         f"{best['ms'] / floor:.2f}x the plain floor, MFU {best['mfu']:.1%}")
        fits = [get(f"{n}: largest micro-batch", "largest_rows")
                for n in ("distill, checkpointing", "distill")]
        full = [get(f"{n}: largest micro-batch", "largest_rows")
                for n in ("full logits + torch KL, checkpointing", "full logits + torch KL")]
        if any(fits) and any(full):
            lines.append(f"- {pair}: largest micro-batch distill {max(f or 0 for f in fits)} "
                         f"vs full logits {max(f or 0 for f in full)} rows (target >= 4x; "
                         "a largest equal to the last size tried is a lower bound)")
        for how in ("targets on the GPU", "targets from a prefetching DataLoader (2 workers)"):
            cached = get(f"cached top-64, {how}", "tokens_per_s")
            if cached and get("distill", "tokens_per_s"):
                lines.append(f"- {pair}: cached ({how}) / live tokens/s = "
                             f"{cached / get('distill', 'tokens_per_s'):.2f}x (target >= 2.5x)")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # qwen first: it gets no levers, and the llama pair's models then need not share the GPU
    p.add_argument("--pairs", nargs="+", default=["qwen", "llama"], choices=["llama", "qwen"])
    p.add_argument("--rows", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-rows", type=int, nargs="*", default=[16, 32, 64, 96],
                   help="micro-batch sizes tried for the largest that fits (empty: skip)")
    p.add_argument("--levers-on", nargs="*", default=["llama"],
                   help="pairs that get the largest-batch search and the lever rows")
    p.add_argument("--levers", nargs="*", default=["compile", "flash", "liger"],
                   choices=["compile", "flash", "liger"])
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="rows that would end past this many seconds are skipped")
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) / "train"
                   if os.environ.get("OUT") else None)
    p.add_argument("--tiny", action="store_true", help="CPU, tiny shapes: the code path only")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq, args.rows, args.reps = min(args.seq, 32), min(args.rows, 2), min(args.reps, 2)
        args.max_rows = [r for r in args.max_rows if r <= 4] or [2]
    elif not torch.cuda.is_available():
        p.error("no CUDA device: run with --tiny on CPU")
    run = Run(args)
    run.scale = 0.01 if args.tiny else args.rows * args.seq / 32768  # est. seconds scale
    print(json.dumps(environment(run.cuda)), flush=True)

    def report(*_):  # also on `timeout`'s SIGTERM: the rows measured so far
        print(table(run.rows))
        print(targets(run.rows), flush=True)
        sys.exit(1)

    before = signal.signal(signal.SIGTERM, report)
    try:
        for pair in args.pairs:
            bench_pair(run, pair, levers=pair in args.levers_on)
            free(run)
    finally:  # main() called in-process (the tests) gives the handler back
        signal.signal(signal.SIGTERM, before)
    print(table(run.rows))
    print(targets(run.rows))
    return run.rows


if __name__ == "__main__":
    main()
