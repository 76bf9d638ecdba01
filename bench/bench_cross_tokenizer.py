"""Cross-tokenizer distillation on the GPU: a Llama-3.1-8B-shaped teacher (V = 128256) into a
Qwen2.5-0.5B-shaped student (V = 151936), against the same-tokenizer step.

    python bench/bench_cross_tokenizer.py --out bench/cross_tokenizer.json

Random weights, built from transformers' config classes (the shapes of
bench/bench_train_steps.py); no tokenizer files and no network: the alignment is
*synthesized* at the real sizes. Each row's text is a run of spans, 1:1 with probability
1 - --multi and otherwise one of 1:2, 2:1, 2:2, 1:3, 3:1 tokens (the teacher has as many
tokens as the student on average); a 1:1 span starts with a paired token on both
sides with probability --same-first; the vocabulary map pairs --pairs random tokens of the
two vocabularies. Two levels are timed (median of --repeats after --warmup, CUDA events):

- loss:  the loss op alone, forward + backward into student hidden states and head, from
         bf16 hidden states (student head fp32 master weights under bf16 autocast).
         Baseline: `linear_divergence` on the student's tokens with a teacher head of the
         student's vocabulary (what the loss costs when the tokenizers are shared).
- step:  teacher forward (bf16, no grad) + student forward and backward under bf16 autocast
         + the loss; baseline: the same models, the teacher run on the student's tokens
         (ids folded into its embedding) with a head of the student's vocabulary, and
         linear_divergence.

Reported per row: trained student tokens per second and peak memory above what was
allocated before the step (inputs, weights). --sort also times torch.sort of one span
chunk at both vocabularies (the part of ULD that the GEMMs do not cover). --tiny runs
small shapes anywhere (a smoke test, CPU included).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_train_steps import LLAMA, QWEN, TINY  # noqa: E402
from distill.losses import linear_divergence  # noqa: E402
from distill.models.causal_lm import final_hidden_states, lm_head  # noqa: E402
from distill.xtok.loss import cross_tokenizer_divergence  # noqa: E402
from distill.xtok.op import chunk_sizes  # noqa: E402
from distill.xtok.vocab import VocabMap  # noqa: E402

SHAPES = [(1, 2), (2, 1), (2, 2), (1, 3), (3, 1)]


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048, help="student tokens per row")
    p.add_argument("--multi", type=float, default=0.15, help="share of spans that are not 1:1")
    p.add_argument("--same-first", type=float, default=0.9)
    p.add_argument("--pairs", type=int, default=100_000)
    p.add_argument("--levels", nargs="+", default=["loss", "step"], choices=["loss", "step"])
    p.add_argument("--modes", nargs="+", default=["uld", "hybrid"], choices=["uld", "hybrid"])
    p.add_argument("--kind", default="reverse_kl")
    p.add_argument("--sort", action="store_true", help="also time the sort of one span chunk")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="small shapes: a smoke test anywhere")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    return p.parse_args()


# --- synthetic alignment at the real sizes ------------------------------------------------
def synth_alignment(rows: int, seq: int, vs: int, vt: int, args, device):
    """Student and teacher token ids (right-padded) and spans in flattened shifted rows."""
    rng = random.Random(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    s_ids = torch.randperm(vs, generator=g)[:args.pairs]
    t_ids = torch.randperm(vt, generator=g)[:args.pairs]
    vmap = VocabMap(s_ids, t_ids, vs, vt)
    partner = dict(zip(s_ids.tolist(), t_ids.tolist()))
    student = torch.randint(0, vs, (rows, seq), generator=g)
    per_row, t_rows = [], []
    for _ in range(rows):
        spans, s, t = [], 1, 1
        while True:
            a, c = (1, 1) if rng.random() >= args.multi else rng.choice(SHAPES)
            if s + a > seq:
                break
            spans.append((s, s + a, t, t + c))
            s, t = s + a, t + c
        per_row.append(spans)
        t_rows.append(t)
    width = max(t_rows)
    teacher = torch.randint(0, vt, (rows, width), generator=g)
    flat = []
    for b, spans in enumerate(per_row):
        for s_lo, s_hi, t_lo, t_hi in spans:
            if s_hi - s_lo == t_hi - t_lo == 1 and rng.random() < args.same_first:
                tok = int(student[b, s_lo])
                if tok in partner:
                    teacher[b, t_lo] = partner[tok]
            flat.append((b * (seq - 1) + s_lo - 1, b * (seq - 1) + s_hi - 1,
                         b * (width - 1) + t_lo - 1, b * (width - 1) + t_hi - 1))
    attn = torch.zeros((rows, width), dtype=torch.long)
    for b, t in enumerate(t_rows):
        attn[b, :t] = 1
    return dict(student_ids=student.to(device), teacher_ids=teacher.to(device),
                teacher_attention_mask=attn.to(device),
                spans=torch.tensor(flat, dtype=torch.long, device=device), vmap=vmap,
                labels=student[:, 1:].reshape(-1).to(device),
                teacher_targets=teacher[:, 1:].reshape(-1).to(device))


# --- models -------------------------------------------------------------------------------
def build_models(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    s_spec = TINY["student"] | {"vocab_size": 1517} if args.tiny else (
        QWEN["student"] | QWEN["common"])
    t_spec = TINY["teacher"] | {"vocab_size": 1283} if args.tiny else (
        LLAMA["teacher"] | LLAMA["common"])
    half = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        student = Qwen2ForCausalLM(Qwen2Config(**s_spec))  # fp32 master weights
        torch.set_default_dtype(half)
        teacher = LlamaForCausalLM(LlamaConfig(**t_spec)).eval().requires_grad_(False)
        # the same-tokenizer baseline: the teacher's body with a head of the student's vocab
        same_head = torch.nn.Linear(t_spec["hidden_size"], s_spec["vocab_size"], bias=False)
        torch.set_default_dtype(torch.float32)
    same_head.requires_grad_(False)
    return student, teacher, same_head.weight


# --- timing -------------------------------------------------------------------------------
def timed(fn, args, device, tokens: int) -> dict:
    cuda = device.type == "cuda"
    for _ in range(args.warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(args.repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    out = {"ms": round(med * 1e3, 2), "tokens_per_s": round(tokens / med)}
    if cuda:
        out["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20)
    return out


def autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def loss_level(args, device, al, student, teacher, same_head):
    """The loss op alone from hidden states."""
    ns, nt = len(al["labels"]), len(al["teacher_targets"])
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(args.seed)
    hs = torch.randn(ns, student.config.hidden_size, device=device, dtype=dt, generator=g)
    ht = torch.randn(nt, teacher.config.hidden_size, device=device, dtype=dt, generator=g)
    ht_same = torch.randn(ns, teacher.config.hidden_size, device=device, dtype=dt, generator=g)
    hs.requires_grad_()
    ws = lm_head(student)[0]
    wt = lm_head(teacher)[0]
    results = {}

    def xtok(mode):
        def step():
            with autocast(device):
                loss = cross_tokenizer_divergence(
                    hs, ws, spans=al["spans"], teacher_targets=al["teacher_targets"],
                    labels=al["labels"], teacher_hidden=ht, teacher_weight=wt, mode=mode,
                    vocab_map=al["vmap"], kind=args.kind)
            loss.backward()
            hs.grad = ws.grad = None
        return step

    def same():
        with autocast(device):
            loss = linear_divergence(hs, ws, teacher_hidden=ht_same, teacher_weight=same_head,
                                     labels=al["labels"], kind=args.kind)
        loss.backward()
        hs.grad = ws.grad = None

    results["same_tokenizer"] = timed(same, args, device, ns)
    for mode in args.modes:
        results[mode] = timed(xtok(mode), args, device, ns)
    return results


def step_level(args, device, al, student, teacher, same_head):
    """Teacher forward + student forward/backward + loss, as one training micro-batch."""
    rows, seq = al["student_ids"].shape
    tokens = rows * (seq - 1)
    ws = lm_head(student)[0]
    wt = lm_head(teacher)[0]
    s_attn = torch.ones_like(al["student_ids"])

    def student_hidden():
        return final_hidden_states(student, al["student_ids"], s_attn)[:, :-1].reshape(
            tokens, -1)

    def xtok(mode):
        def step():
            with torch.no_grad():
                th = final_hidden_states(teacher, al["teacher_ids"], al["teacher_attention_mask"])
            with autocast(device):
                hs = student_hidden()
                loss = cross_tokenizer_divergence(
                    hs, ws, spans=al["spans"], teacher_targets=al["teacher_targets"],
                    labels=al["labels"], teacher_hidden=th[:, :-1].reshape(-1, th.shape[-1]),
                    teacher_weight=wt, mode=mode, vocab_map=al["vmap"], kind=args.kind)
            loss.backward()
            student.zero_grad(set_to_none=True)
        return step

    # the baseline teacher reads the student's tokens; ids past its embedding are folded in
    # (random weights: which row is looked up costs the same)
    same_ids = al["student_ids"].remainder(teacher.config.vocab_size)

    def same():
        with torch.no_grad():
            th = final_hidden_states(teacher, same_ids, s_attn)
        with autocast(device):
            hs = student_hidden()
            loss = linear_divergence(hs, ws, teacher_hidden=th[:, :-1].reshape(tokens, -1),
                                     teacher_weight=same_head, labels=al["labels"],
                                     kind=args.kind)
        loss.backward()
        student.zero_grad(set_to_none=True)

    results = {"same_tokenizer": timed(same, args, device, tokens)}
    for mode in args.modes:
        results[mode] = timed(xtok(mode), args, device, tokens)
    return results


def sort_cost(args, device, vs, vt, pairs):
    """torch.sort of one span chunk at each vocabulary: time and the bytes it holds."""
    span_chunk, _ = chunk_sizes(vs, vt, pairs, device, None)
    out = {"span_chunk_rows": span_chunk}
    for name, v in (("student", vs + 1), ("teacher", vt + 1)):
        x = torch.rand(span_chunk, v, device=device)
        res = timed(lambda x=x: x.sort(-1, descending=True), args, device, span_chunk)
        out[name] = {"ms": res["ms"], "mib_values_and_indices": round(span_chunk * v * 12 / 2**20),
                     **({"peak_extra_mib": res["peak_extra_mib"]} if "peak_extra_mib" in res
                        else {})}
    return out


def main():
    args = parse()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        args.rows, args.seq, args.pairs = min(args.rows, 2), min(args.seq, 64), 900
        args.repeats, args.warmup = min(args.repeats, 2), min(args.warmup, 1)
    torch.manual_seed(args.seed)
    student, teacher, same_head = build_models(args, device)
    vs, vt = student.config.vocab_size, teacher.config.vocab_size
    al = synth_alignment(args.rows, args.seq, vs, vt, args, device)
    n_multi = int(((al["spans"][:, 1] - al["spans"][:, 0]) + (al["spans"][:, 3]
                   - al["spans"][:, 2]) > 2).sum())
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "student_vocab": vs, "teacher_vocab": vt,
              "student_tokens": len(al["labels"]), "teacher_tokens": len(al["teacher_targets"]),
              "spans": len(al["spans"]), "multi_token_spans": n_multi,
              "pairs": args.pairs, "kind": args.kind, "alignment": "synthesized",
              "command": " ".join(sys.argv)}
    if "loss" in args.levels:
        report["loss"] = loss_level(args, device, al, student, teacher, same_head)
    if "step" in args.levels:
        report["step"] = step_level(args, device, al, student, teacher, same_head)
    if args.sort:
        report["sort"] = sort_cost(args, device, vs, vt, args.pairs)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
