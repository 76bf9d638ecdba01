"""The end-of-run report: demo-task accuracy of teacher and students, and a short summary."""

from __future__ import annotations

import torch


def evaluate_models(cfg, tokenizer, models: dict) -> dict:
    """Exact-match accuracy on the configured task set for each model (empty if none)."""
    ev = cfg.get("evaluate")
    if not ev or not ev.get("path"):
        return {}
    from distill.evaluation import load_examples, task_accuracy

    examples = load_examples(ev.path)[: ev.get("max_examples") or None]
    out = {}
    for name, model in models.items():
        model = getattr(model, "model", model)  # a LiveTeacher wraps its model
        if model is None:
            continue
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out[name] = task_accuracy(model, tokenizer, examples,
                                      max_new_tokens=ev.get("max_new_tokens", 32))
        model.train(was_training)
    return out


def _overall(acc) -> str:
    value = acc.get("overall", acc) if isinstance(acc, dict) else acc
    return f"{100 * float(value):5.1f}%"


def print_summary(summary: dict) -> None:
    lines = ["", "=" * 60, "distill: run summary"]
    if summary["student_dir"]:
        lines.append(f"  student saved to: {summary['student_dir']}")
        lines.append("    (AutoModelForCausalLM.from_pretrained loads it, tokenizer included)")
    lines.append(f"  optimizer steps:  {summary['global_step']}  ({summary['wall_s']:.0f} s)")
    for key in ("val/loss", "val/kl", "val/ppl", "val/teacher_ppl"):
        if key in summary["metrics"]:
            lines.append(f"  {key:<16}  {summary['metrics'][key]:.4f}")
    if summary["accuracy"]:
        lines.append("  demo-task accuracy (exact match, held-out test split):")
        for name, acc in summary["accuracy"].items():
            per_task = ""
            if isinstance(acc, dict):
                per_task = "  ".join(f"{k} {100 * v:.0f}%" for k, v in acc.items()
                                     if k != "overall")
            lines.append(f"    {name:<18} {_overall(acc)}   {per_task}")
    lines.append("=" * 60)
    print("\n".join(lines))
