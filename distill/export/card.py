"""The model card of an exported student, and its upload to the Hugging Face Hub.

Both the end-of-run export (`callbacks.export`) and `distill-export` write a `README.md`
into the folder they save: what was distilled into what (teacher, student base, LoRA), on
which data, with which loss and normalization, the final metrics and the command that ran.
`push_to_hub(folder, repo)` uploads the folder with `huggingface_hub` (create the repo if
needed, then one commit of the whole folder).
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from distill.models.causal_lm import looks_like_hub_name

log = logging.getLogger(__name__)

# the loss settings a card shows (the rest are speed knobs with no effect on the result)
LOSS_KEYS = ("kind", "beta", "temperature", "temperature_squared", "divergence_weight",
             "ce_weight", "normalization", "sparse_mode")
ON_POLICY_KEYS = ("fraction", "teacher_fraction", "temperature", "top_p", "max_new_tokens")


def _is_hub_name(name: str | None) -> bool:
    """A hub id ("org/name" or "name") rather than a local folder: only those go in the
    card's metadata, which the Hub checks against its models."""
    return bool(name) and not Path(name).expanduser().exists() and looks_like_hub_name(name)


def _source(s: dict) -> str:
    name = s.get("name") or "?"
    extra = f", weight {s['weight']}" if s.get("weight") not in (None, 1, 1.0) else ""
    return f"`{name}` ({s.get('kind', 'sft')}: `{s.get('path')}`{extra})"


def _loss_line(loss: dict) -> str:
    parts = [f"{k}={loss[k]}" for k in LOSS_KEYS if k in loss
             and not (k == "beta" and loss.get("kind") != "jsd")]
    op = loss.get("on_policy") or {}
    if op.get("fraction"):
        parts.append("on-policy (" + ", ".join(f"{k}={op[k]}" for k in ON_POLICY_KEYS
                                                if k in op) + ")")
    return ", ".join(parts)


def _value(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def model_card(info: dict) -> str:
    """The README.md text. `info`: student (its base model), teacher, teacher_kind,
    lora ({r, alpha, target_modules, merged} or None), data ({train, val}: source dicts),
    loss (the loss settings), metrics, steps, command, exported_from (a checkpoint)."""
    student, teacher = info.get("student") or "a model built in memory", info.get("teacher")
    meta = {"library_name": "peft" if info.get("lora") and not info["lora"].get("merged")
            else "transformers", "tags": ["distill", "knowledge-distillation"]}
    if _is_hub_name(info.get("student")):
        meta["base_model"] = info["student"]
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "",
             f"# {info.get('title') or 'A distilled student'}", "",
             f"Distilled with `distill` (PyTorch Lightning) from the teacher `{teacher}` "
             f"into the student `{student}`.", "", "| | |", "|---|---|",
             f"| teacher | `{teacher}` ({info.get('teacher_kind', 'live')}) |",
             f"| student base | `{student}` |"]
    lora = info.get("lora")
    if lora:
        form = "merged into the weights" if lora.get("merged") else \
            "this folder is the adapter: `PeftModel.from_pretrained(base, folder)`"
        lines.append(f"| LoRA | r={lora.get('r')}, alpha={lora.get('alpha')}, modules "
                     f"{lora.get('target_modules')}; {form} |")
    data = info.get("data") or {}
    for split in ("train", "val"):
        if data.get(split):
            lines.append(f"| {split} data | " + "; ".join(_source(s) for s in data[split])
                         + " |")
    if info.get("loss"):
        lines.append(f"| loss | {_loss_line(info['loss'])} |")
    if info.get("steps") is not None:
        lines.append(f"| optimizer steps | {info['steps']} |")
    if info.get("exported_from"):
        lines.append(f"| exported from | `{info['exported_from']}` |")
    metrics = info.get("metrics") or {}
    if metrics:
        lines += ["", "## Final metrics", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_value(v)} |" for k, v in sorted(metrics.items())]
    lines += ["", "## Command", "", "```bash", info.get("command") or
              "# run in-process (the Python API or train(cfg)): no command line", "```", ""]
    return "\n".join(lines)


def write_card(folder: Path, info: dict) -> Path:
    path = Path(folder) / "README.md"
    path.write_text(model_card({"title": Path(folder).name, **info}))
    return path


def push_to_hub(folder: Path, repo: str, private: bool | None = None) -> str:
    """Upload `folder` (the student, its tokenizer and card) to the Hub repo `repo`; the
    token comes from `huggingface-cli login` or HF_TOKEN. Returns the commit's URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo, private=private, exist_ok=True)
    commit = api.upload_folder(repo_id=repo, folder_path=str(folder),
                               commit_message="distill: upload the distilled student")
    url = getattr(commit, "commit_url", None) or str(commit)
    log.info("pushed %s to the Hub: %s", folder, url)
    return url
