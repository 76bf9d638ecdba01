"""The end-of-run report: demo-task accuracy of teacher and students, and a short summary."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.strategies import FSDPStrategy
from transformers import PreTrainedModel

from distill.lora import load_exported
from distill.teachers import LiveTeacher


def trained_student(student, trainer, export):
    """The distilled student to score after fit: the module itself, except under FSDP,
    where after fit each rank's module holds only its flattened shards, so the exported
    copy is read back (None, i.e. not scored, without an export)."""
    if not isinstance(trainer.strategy, FSDPStrategy):
        return student
    if export is None or export.saved_to is None:
        return None
    model = load_exported(export.saved_to)  # a LoRA adapter is merged onto its base
    return model.to(trainer.strategy.root_device)


def evaluate_models(cfg, tokenizer, models: dict) -> dict:
    """Exact-match accuracy on the configured task set for each model (empty if none)."""
    ev = cfg.get("evaluate")
    if not ev or not ev.get("path"):
        return {}
    from distill.evaluation import load_examples, task_accuracy

    examples = load_examples(ev.path)[: ev.get("max_examples") or None]
    out = {}
    for name, model in models.items():
        if isinstance(model, LiveTeacher):
            model = model.model
        elif not isinstance(model, PreTrainedModel):
            continue  # a cached teacher has no model to score, nor has an unexported
            # FSDP student (see trained_student)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out[name] = task_accuracy(model, tokenizer, examples,
                                      max_new_tokens=ev.get("max_new_tokens", 32))
        model.train(was_training)
    return out


def reference(cfg) -> dict | None:
    """`evaluate.reference`: a baseline measured once and recorded with its command (e.g. the
    demo's CE-only arm), printed beside the distilled student; not for the baseline's own run
    (loss.divergence_weight=0)."""
    ev = cfg.get("evaluate") or {}
    ref = ev.get("reference")
    if not ref or float(cfg.loss.get("divergence_weight", 1.0)) == 0.0:
        return None
    return {k: (dict(v) if hasattr(v, "items") else v) for k, v in ref.items()}


def _accuracy_line(name: str, acc: dict) -> str:
    per_task = "  ".join(f"{k} {100 * v:.0f}%" for k, v in acc.get("per_task", {}).items())
    return f"    {name:<18} {100 * acc['overall']:5.1f}%   {per_task}"


def print_summary(summary: dict) -> None:
    lines = ["", "=" * 60, "distill: run summary"]
    if summary["student_dir"]:
        lines.append(f"  student saved to: {summary['student_dir']}")
        if (Path(summary["student_dir"]) / "adapter_config.json").exists():  # LoRA
            lines.append("    (a LoRA adapter: PeftModel.from_pretrained(<the base student>, "
                         "this folder) loads it; tokenizer included)")
        else:
            lines.append("    (AutoModelForCausalLM.from_pretrained loads it, tokenizer included)")
    lines.append(f"  optimizer steps:  {summary['global_step']}  ({summary['wall_s']:.0f} s)")
    for key in ("val/loss", "val/kl", "val/ppl", "val/teacher_ppl"):
        if key in summary["metrics"]:
            lines.append(f"  {key:<16}  {summary['metrics'][key]:.4f}")
    if summary["accuracy"]:
        lines.append("  demo-task accuracy (exact match, held-out test split):")
        lines += [_accuracy_line(name, acc) for name, acc in summary["accuracy"].items()]
    ref = summary.get("reference")
    if ref:
        lines.append(_accuracy_line(ref["name"], ref) + f"   ({ref.get('note', 'recorded')})")
        lines.append(f"      {ref['command']}")
    lines.append("=" * 60)
    print("\n".join(lines))
