"""Memory and tokens/s of a LoRA student against full fine-tuning, through the real trainer.

    python bench/bench_lora.py                     # CUDA: Llama-3.2-1B-shaped student,
                                                     # Llama-3.1-8B-shaped live teacher
    python bench/bench_lora.py --tiny              # CPU smoke test (seconds)

Random weights built on the device (no download), random tokens, every position trained
(CPT), forward KL. Each row is a DistillModule fitted by a Lightning Trainer (bf16-mixed on
the GPU, AdamW, the StepTokenCounter and the TokenThroughput callbacks) for a few steps:

  full           every student weight trains: fp32 master weights, grads and AdamW state
  lora r=R       student.lora.r=R on all Linear layers, base in bf16 (student.dtype=
                 bfloat16), frozen LM head: the loss skips the head's weight-gradient GEMM
  lora r=R+head  the same with student.lora.train_head=true (tied: the embedding trains)

tokens/s is TokenThroughput's rate (Lightning's ThroughputMonitor) over the steps after
the warm-up ones; "weights at start" is what is allocated when the fit starts (teacher and
student weights), peak is torch.cuda.max_memory_allocated over the fit (weights, gradients,
optimizer state, activations; the teacher included). Prints a markdown table for
docs/benchmarks.md and writes it, with the JSON, under --out.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path

if importlib.util.find_spec("distill") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout, not installed
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_train_steps

import lightning as L
import torch
from bench_train_steps import LLAMA  # noqa: E402  (the same real-shaped pair)
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from distill.models.lora import LoraConfig, apply_lora
from distill.training.callbacks import StepTokenCounter, TokenThroughput
from distill.training.module import DistillModule
from distill.training.teachers import LiveTeacher

SHAPES = {  # (student, teacher) LlamaConfig arguments: the training-step benchmark's pairs
    "real": (LLAMA["student"], LLAMA["teacher"]),
    # tiny: multi-head k/v (the LoRA test counts the adapter parameters from these)
    "tiny": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True),
             dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)),
}


def build(shape: dict, vocab: int, device, dtype) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=8192, rope_theta=500000.0,
                         attn_implementation="sdpa", **shape)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype)


def batches(n: int, rows: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (rows, seq), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


def run_one(mode: str, args, teacher, device) -> dict:
    cuda = device.type == "cuda"
    lora = {"r": args.rank, "train_head": mode.endswith("+head")} if mode != "full" else None
    # full fine-tuning keeps fp32 master weights; a LoRA base is frozen, so bf16 on the GPU
    base_dtype = torch.bfloat16 if lora and cuda else torch.float32
    torch.manual_seed(0)
    student = build(SHAPES[args.shape][0], args.vocab, device, base_dtype)
    if lora:
        apply_lora(student, LoraConfig(**lora))
    trainable = sum(p.numel() for p in student.parameters() if p.requires_grad)
    module = DistillModule(student, teacher, loss={"kind": "forward_kl"},
                           optimizer=functools.partial(torch.optim.AdamW, lr=1e-5),
                           vocab_size=args.vocab)
    rate = TokenThroughput(window_size=args.steps - args.warmup)
    trainer = L.Trainer(accelerator=device.type, devices=1, max_steps=args.steps,
                        precision="bf16-mixed" if cuda else "32-true", logger=False,
                        callbacks=[StepTokenCounter(), rate], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    data = DataLoader(batches(args.steps, args.rows, args.seq, args.vocab), batch_size=None)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated() / 2**30 if cuda else None  # teacher + this student
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=data)
    wall = time.perf_counter() - t0
    row = {"mode": mode, "trainable_params": trainable, "steps": trainer.global_step,
           "tokens_per_s": float(trainer.callback_metrics["tokens/s"]), "wall_s": wall,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "held_at_start_gib": held}
    del trainer, module, student, rate
    gc.collect()  # Lightning's objects hold cycles: free this row's student and optimizer
    if cuda:
        torch.cuda.empty_cache()
    return row


def table(rows: list[dict], args, teacher_gib: float | None) -> str:
    tokens = args.rows * args.seq
    head = (f"LoRA vs full fine-tuning: {args.shape}-shaped student and live teacher, "
            f"{args.rows} x {args.seq} tokens per step, {args.steps} steps (rate over the "
            f"last {args.steps - args.warmup})")
    if teacher_gib:
        head += f", teacher weights {teacher_gib:.1f} GiB (in every peak)"
    lines = [head, "", "| student | trainable params | weights at start | peak memory | "
             "tokens/s | ms / step |", "|---|---|---|---|---|---|"]
    gib = lambda v: f"{v:.1f} GiB" if v is not None else "n/a (CPU)"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['mode']} | {r['trainable_params'] / 1e6:.2f} M | "
                     f"{gib(r['held_at_start_gib'])} | {gib(r['peak_gib'])} | "
                     f"{r['tokens_per_s']:.0f} | {1e3 * tokens / r['tokens_per_s']:.0f} |")
    lines.append(f"\ncommand: python bench/bench_lora.py {' '.join(sys.argv[1:])}")
    return "\n".join(lines)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (a smoke test)")
    p.add_argument("--rows", type=int, default=None, help="sequences per step (16; tiny 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (2048; tiny 32)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per row (12; tiny 4)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the rate")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--out", type=Path, default=Path("bench_out/lora"))
    args = p.parse_args(argv)
    args.shape = "tiny" if args.tiny else "real"
    args.vocab = 512 if args.tiny else 128256
    args.rows = args.rows or (2 if args.tiny else 16)
    args.seq = args.seq or (32 if args.tiny else 2048)
    args.steps = args.steps or (4 if args.tiny else 12)
    if args.steps - args.warmup < 2:
        p.error("--steps must exceed --warmup by at least 2 (the rate needs two points)")
    return args


def main(argv=None) -> list[dict]:
    args = parse(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("no CUDA device: run with --tiny for the CPU smoke test")
    teacher_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    teacher = LiveTeacher.from_model(
        build(SHAPES[args.shape][1], args.vocab, device, teacher_dtype))
    teacher_gib = (sum(p.numel() * p.element_size() for p in teacher.parameters()) / 2**30
                   if device.type == "cuda" else None)
    modes = ["full", f"lora r={args.rank}", f"lora r={args.rank}+head"]
    rows = [run_one(m, args, teacher, device) for m in modes]
    text = table(rows, args, teacher_gib)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_lora.md").write_text(text + "\n")
    (args.out / "bench_lora.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
