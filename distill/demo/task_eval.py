"""The demo tasks' exact-match accuracy of the teacher and the student, before and after.

`evaluate:` (conf/train.yaml) names a jsonl task set; this callback scores the teacher and
the untrained student when fit starts and the distilled student when it ends (the
exported copy under FSDP, where no rank holds the whole student), and keeps the numbers for
the run's summary, beside the recorded baselines of `evaluate.references`. Runs on one's
own models set `evaluate: null` (the hf_* experiments do): no demo accuracy is printed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy

from distill.core.rules import Rule, integer, setting, text


def _references(v) -> bool:
    return v is None or (isinstance(v, list) and all(
        isinstance(r, dict) and {"name", "overall", "command"} <= set(r) for r in v))


@dataclass(frozen=True)
class TaskEvalConfig:
    path: str = setting(rule=text())
    max_examples: int | None = setting(None, integer(1, null=True))
    max_new_tokens: int = setting(32, integer(1))
    # baselines measured once and printed beside the result: {name, overall, per_task,
    # note, command} each (docs/notes/demo.md)
    references: list | None = setting(None, Rule(_references, "a list of {name, overall, "
                                                 "per_task, note, command}, or null"))

    def problems(self, prefix: str = "") -> list[str]:
        """The task file is read here, before anything loads (it is small): a missing file
        or a bad line stops the run now, not after the models loaded."""
        from distill.demo.evaluation import load_examples

        if not Path(self.path).is_file():
            return [f"{prefix}path={self.path!r}: no such file (a jsonl task set; "
                    "evaluate=null scores nothing)"]
        try:
            if not load_examples(self.path, self.max_examples):
                return [f"{prefix}path={self.path!r}: the file holds no example"]
        except ValueError as err:
            return [str(err)]
        return []


class TaskAccuracy(L.Callback):
    """`tokenizer` is the student's; `teacher_tokenizer`, where the teacher reads other
    tokens (loss.cross_tokenizer), is the one the teacher is scored with."""

    def __init__(self, cfg: TaskEvalConfig, tokenizer, teacher_tokenizer=None):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.teacher_tokenizer = teacher_tokenizer or tokenizer
        self.accuracy: dict[str, dict] = {}

    def _score(self, name: str, model, tokenizer=None) -> None:
        from distill.demo.evaluation import load_examples, task_accuracy

        examples = load_examples(self.cfg.path, self.cfg.max_examples)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            self.accuracy[name] = task_accuracy(model, tokenizer or self.tokenizer, examples,
                                                max_new_tokens=self.cfg.max_new_tokens)
        model.train(was_training)

    def on_fit_start(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero or isinstance(trainer.strategy, FSDPStrategy):
            return  # under FSDP no rank holds a whole model
        teacher = getattr(pl_module.teacher, "model", None)
        if teacher is not None:
            self._score("teacher", teacher, self.teacher_tokenizer)
        if trainer.ckpt_path is None:  # a resumed student is not the untrained one
            self._score("untrained student", pl_module.student)

    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        export = next((cb for cb in trainer.callbacks if hasattr(cb, "saved_to")), None)
        student = trained_student(pl_module.student, trainer, export)
        if student is not None:
            self._score("distilled student", student)


def baseline_of(loss) -> str | None:
    """Which recorded baseline a run's loss settings are (conf/baseline/), if any."""
    op = loss.on_policy
    if loss.ce_only:
        return "seqkd" if op.samples and op.teacher_fraction == 1 else "ce_only"
    if op.fraction == 1 and op.teacher_fraction == 1:
        return "supervised_kd"
    return None


def references_for(references: list | None, loss) -> list[dict]:
    """The recorded baselines to print beside this run: all but the run's own kind."""
    own = baseline_of(loss)
    return [dict(r) for r in references or [] if own is None or r.get("baseline") != own]


def trained_student(student, trainer, export):
    """The distilled student to score after fit: the module itself, except under FSDP,
    where after fit each rank's module holds only its flattened shards, so the exported
    copy is read back (None, i.e. not scored, without an export)."""
    if not isinstance(trainer.strategy, FSDPStrategy):
        return student
    if export is None or export.saved_to is None:
        return None
    from distill.models.lora import load_exported

    return load_exported(export.saved_to).to(trainer.strategy.root_device)
