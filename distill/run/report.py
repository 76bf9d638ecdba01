"""The end-of-run summary: where the student went, the last metrics, and on the demo the
task accuracy of teacher and students beside the recorded baselines."""

from __future__ import annotations

from pathlib import Path


def _accuracy_line(name: str, acc: dict) -> str:
    per_task = "  ".join(f"{k} {100 * v:.0f}%" for k, v in acc.get("per_task", {}).items())
    return f"    {name:<24} {100 * acc['overall']:5.1f}%   {per_task}"


def summary_lines(summary: dict) -> list[str]:
    lines = ["", "=" * 60, "distill: run summary"]
    if summary["student_dir"]:
        lines.append(f"  student saved to: {summary['student_dir']}")
        if (Path(summary["student_dir"]) / "adapter_config.json").exists():  # LoRA
            lines.append("    (a LoRA adapter: PeftModel.from_pretrained(<the base student>, "
                         "this folder) loads it; tokenizer included)")
        else:
            lines.append("    (AutoModelForCausalLM.from_pretrained loads it, tokenizer included)")
    lines.append(f"  optimizer steps:  {summary['global_step']}  ({summary['wall_s']:.0f} s)")
    if summary.get("trained_tokens"):
        lines.append(f"  trained tokens:   {summary['trained_tokens']}")
    if summary.get("compile"):
        c = summary["compile"]
        steps = ", ".join(map(str, c["late_steps"][:8])) + (
            " ..." if len(c["late_steps"]) > 8 else "")
        late = f"{c['late']} after the warm-up (steps {steps})" if c["late"] else (
            "none after the warm-up")
        apart = ", ".join(f"{c[k]} in {k}" for k in ("rollouts", "validation") if c.get(k))
        lines.append(f"  torch.compile:    {c['graphs']} graphs built by training steps"
                     f"{f' ({apart})' if apart else ''}, {late}")
    for key in ("val/loss", "val/kl", "val/ppl", "val/teacher_ppl"):
        if key in summary["metrics"]:
            lines.append(f"  {key:<16}  {summary['metrics'][key]:.4f}")
    if summary["accuracy"]:
        lines.append("  demo-task accuracy (held-out test split; this run):")
        lines += [_accuracy_line(name, acc) for name, acc in summary["accuracy"].items()]
    if summary.get("references"):
        lines.append("  recorded references (3-seed means, docs/notes/demo.md):")
        for ref in summary["references"]:
            lines.append(_accuracy_line(ref["name"], ref) + f"   ({ref.get('note', 'recorded')})")
            lines.append(f"      {ref['command']}")
    lines.append("=" * 60)
    return lines


def print_summary(summary: dict) -> None:
    print("\n".join(summary_lines(summary)))
