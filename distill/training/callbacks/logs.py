"""What a run logs besides the module's losses, the numbers people read first:

- `StepLogs`: the learning rate (`train/lr`, one per distinct param-group rate) and the
  gradient norm before clipping (`train/grad_norm`: the L2 norm of the whole accumulated
  gradient, over every FSDP shard), each optimizer step;
- `RolloutSamples`: in on-policy runs, every N steps a few of the step's samples (prompt,
  completion, who wrote it, the teacher's mean log-prob of its tokens) as a `samples.jsonl`
  beside the CSV logger's metrics.csv, a TensorBoard text and a W&B table;
- `FinalMetrics`: the run's last metrics in `<output_dir>/final_metrics.json`, which a
  multirun's summary table (distill.run.sweep) reads;
- `QuietRun`: Lightning's "Found N module(s) in eval mode" is expected for the frozen
  teacher; that exact case is silenced, any other module in eval mode still warns. It also
  silences two known messages of Lightning itself (`silence_known_noise`).
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

from distill.core.rules import integer, text
from distill.training.state import step_grad_norm

log = logging.getLogger(__name__)


# Lightning's tips for its cloud products, logged on every Trainer; nothing to act on
TIPS = ("💡 Tip: For seamless cloud",)


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TIPS)


def silence_known_noise() -> None:
    """The two messages every run printed that say nothing about it, silenced where they
    are raised, each by its own text (other messages of the same loggers still show):
    Lightning's litlogger / litmodels tips, and the deprecation of torch's `LeafSpec` that
    Lightning's own `_pytree` module triggers on each step."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in target.filters):
            target.addFilter(_DropTips())
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            module=r"lightning\.pytorch\.utilities\._pytree")


class StepLogs(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # Lightning calls this after the step's backward passes and before it clips
        opts = dict(on_step=True, on_epoch=False)
        rates = list(dict.fromkeys(float(g["lr"]) for g in optimizer.param_groups))
        pl_module.log("train/lr", rates[0], prog_bar=False, **opts)
        for i, rate in enumerate(rates[1:], 1):  # adamw_grouped: the same lr, one key
            pl_module.log(f"train/lr_{i}", rate, **opts)
        norm = step_grad_norm(trainer, pl_module, optimizer)
        if norm is not None:
            pl_module.log("train/grad_norm", norm, **opts)


class RolloutSamples(L.Callback):
    SETTINGS = {"every_n_steps": integer(1), "max_samples": integer(1)}

    def __init__(self, every_n_steps: int = 100, max_samples: int = 4, tokenizer=None):
        self.every_n_steps, self.max_samples = every_n_steps, max_samples
        self.tokenizer = tokenizer  # set by the run (distill.run.assemble.build_callbacks)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        step = trainer.global_step
        samples = getattr(getattr(pl_module, "sums", None), "samples", None)
        if not samples or step % self.every_n_steps or not trainer.is_global_zero:
            return
        rows = [self._row(step, pl_module, *s) for s in samples[: self.max_samples]]
        write_samples(trainer.loggers, rows, step)

    def _row(self, step, pl_module, prompt, completion, by_teacher) -> dict:
        prompt, completion = [int(t) for t in prompt], [int(t) for t in completion]
        decode = self.tokenizer.decode if self.tokenizer is not None else str
        return {"step": step, "writer": "teacher" if by_teacher else "student",
                "prompt": decode(prompt), "completion": decode(completion),
                "completion_tokens": len(completion),
                "teacher_logprob": teacher_logprob(pl_module, prompt, completion)}


@torch.no_grad()
def teacher_logprob(pl_module, prompt: list[int], completion: list[int]) -> float | None:
    """The live teacher's mean log-prob of the completion's tokens after the prompt
    (through the fused CE: no logits built), or None without a live teacher, and in a
    cross-tokenizer run, where the sample's tokens are not the teacher's."""
    from distill.data.shift import shift_flat, shift_labels
    from distill.losses import linear_cross_entropy
    from distill.models.causal_lm import final_hidden_states, lm_head

    teacher = getattr(getattr(pl_module, "teacher", None), "model", None)
    cross = getattr(getattr(pl_module, "objective", None), "cross", None)
    if teacher is None or cross is not None or not completion:
        return None
    device = next(teacher.parameters()).device
    ids = torch.tensor([prompt + completion], device=device)
    labels = torch.tensor([[-100] * len(prompt) + completion], device=device)
    weight, head = lm_head(teacher)
    ce = linear_cross_entropy(shift_flat(final_hidden_states(teacher, ids)), weight,
                              shift_labels(labels), head=head,
                              vocab_size=getattr(pl_module, "vocab_size", None))
    return -float(ce)  # the default weights: the mean over the completion's tokens


def write_samples(loggers, rows: list[dict], step: int) -> None:
    """A jsonl beside each CSV logger's metrics.csv, a TensorBoard text, a W&B table."""
    columns = ["step", "writer", "prompt", "completion", "completion_tokens",
               "teacher_logprob"]
    for logger in loggers:
        if isinstance(logger, CSVLogger):
            path = Path(logger.log_dir) / "samples.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        elif isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text("rollout/samples", markdown_table(rows, columns), step)
        elif isinstance(logger, WandbLogger):
            logger.log_table("rollout/samples", columns=columns,
                             data=[[r[c] for c in columns] for r in rows], step=step)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def cell(v):
        text = f"{v:.4f}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(r[c]) for c in columns) + " |"
                              for r in rows])


class FinalMetrics(L.Callback):
    SETTINGS = {"path": text()}

    def __init__(self, path: str):
        self.path = Path(path)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        # after every callback's on_fit_end: the demo-task accuracy is known by now
        if stage != "fit" or not trainer.is_global_zero or trainer.interrupted:
            return
        out = {"global_step": trainer.global_step}
        out.update({k: float(v) for k, v in trainer.callback_metrics.items()
                    if torch.is_tensor(v) and v.numel() == 1})
        for cb in trainer.callbacks:
            for name, acc in (getattr(cb, "accuracy", None) or {}).items():
                out[f"accuracy/{name}"] = acc["overall"]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(out, indent=1) + "\n")


EVAL_MODE = r"Found {n} module\(s\) in eval mode at the start of training"


class QuietRun(L.Callback):
    def __init__(self):
        silence_known_noise()  # before the Trainer exists: its first tip comes at __init__
        self._filter = None

    def on_fit_start(self, trainer, pl_module):
        frozen = [n for n, m in pl_module.named_modules() if not m.training]
        if frozen and all(n == "teacher" or n.startswith("teacher.") for n in frozen):
            # the count is part of the message: a student module in eval mode changes it,
            # and Lightning's warning is shown as it would be
            warnings.filterwarnings("ignore", message=EVAL_MODE.format(n=len(frozen)))
            self._filter = warnings.filters[0]
            log.info("the frozen teacher's %d modules stay in eval mode (intended)", len(frozen))

    def on_train_start(self, trainer, pl_module):
        # Lightning warned (or not) just before this hook: the filter has done its job
        if self._filter is not None and self._filter in warnings.filters:
            warnings.filters.remove(self._filter)
        self._filter = None
