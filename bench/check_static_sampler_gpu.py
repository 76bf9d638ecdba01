"""GPU correctness check of the static sampler (about a minute on an H200).

    python3 bench/check_static_sampler_gpu.py --out $OUT/check

Every check runs under its own time limit and reports PASS / FAIL / ERROR with what it saw;
one failing check never stops the others. On small random GQA models (Qwen2 and Llama
classes): greedy completions equal HF generate's in fp32 (exact) and are a near-argmax of
HF's own bf16 forward in bf16 (bf16 kernels differ, so token equality there is reported,
not required); CUDA-graph decoding gives the same tokens as eager decoding; seeds, padded
head rows, eos stopping, LoRA; no capture after the warm-up; and the timing at batch 64 of
the Qwen2.5-0.5B-shaped student (target <= 0.25 s for 128 new tokens after 128-token
prompts) against HFSampler.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.harness import Results, environment, gib, timed  # noqa: E402
from bench.rollout_models import EOS, bf16_weights, prompts, small, student  # noqa: E402
from distill.onpolicy.samplers import HFSampler, SamplingSettings  # noqa: E402
from distill.onpolicy.static_sampler import StaticSampler  # noqa: E402

VOCAB = 1000  # tokenizer entries of the small models; their heads have 1024 rows
DEVICE = "cuda"  # --cpu-dry-run: the same code on CPU (graph checks then fail), to test it


def sampler(temperature=0.0, top_p=1.0, new=32, eos=(EOS,), vocab=VOCAB, **kw):
    return StaticSampler(temperature, top_p, new, list(eos), 0, vocab, **kw)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def hf_generate(model, rows, new, vocab=VOCAB, eos=(EOS,)):
    """HF generate, greedy (HFSampler's path: top_k plays no part when greedy)."""
    return HFSampler(SamplingSettings(0.0, 1.0, new, list(eos), 0, vocab))(model, rows, seed=0)


def bucket_report(s: StaticSampler) -> list:
    return [{"bucket": key, "graph": "captured" if b.graph else ("failed" if b.graph is False
                                                                 else "none"),
             "choice_in_graph": b.graph_picks, "capture_s": round(b.capture_s, 3),
             "fused": bool(e.copy and e.copy.fused)}
            for e in s._engines.values() for key, b in e.buckets.items()]


# the ways a model decodes: through the fused bf16 copy (a trainable Llama-family student's
# default), through a plain copy, or as it is (a frozen model already in bf16: the teacher)
PATHS = ("fused", "copy", "frozen")


def on_path(path: str, model):
    """(sampler kwargs, model) for a decode path; `model` is a small fp32 model."""
    if path == "frozen":
        return {}, bf16_weights(model.requires_grad_(False))
    return {"fused": path == "fused"}, model.train()


def check_capture_smoke():
    out, ok = {}, True
    for path in PATHS:
        kwargs, model = on_path(path, small("qwen2", DEVICE))
        s = sampler(new=8, **kwargs)
        got = s(model, prompts(4, (3, 20), VOCAB), seed=0)
        buckets = bucket_report(s)
        path_ok = s.captures == 1 and all(b["graph"] == "captured" and b["choice_in_graph"]
                                          for b in buckets) and len(got) == 4
        out[path] = {"ok": path_ok, "captures": s.captures, "buckets": buckets}
        ok &= path_ok
    return {"ok": ok, **out}


def check_kernels_per_step():
    """CUDA kernels in one eager decode step of a 4-layer model (profiler), per path."""
    from torch.profiler import ProfilerActivity, profile

    from distill.onpolicy.static_kv import ATTENTION, attention_as

    out = {}
    for path in PATHS:
        kwargs, model = on_path(path, small("qwen2", DEVICE))
        rows = prompts(16, (3, 20), VOCAB)
        s = sampler(new=8, **kwargs)
        s(model, rows, seed=0)
        engine = s.engine(model)
        b = next(iter(engine.buckets.values()))
        with torch.no_grad(), attention_as(engine.model.config, ATTENTION):
            engine._prefill(b, rows, 0, 0)
            sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine._pick(b, engine._advance(b))
                sync()
        kernels = [e for e in prof.events() if str(e.device_type).endswith("CUDA")]
        out[path] = {"kernels": len(kernels), "per_layer": round(len(kernels) / 4, 1)}
    return {"ok": out["fused"]["kernels"] < out["copy"]["kernels"], **out}


def check_draws_match_the_oracle():
    from distill.onpolicy.draws import uniforms, uniforms_reference

    rows = torch.tensor([0, 1, 7, 1000, 2**40], device=DEVICE)
    bad = 0
    for seed in (0, 5, 2**62 - 1):
        for step in (0, 3, 511):
            got = uniforms(torch.tensor(seed, device=DEVICE), rows,
                           torch.tensor(step, device=DEVICE)).double().cpu()
            want = torch.tensor([uniforms_reference(seed, int(r), step) for r in rows])
            bad += int((got != want).sum())
    return {"ok": bad == 0, "mismatches": bad}


def check_greedy_fp32_equals_hf():
    out = {}
    for family in ("qwen2", "llama"):
        for path in ("fused", "copy"):
            kwargs, model = on_path(path, small(family, DEVICE))
            rows = prompts(24, (3, 40), VOCAB, seed=1)
            got = sampler(new=32, dtype=torch.float32, **kwargs)(model, rows, seed=0)
            want = hf_generate(model, rows, 32)
            out[f"{family}/{path}"] = {"rows_equal": sum(a == b for a, b in zip(got, want)),
                                       "rows": len(rows)}
    return {"ok": all(v["rows_equal"] == v["rows"] for v in out.values()), **out}


def worst_gap(ref, rows, completions) -> float:
    """Largest (max logit - logit of the chosen token) / |max logit| over every generated
    position, under `ref`'s full forward of prompt + completion (teacher-forced)."""
    worst = 0.0
    with torch.no_grad():
        for p, c in zip(rows, completions):
            logits = ref(torch.tensor([p + c], device=DEVICE)).logits[0, len(p) - 1: -1, :VOCAB]
            logits = logits.float()
            top = logits.max(-1).values
            chosen = logits.gather(-1, torch.tensor(c, device=DEVICE)[:, None])[:, 0]
            worst = max(worst, float(((top - chosen) / top.abs().clamp(min=1)).max()))
    return worst


def check_greedy_bf16_near_argmax():
    """Tokens equal to HF bf16 generate's where the kernels allow; every token a near-argmax
    of HF's own bf16 forward over the sequence, as near as HF generate's own tokens are (bf16
    decoding drifts from the full forward by a few bf16 steps, in HF too)."""
    out, ok = {}, True
    for family, path in (("qwen2", "fused"), ("llama", "fused"), ("qwen2", "copy")):
        model = small(family, DEVICE).train()  # fp32 masters -> the sampler's bf16 copy
        ref = bf16_weights(copy.deepcopy(model)).eval()  # the same bf16 roundings
        rows = prompts(24, (3, 40), VOCAB, seed=2)
        s = sampler(new=32, dtype=torch.bfloat16, fused=path == "fused")
        got = s(model, rows, seed=0)
        want = hf_generate(ref, rows, 32)
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                  for a, b in zip(got, want)]
        ours, theirs = worst_gap(ref, rows, got), worst_gap(ref, rows, want)
        fam_ok = ours <= max(2 * theirs, 4 * 2**-8)
        ok &= fam_ok
        out[f"{family}/{path}"] = {"rows_equal": sum(a == b for a, b in zip(got, want)),
                                   "rows": len(rows),
                       "mean_equal_prefix": sum(prefix) / len(prefix),
                       "worst_relative_gap": round(ours, 5),
                       "hf_generate_worst_relative_gap": round(theirs, 5), "ok": fam_ok}
    return {"ok": ok, **out}


def check_graph_equals_eager():
    rows = prompts(20, (3, 60), VOCAB, seed=3)
    out, ok = {}, True
    for path in PATHS:
        kwargs, model = on_path(path, small("llama", DEVICE))
        for temperature, top_p in ((0.0, 1.0), (1.0, 1.0), (0.8, 0.9)):
            graphed = sampler(temperature, top_p, new=48, **kwargs)
            eager = sampler(temperature, top_p, new=48, cuda_graphs=False, **kwargs)
            a, b = graphed(model, rows, seed=7), eager(model, rows, seed=7)
            key = f"{path}/T={temperature},top_p={top_p}"
            buckets = bucket_report(graphed)
            out[key] = {"equal": a == b, "rows_equal": sum(x == y for x, y in zip(a, b)),
                        "choice_in_graph": all(x["choice_in_graph"] for x in buckets),
                        "buckets": buckets}
            ok &= a == b and graphed.captures >= 1
    return {"ok": ok, **out}


def check_seeds_and_padded_rows():
    model = small("qwen2", DEVICE).requires_grad_(False)
    with torch.no_grad():
        model.get_output_embeddings().weight[VOCAB:] *= 30  # padded rows: the likeliest
    model = bf16_weights(model)
    rows = prompts(16, (3, 30), VOCAB, seed=4)
    s = sampler(1.0, 0.95, new=40)
    a, b, c = s(model, rows, seed=1), s(model, rows, seed=1), s(model, rows, seed=2)
    top = max(max(r) for r in a + c)
    return {"ok": a == b and a != c and top < VOCAB, "same_seed_equal": a == b,
            "other_seed_differs": a != c, "largest_id": top}


def check_eos_stops_early():
    model = bf16_weights(small("llama", DEVICE).requires_grad_(False))
    rows = prompts(16, (3, 30), VOCAB, seed=5)
    free = sampler(new=4, eos=(VOCAB + 5,))(model, rows, seed=0)  # an id never written
    eos = sorted({r[0] for r in free} | {r[1] for r in free})  # every row stops by token 2
    s = sampler(new=64, eos=eos, check_every=8)
    got = s(model, rows, seed=0)
    ends = all(r[-1] in eos and all(t not in eos for t in r[:-1]) for r in got)
    return {"ok": ends and s.last["steps"] == [8], "steps_run": s.last["steps"],
            "lengths": list(map(len, got))}


def check_no_recapture_after_warmup():
    model = small("qwen2", DEVICE).train()
    s = sampler(1.0, 1.0, new=24)
    s.warmup(model, [4, 64], prompt_len=128)
    after_warmup = s.captures
    for count, length in ((3, (5, 120)), (40, (5, 128)), (64, (100, 128)), (4, 100), (64, 65)):
        s(model, prompts(count, length, VOCAB), seed=count)
    return {"ok": s.captures == after_warmup == 2 and s.recaptures == 0,
            "captures_after_warmup": after_warmup, "captures": s.captures,
            "recaptures": s.recaptures, "buckets": bucket_report(s)}


def check_lora_fp32_equals_hf():
    from distill.models.lora import LoraConfig, apply_lora

    model = apply_lora(small("llama", DEVICE), LoraConfig(**{"r": 8})).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    rows = prompts(16, (3, 40), VOCAB, seed=6)
    got = sampler(new=32, dtype=torch.float32)(model, rows, seed=0)
    want = hf_generate(model, rows, 32)
    return {"ok": got == want, "rows_equal": sum(a == b for a, b in zip(got, want)),
            "rows": len(rows)}


def timing(model, rows, fused: bool) -> dict:
    """The static sampler on `model` at len(rows) rows, 128 new tokens: warm-up, 3 runs."""
    vocab = model.config.vocab_size
    s = StaticSampler(1.0, 1.0, 128, [EOS], 0, vocab, fused=fused)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    warm_s, _, _ = timed(lambda: s.warmup(model, [len(rows)], prompt_len=128))
    engine = s.engine(model)
    refresh_s, _, _ = timed(engine.copy.refresh, repeats=5)
    seconds, runs, out = timed(lambda: s(model, rows, seed=1), repeats=3)
    tokens = sum(map(len, out))
    row = {"warmup_s": round(warm_s, 2), "seconds": round(seconds, 4),
           "runs": [round(r, 4) for r in runs], "tokens": tokens,
           "tokens_per_s": round(tokens / seconds), "captures": s.captures,
           "recaptures": s.recaptures, "refresh_ms": round(refresh_s * 1e3, 2),
           "copy_gib": gib(engine.copy_bytes), "kv_gib": gib(engine.pool.nbytes),
           "peak_extra_gib": gib(torch.cuda.max_memory_allocated() - base),
           "buckets": bucket_report(s)}
    row["ok"] = seconds <= 0.25 and warm_s <= 60 and s.recaptures == 0 and s.captures == 1
    s = engine = None  # free the copy and the KV pool before the next run
    torch.cuda.empty_cache()
    return row


def check_timing_qwen05b_batch64(hf_baseline: bool):
    """Target: <= 0.25 s for 128 new tokens after 128-token prompts, batch 64 (fused)."""
    model = student("qwen2.5-0.5b")
    rows = prompts(64, 128, model.config.vocab_size, seed=8)
    row = {"fused": timing(model, rows, True), "unfused": timing(model, rows, False)}
    seconds = row["fused"]["seconds"]
    if hf_baseline:
        hf = HFSampler(SamplingSettings(1.0, 1.0, 128, [EOS], 0, model.config.vocab_size))
        with torch.autocast("cuda", dtype=torch.bfloat16):  # as DistillModule calls it
            hf(model, rows[:4], seed=0)  # its own warm-up
            hf_s, _, _ = timed(lambda: hf(model, rows, seed=1))
        row.update(hf_seconds=round(hf_s, 3), speedup_vs_hf=round(hf_s / seconds, 1))
    row["ok"] = row["fused"]["ok"]
    return row


CHECKS = [("capture smoke", check_capture_smoke, 60),
          ("kernels per decode step", check_kernels_per_step, 60),
          ("draws on the device == integer oracle", check_draws_match_the_oracle, 30),
          ("greedy fp32 == HF generate", check_greedy_fp32_equals_hf, 90),
          ("greedy bf16 near-argmax of HF", check_greedy_bf16_near_argmax, 90),
          ("graph == eager", check_graph_equals_eager, 90),
          ("seeds, padded head rows", check_seeds_and_padded_rows, 60),
          ("eos stops early", check_eos_stops_early, 60),
          ("no recapture after warm-up", check_no_recapture_after_warmup, 90),
          ("LoRA fp32 == HF generate", check_lora_fp32_equals_hf, 90)]


def brief(row: dict, width: int = 420) -> str:
    """The row without its bookkeeping, nested bucket lists dropped, on one short line."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()
                    if k not in ("buckets", "what", "status", "wall_s", "runs")}
        return x

    text = json.dumps(strip(row), default=str)
    return text if len(text) <= width else text[: width - 3] + "..."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for check.json")
    ap.add_argument("--no-hf", action="store_true", help="skip the HFSampler timing (~4 s)")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run the small checks on CPU (no graphs there): tests this script")
    args = ap.parse_args()
    global DEVICE
    if args.cpu_dry_run:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: this check is for the GPU machine (or --cpu-dry-run)")
        return 2
    env = environment()
    print("environment:", env, flush=True)
    results = Results(args.out / "check.json" if args.out else None, env)
    checks = CHECKS + ([] if args.cpu_dry_run else [(
        "timing Qwen2.5-0.5B batch 64", lambda: check_timing_qwen05b_batch64(not args.no_hf),
        180)])
    for name, fn, limit in checks:
        print(f"\n=== {name}", flush=True)
        row = results.attempt(name, limit, fn)
        print(f"--> {row['status']}: {name}", flush=True)
    print("\n## summary")
    for row in results.rows:
        print(f"{row['status']:5}  {row['what']}  ({row['wall_s']} s)  {brief(row)}")
    passed = sum(r["status"] == "PASS" for r in results.rows)
    results.add(what="summary", passed=passed, checks=len(results.rows), status="done")
    return 0 if passed == len(results.rows) - 1 else 1


if __name__ == "__main__":
    sys.exit(main())  # each check has its own time limit; the command's timeout is the rest
