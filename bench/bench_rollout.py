"""Rollout bench (GPU): HFSampler, transformers' static-cache generate, the static sampler and
the bandwidth bound, side by side, on random-weight students of public shapes.

    python3 bench/bench_rollout.py --out $OUT/rollout            # ~3-4 min on an H200
    python3 bench/bench_rollout.py --out $OUT/rollout --quick    # ~1 min: Qwen, batch 64, 128

Students (fp32 trainable masters, as in training): Qwen2.5-0.5B and Llama-3.2-1B shapes.
128-token prompts; batches 4/64/256; 128 and 512 new tokens, sampled at temperature 1. The
eos id is a real token, so a row may stop early (rarely, with random weights); tokens/s
counts the tokens actually generated.

- HFSampler: `generate`, dynamic cache, on the fp32 masters under bf16 autocast (as
  DistillModule calls it). By default at every batch for 128 new tokens and at batch 64 for
  512 (`--hf all` for every pair; each call costs seconds).
- HF static: `generate(cache_implementation="static")` on a bf16 copy; transformers
  compiles the decode step on first use of every shape (tens of seconds, reported as its
  warm-up), so it runs at batch 64 / 128 new tokens by default (`--hf-static all`).
- static sampler: `StaticSampler` with CUDA graphs and its fused decode modules; its
  warm-up (generation copy, KV pool, one capture per bucket) is timed once per (student,
  new tokens); then `--repeats` runs per batch; captures after the warm-up and after the
  runs (they must not move), recaptures; its bf16 copy's memory and refresh time.
- static unfused: the same with the model's own transformers modules (`fused=False`), at
  batch 64 / 128 new tokens by default (`--unfused all`).
- bound: every bf16 weight read once per decode step at 4.8 TB/s (the KV cache reads and
  the compute bound beside it, whichever is larger, in `bound_full_s`).

Each measurement runs under a time limit; a failure becomes a row with its error. Rows are
printed as they come (RESULT lines) and rewritten to OUT/rollout.json; a markdown table is
printed at the end.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.harness import Results, environment, gib, timed  # noqa: E402
from bench.rollout_models import (  # noqa: E402
    EOS,
    bf16_weights,
    kv_bytes_per_token,
    prompts,
    student,
    weight_bytes,
)
from distill.onpolicy.samplers import HFSampler, SamplingSettings  # noqa: E402
from distill.onpolicy.static_sampler import StaticSampler  # noqa: E402

HBM = 4.8e12  # H200 bytes/s
BF16_FLOPS = 989e12  # H200 dense bf16
PROMPT = 128
DEVICE = "cuda"  # --cpu-dry-run: tiny student on CPU, to test this script


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for rollout.json")
    ap.add_argument("--quick", action="store_true", help="Qwen only, batch 64, 128 new tokens")
    ap.add_argument("--students", nargs="+", default=["qwen2.5-0.5b", "llama-3.2-1b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[4, 64, 256])
    ap.add_argument("--new-tokens", nargs="+", type=int, default=[128, 512])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of the static sampler")
    ap.add_argument("--hf", choices=["some", "all", "none"], default="some")
    ap.add_argument("--hf-static", choices=["some", "all", "none"], default="some")
    ap.add_argument("--unfused", choices=["some", "all", "none"], default="some",
                    help="the static sampler without its fused decode modules")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="tiny student on CPU, few tokens: tests this script")
    args = ap.parse_args()
    if args.cpu_dry_run:
        args.students, args.batches, args.new_tokens = ["tiny"], [4, 8], [8, 16]
    if args.quick:
        args.students, args.batches, args.new_tokens = ["qwen2.5-0.5b"], [64], [128]
    return args


def chosen(level: str, batch: int, new: int, default) -> bool:
    return level == "all" or (level == "some" and default(batch, new))


def measure(fn, repeats: int) -> dict:
    """Median seconds over `repeats`, generated tokens, tokens/s, peak memory above now."""
    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    seconds, runs, out = timed(fn, repeats)
    tokens = sum(map(len, out))
    return {"seconds": round(seconds, 4), "runs": [round(r, 4) for r in runs],
            "tokens": tokens, "tokens_per_s": round(tokens / seconds),
            "peak_extra_gib": gib(torch.cuda.max_memory_allocated() - base) if cuda else None}


def bounds(results: Results, name: str, model, batches, news) -> None:
    weights = weight_bytes(model)
    params = sum(p.numel() for p in model.parameters())
    for new in news:
        for batch in batches:
            kv = kv_bytes_per_token(model) * batch * (PROMPT + new / 2)  # mean length read
            step = max((weights + kv) / HBM, 2 * params * batch / BF16_FLOPS)
            results.add(what="bound", student=name, method="bound", batch=batch, new=new,
                        seconds=round(weights / HBM * new, 6),
                        bound_full_s=round(step * new, 6),
                        tokens_per_s=round(batch * new / (weights / HBM * new)),
                        status="done")


def static_sampler_rows(results: Results, name: str, model, rows, new: int, batches,
                        repeats: int, fused: bool | None) -> None:
    """fused None: the default (fused where the model allows), False: the model's modules."""
    vocab = model.config.vocab_size
    s = StaticSampler(1.0, 1.0, new, [EOS], 0, vocab, fused=fused)
    method = "static unfused" if fused is False else "static"
    state = {}

    def warm():
        state["warm_s"] = timed(lambda: s.warmup(model, batches, PROMPT))[0]
        engine = s.engine(model)
        state["refresh_ms"] = round(timed(engine.copy.refresh, repeats=5)[0] * 1e3, 2)
        state["captures"] = s.captures
        return {"warmup_s": round(state["warm_s"], 2), "refresh_ms": state["refresh_ms"],
                "copy_gib": gib(engine.copy_bytes), "kv_gib": gib(engine.pool.nbytes),
                "captures": s.captures, "recaptures": s.recaptures, "fused": engine.copy.fused,
                "buckets": {str(k): (bool(b.graph), b.graph_picks, round(b.capture_s, 3))
                            for k, b in engine.buckets.items()}}

    results.attempt("static sampler warm-up", 180, warm, student=name, method=method,
                    new=new)
    for batch in batches:
        def run(batch=batch):
            row = measure(lambda: s(model, rows[:batch], seed=batch), repeats)
            return {**row, "warmup_s": round(state.get("warm_s", float("nan")), 2),
                    "fused": s.engine(model).copy.fused,
                    "captures": s.captures, "recaptures": s.recaptures,
                    "captures_moved": s.captures != state.get("captures"),
                    "steps": s.last.get("steps")}

        results.attempt("static sampler", 120, run, student=name, method=method,
                        batch=batch, new=new)
    s = None  # the copy and the KV pool go before the next measurement
    torch.cuda.empty_cache() if DEVICE == "cuda" else None


def hf_rows(results: Results, args, name: str, model, rows, new: int) -> None:
    vocab = model.config.vocab_size
    hf = HFSampler(SamplingSettings(1.0, 1.0, new, [EOS], 0, vocab))
    for batch in args.batches:
        if not chosen(args.hf, batch, new, lambda b, n: n == 128 or b == 64):
            continue

        def run(batch=batch):
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                return measure(lambda: hf(model, rows[:batch], seed=batch), 1)

        results.attempt("HFSampler", 90, run, student=name, method="HFSampler",
                        batch=batch, new=new)


def hf_static_rows(results: Results, args, name: str, bf16_model, rows, new: int) -> None:
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                              max_new_tokens=new, eos_token_id=[EOS], pad_token_id=0,
                              cache_implementation="static")

    def generate(batch):
        ids = torch.tensor(rows[:batch], device=DEVICE)
        with torch.no_grad():
            out = bf16_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      generation_config=config)
        return [_until_eos(r) for r in out[:, PROMPT:].tolist()]

    for batch in args.batches:
        if not chosen(args.hf_static, batch, new, lambda b, n: n == 128 and b == 64):
            continue

        def run(batch=batch):
            start = time.perf_counter()
            generate(batch)  # the first call compiles this shape
            warm = time.perf_counter() - start  # (.tolist() synchronized)
            return {**measure(lambda: generate(batch), 2), "warmup_s": round(warm, 1)}

        results.attempt("HF static", 150, run, student=name, method="HF static",
                        batch=batch, new=new)


def _until_eos(row: list[int]) -> list[int]:
    return row[: row.index(EOS) + 1] if EOS in row else row


def table(results: Results) -> str:
    hf = {(r["student"], r["batch"], r["new"]): r["seconds"] for r in results.rows
          if r.get("method") == "HFSampler" and "seconds" in r}
    lines = ["| student | new | batch | method | s / rollout | tokens/s | warm-up s | "
             "peak extra GiB | captures / recaptures | vs HFSampler |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    order = {"HFSampler": 0, "HF static": 1, "static unfused": 2, "static": 3, "bound": 4}
    rows = [r for r in results.rows if r.get("method") in order and "batch" in r]
    rows.sort(key=lambda r: (r["student"], r["new"], r["batch"], order[r["method"]]))
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['student']} | {r['new']} | {r['batch']} | {r['method']} | "
                         f"error: {r['error'][:80]} | | | | | |")
            continue
        base = hf.get((r["student"], r["batch"], r["new"]))
        speed = f"{base / r['seconds']:.1f}x" if base and r["seconds"] and \
            r["method"] != "HFSampler" else ""
        caps = f"{r['captures']} / {r['recaptures']}" if "captures" in r else ""
        seconds = f"{r['seconds']:.4f}" + (f" ({r['bound_full_s']:.4f})"
                                           if "bound_full_s" in r else "")
        lines.append(f"| {r['student']} | {r['new']} | {r['batch']} | {r['method']} | "
                     f"{seconds} | {r.get('tokens_per_s', '')} | {r.get('warmup_s', '')} | "
                     f"{r.get('peak_extra_gib', '')} | {caps} | {speed} |")
    return "\n".join(lines)


def main() -> int:
    global DEVICE
    args = parse()
    if args.cpu_dry_run:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: this bench is for the GPU machine (or --cpu-dry-run)")
        return 2
    meta = {**environment(), "args": {k: str(v) for k, v in vars(args).items()}}
    print("environment:", meta, flush=True)
    results = Results(args.out / "rollout.json", meta)
    start = time.perf_counter()
    for name in args.students:
        print(f"\n=== {name}", flush=True)
        model = student(name, DEVICE)
        rows = prompts(max(args.batches), PROMPT, model.config.vocab_size, seed=0)
        bounds(results, name, model, args.batches, args.new_tokens)
        for new in args.new_tokens:
            static_sampler_rows(results, name, model, rows, new, args.batches, args.repeats,
                                fused=None)
            plain = [b for b in args.batches if chosen(args.unfused, b, new,
                                                        lambda b, n: b == 64 and n == 128)]
            if plain:  # the model's own modules, for the fused modules' share of the gain
                static_sampler_rows(results, name, model, rows, new, plain, args.repeats,
                                    fused=False)

        def hf_first_call(model=model, rows=rows):  # HF's own first-call costs, once
            hf = HFSampler(SamplingSettings(1.0, 1.0, 4, [EOS], 0, model.config.vocab_size))
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                return measure(lambda: hf(model, rows[:4], seed=0), 1)

        if args.hf != "none":
            results.attempt("HFSampler first call", 120, hf_first_call, student=name)
        for new in args.new_tokens:
            hf_rows(results, args, name, model, rows, new)
        if args.hf_static != "none":
            bf16_model = bf16_weights(copy.deepcopy(model)).eval().requires_grad_(False)
            for new in args.new_tokens:
                hf_static_rows(results, args, name, bf16_model, rows, new)
            del bf16_model
        del model
        torch.cuda.empty_cache() if DEVICE == "cuda" else None
        print(f"--- {name} done at {time.perf_counter() - start:.0f} s", flush=True)
    print("\n" + table(results))
    print("\nbound: weights once per step at 4.8 TB/s; in brackets with the KV reads and the "
          "compute bound (989 TFLOP/s). Warm-up of the static sampler: once per (student, new "
          "tokens), all its batch buckets.")
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
