"""Checks and throughput on several GPUs (NCCL): DDP and FSDP (trainer=ddp / trainer=fsdp).

    torchrun --standalone --nproc-per-node 2 tests/gpu/check_multi_gpu.py checks
    python tests/gpu/check_multi_gpu.py throughput --devices 1
    torchrun --standalone --nproc-per-node 2 tests/gpu/check_multi_gpu.py throughput \\
        --strategy ddp fsdp

`checks` (tiny models, fp32): the exact-normalization equality (valid_tokens, K=2 on W=2:
the gradient of the one optimizer step, read as (w0 - w1) / lr after one SGD step, against the
float64 one-pass gradient of the step's four micro-batches) under DDP and DistillFSDP; then
under DistillFSDP a sharded checkpoint after 2 steps, resumed to 4, whose exported HF
student loads and equals the uninterrupted run's, once with plain SGD (no optimizer state)
and once with AdamW (`checks --only resume`: just these two). `throughput`: Llama-3.2-1B +
8B shapes, random weights, bf16-mixed, 16 x 2048 tokens per GPU per micro-batch, Lightning's loop;
tokens/s over the steps after the warm-up. Prints markdown rows.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from distill.models.strategies import DistillFSDP  # noqa: E402
from distill.training.callbacks import StepTokenCounter  # noqa: E402

RANK = int(os.environ.get("RANK", 0))
ACCELERATOR = "gpu"  # --cpu: DDP on gloo only, to try the checks without GPUs


def strategy(name: str, **kw):
    return DistillFSDP(**kw) if name == "fsdp" else "ddp"


def say(*args):
    if RANK == 0:
        print(*args, flush=True)


OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def fresh_module(assets: str, lr: float, optimizer: str = "sgd"):
    """A module with its own copies of the tiny student and teacher: FSDP rewraps the
    modules it shards in place, so no two fits may share one. Plain SGD by default: the
    equality check reads the gradient off one SGD step."""
    import copy
    import functools

    from distill.training.module import DistillModule
    from tests.callbacks import proof

    student, teacher = proof.models(assets)
    return DistillModule(copy.deepcopy(student), copy.deepcopy(teacher),
                         loss={**proof.LOSS, "normalization": "valid_tokens"},
                         optimizer=functools.partial(OPTIMIZERS[optimizer], lr=lr),
                         vocab_size=student.config.vocab_size)


def equality(assets: str, name: str) -> float:
    from torch.utils.data import DataLoader

    from tests.callbacks import proof

    lr = 1e3  # w1 = w0 - lr * g: a large lr keeps fp32 rounding of w out of g
    module = fresh_module(assets, lr=lr)
    w0 = {k: v.detach().clone() for k, v in module.student.state_dict().items()}
    vocab = module.student.config.vocab_size
    trainer = L.Trainer(accelerator=ACCELERATOR, devices=2, strategy=strategy(name), max_steps=1,
                        accumulate_grad_batches=2, precision="32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[StepTokenCounter()])
    batches = proof.micro_batches(RANK, vocab)[:2]
    trainer.fit(module, train_dataloaders=DataLoader(proof.CountingBatches(batches),
                                                     batch_size=None))
    state = trainer.strategy.lightning_module_state_dict()
    if RANK != 0:
        return float("nan")
    step = proof.micro_batches(0, vocab)[:2] + proof.micro_batches(1, vocab)[:2]
    ref = proof.reference_grads(assets, step, ["valid_tokens"])["valid_tokens"]
    worst = 0.0
    for key, before in w0.items():
        if key not in ref:  # tied aliases, buffers
            continue
        got = (before.double() - state[f"student.{key}"].double().cpu()) / lr
        scale = ref[key].abs().max().item() or 1.0
        worst = max(worst, (got - ref[key]).abs().max().item() / scale)
    return worst


def resume(assets: str, tmp: Path, name: str, optimizer: str) -> float:
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from distill.export.callback import ExportStudent
    from tests.callbacks import proof

    def fit(steps, out, ckpt=None, save=False):
        module = fresh_module(assets, lr=0.05 if optimizer == "sgd" else 1e-3, optimizer=optimizer)
        vocab = module.student.config.vocab_size
        count = Count()
        cbs = [StepTokenCounter(), ExportStudent(str(out / "export")), count]
        if save:
            cbs.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=str(out / "ckpt"),
                                                           save_last=True,
                                                           every_n_train_steps=2))
        trainer = L.Trainer(accelerator=ACCELERATOR, devices=2, max_steps=steps, logger=False,
                            strategy=strategy(name, state_dict_type="sharded"),
                            precision="32-true", enable_checkpointing=save,
                            enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False, callbacks=cbs)
        data = proof.CountingBatches(proof.micro_batches(RANK, vocab)[:6])
        trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=None),
                    ckpt_path=ckpt)
        return out / "export", count.batches

    if RANK == 0:  # a fresh folder: a stale last.ckpt would be resumed from
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    init_process_group()
    torch.distributed.barrier()
    whole, _ = fit(4, tmp / "whole")
    first, _ = fit(2, tmp / "first", save=True)
    last = tmp / "first" / "ckpt" / "last.ckpt"
    resumed, loaded = fit(4, tmp / "resumed", ckpt=str(last))

    def weights(path):
        return AutoModelForCausalLM.from_pretrained(path).state_dict()

    a, b, c = weights(whole), weights(resumed), weights(first)
    name = f"{name} {optimizer}"
    say(f"| {name}: checkpoint {last.name} is a folder of shards | {last.is_dir()} | |")
    say(f"| {name}: micro-batches the resumed run trained (steps 3-4) | {loaded} | "
        f"{'PASS' if loaded == 2 else 'FAIL'} (2) |")
    # the 2-step student differs from the 4-step one, so equality below means something
    say(f"| {name}: 2-step vs 4-step student, max abs diff | "
        f"{max((a[k] - c[k]).abs().max().item() for k in a):.2e} | (> 0) |")
    return max((a[k] - b[k]).abs().max().item() for k in a)


def attempt(what: str, fn, *args):
    """Run one check; a failure is a FAIL row (and the next check still runs)."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - reported, the rest of the checks go on
        say(f"| {what} | {type(err).__name__}: {str(err)[:400]} | FAIL |")
        return None


class Count(L.Callback):
    """Micro-batches trained in this fit (a resumed fit trains only the rest)."""

    batches = 0

    def on_train_batch_end(self, *args):
        self.batches += 1


def init_process_group() -> None:
    """The fits initialize it; `--only resume` needs it before its first fit (Lightning
    then keeps this one)."""
    if torch.distributed.is_initialized():
        return
    if ACCELERATOR == "gpu":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group("nccl" if ACCELERATOR == "gpu" else "gloo")


def checks(only: str | None = None) -> None:
    from tests.fixtures import make_tiny_assets

    torch.backends.cuda.matmul.allow_tf32 = False
    tmp = Path(tempfile.mkdtemp(prefix=f"multi_gpu_{RANK}_"))
    assets = str(tmp / "assets")
    make_tiny_assets(Path(assets))  # seeded: the same models on every rank
    say("| check | measured | verdict |\n|---|---|---|")
    names = ("ddp", "fsdp") if ACCELERATOR == "gpu" else ("ddp",)
    for name in names if only is None else ():
        err = attempt(f"{name} equality", equality, assets, name)
        if err is None:
            continue
        say(f"| {name}: valid_tokens K=2 W=2 gradient vs float64 one pass (max err / max "
            f"grad) | {err:.2e} | {'PASS' if err < 1e-3 else 'FAIL'} (< 1e-3) |")
    # one folder for all ranks: each writes its shard of the checkpoint there
    name = "fsdp" if ACCELERATOR == "gpu" else "ddp"
    root = Path(os.environ.get("CHECK_DIR", "/tmp/distill_multi_gpu_check"))
    for optimizer in OPTIMIZERS:  # SGD keeps no optimizer state, AdamW does
        diff = attempt(f"{name} {optimizer} resume", resume, assets, root / optimizer, name,
                       optimizer)
        if diff is None:
            continue
        say(f"| {name} {optimizer}: checkpoint at step 2, resumed to 4; exported student vs "
            f"uninterrupted, max abs diff | {diff:.2e} | {'PASS' if diff < 1e-5 else 'FAIL'} |")


def throughput(devices: int, names: list[str], rows: int, steps: int, warm: int,
               tiny: bool = False) -> None:
    from bench_train_steps import LLAMA, TINY, live_teacher, make_batch
    from torch.utils.data import DataLoader, Dataset

    from distill.training.module import DistillModule

    class Random(Dataset):
        def __len__(self):
            return 1 << 16

        def __getitem__(self, i):
            return make_batch(rows, seq, shapes["common"]["vocab_size"], "cpu")

    shapes, seq = (TINY, 32) if tiny else (LLAMA, 2048)
    gpu = ACCELERATOR == "gpu"
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step == warm:
                sync()
                self.t0 = time.perf_counter()

        def on_train_end(self, trainer, *args):
            sync()
            self.s = time.perf_counter() - self.t0

    from transformers import LlamaConfig, LlamaForCausalLM

    local = int(os.environ.get("LOCAL_RANK", 0))

    def one(name: str) -> None:
        with torch.device(f"cuda:{local}" if gpu else "cpu"):
            torch.manual_seed(0)
            student = LlamaForCausalLM(LlamaConfig(**shapes["common"], **shapes["student"]))
            torch.set_default_dtype(torch.bfloat16 if gpu else torch.float32)
            teacher = LlamaForCausalLM(LlamaConfig(**shapes["common"], **shapes["teacher"]))
            torch.set_default_dtype(torch.float32)
        module = DistillModule(student, live_teacher(teacher), loss={"kind": "forward_kl"},
                               optimizer=lambda params: torch.optim.AdamW(params, lr=1e-5),
                               vocab_size=shapes["common"]["vocab_size"])
        clock = Clock()
        trainer = L.Trainer(accelerator=ACCELERATOR, devices=devices, max_steps=warm + steps,
                            strategy=strategy(name) if devices > 1 else "auto",
                            precision="bf16-mixed" if gpu else "32-true",
                            gradient_clip_val=1.0, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[StepTokenCounter(), clock])
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        trainer.fit(module, train_dataloaders=DataLoader(Random(), batch_size=None,
                                                         num_workers=2))
        tps = steps * rows * seq * devices / clock.s
        peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else float("nan")
        say(f"| {name} | {devices} | {rows} x {seq} | {clock.s / steps * 1e3:.0f} ms | "
            f"{tps:,.0f} | {peak:.1f} GiB |")

    for name in names if devices > 1 else ["single"]:
        attempt(f"{name} throughput", one, name)
        gc.collect()  # the trainer and the wrapped models hold each other
        if gpu:
            torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["checks", "throughput"])
    p.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    p.add_argument("--strategy", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--cpu", action="store_true",
                   help="no GPU: checks run DDP on gloo only; throughput runs ddp (use --tiny)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="throughput: tiny shapes (a dry run)")
    p.add_argument("--only", choices=["resume"],
                   help="checks: only the resume checks (SGD and AdamW)")
    args = p.parse_args()
    if args.cpu:
        global ACCELERATOR
        ACCELERATOR = "cpu"
    if args.what == "checks":
        checks(args.only)
    else:
        say("| strategy | GPUs | micro-batch per GPU | step | tokens/s (all GPUs) | peak |\n"
            "|---|---|---|---|---|---|")
        throughput(args.devices, args.strategy, args.rows, args.steps, args.warm, args.tiny)


if __name__ == "__main__":
    main()
