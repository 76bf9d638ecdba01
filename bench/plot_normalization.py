"""Gradient norm per optimizer step under each normalization policy, on the demo mix.

    python bench/plot_normalization.py --steps 40 --out docs/normalization_grad_norm.png

Composes `+experiment=mix_jsd` (SFT chat data whose prompts are masked, mixed with CPT text
where every token trains) and runs the same optimizer steps (K micro-batches each, same
data order) once per policy, with the student frozen at its initialization (SGD, lr=0):
the curves then differ only by the normalization. Records each step's gradient norm and
valid-token fraction, plots them, and prints a summary table for docs/normalization.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import lightning as L
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

import distill.train  # noqa: F401  (registers the distill_demo resolver)
from distill.models.causal_lm import load_tokenizer
from distill.training.callbacks import StepTokenCounter
from distill.training.module import DistillModule
from distill.training.normalization import POLICIES

CONF = Path(__file__).resolve().parents[1] / "conf"


class StepRecorder(L.Callback):
    """The student's gradient norm and the step's valid fraction at every optimizer step."""

    def __init__(self):
        self.grad_norm: list[float] = []
        self.valid_fraction: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.student.parameters() if p.grad is not None]
        self.grad_norm.append(float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads]))))
        s = pl_module.step_counts
        self.valid_fraction.append(s.valid / max(s.real, 1))


def run_policy(policy: str, args, out_dir: str) -> StepRecorder:
    overrides = ["+experiment=mix_jsd", f"loss.normalization={policy}", "optimizer=sgd",
                 "optimizer.lr=0.0", "scheduler=none", f"data.batch_size={args.batch_size}",
                 f"paths.output_dir={out_dir}", *args.overrides]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    L.seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.tokenizer)
    module = DistillModule(instantiate(cfg.student), instantiate(cfg.teacher),
                           loss=OmegaConf.to_container(cfg.loss),
                           optimizer=instantiate(cfg.optimizer), vocab_size=len(tokenizer))
    recorder = StepRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps,
                        accumulate_grad_batches=args.accumulate, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0,
                        callbacks=[StepTokenCounter(), recorder])
    trainer.fit(module, datamodule=instantiate(cfg.data, tokenizer=tokenizer))
    return recorder


def plot(results: dict[str, StepRecorder], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    steps = range(1, args.steps + 1)
    for policy, rec in results.items():
        top.plot(steps, rec.grad_norm, marker="o", markersize=3, label=policy)
    top.set_ylabel("gradient norm of the step")
    top.set_title(f"demo mix (SFT + CPT), K={args.accumulate} micro-batches of "
                  f"{args.batch_size}, student frozen at init")
    top.legend()
    top.grid(alpha=0.3)
    bottom.bar(steps, next(iter(results.values())).valid_fraction, color="grey")
    bottom.set_ylabel("valid / real")
    bottom.set_xlabel("optimizer step")
    bottom.set_ylim(0, 1)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", default="docs/normalization_grad_norm.png")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for policy in POLICIES:
            results[policy] = run_policy(policy, args, out_dir)
    plot(results, args)
    print(f"| policy | mean grad norm | std / mean |  ({args.steps} steps, plot: {args.out})")
    print("|---|---|---|")
    for policy, rec in results.items():
        mean = statistics.fmean(rec.grad_norm)
        print(f"| `{policy}` | {mean:.3g} | {statistics.pstdev(rec.grad_norm) / mean:.2f} |")


if __name__ == "__main__":
    main()
