"""Save the student as a Hugging Face folder (model + tokenizer) when training ends.

A LoRA student (distill/models/lora.py) is saved as its adapter in PEFT's format (plus the LM head
when it trained), or with `merge=True` as the plain model with the adapters folded in.

The export is written to a temporary folder beside its final name and renamed into place
when complete, so a kill or a full disk never leaves a half-written student where a good one
was. A folder already there (an earlier run's export in a reused output dir, or a resumed
run's) is never overwritten: it is renamed to `student.<its date_time>` first, with a log
line. Nothing non-finite is exported: a student with a NaN or infinite weight is refused.

Beside the weights goes a `README.md` model card (distill.export.card: teacher, student base,
data, loss and normalization, final metrics, the command); `push_to_hub=<repo>` then
uploads the folder to the Hugging Face Hub.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from datetime import datetime
from pathlib import Path

import lightning as L
import torch

from distill.core.checkpoint_io import check_finite
from distill.core.constants import unwrapped
from distill.core.rules import boolean, text
from distill.export.card import push_to_hub, write_card

log = logging.getLogger(__name__)


class ExportStudent(L.Callback):
    # checked before anything loads
    SETTINGS = {"merge": boolean(), "dirpath": text(), "push_to_hub": text(null=True)}

    def __init__(self, dirpath: str, tokenizer=None, merge: bool = False,
                 push_to_hub: str | None = None):
        self.dirpath = Path(dirpath)
        self.tokenizer = tokenizer
        self.merge = merge  # LoRA students: save the merged model rather than the adapter
        self.push_to_hub = push_to_hub  # a Hub repo id ("me/my-student"): upload the export
        self.command: str | None = None  # for the card; None: the Hydra command line if any
        self.saved_to: Path | None = None

    def on_train_end(self, trainer, pl_module):
        # Every rank takes part: under FSDP this gathers the sharded parameters into a full
        # state dict (on rank 0); under DDP or one device it is the module's own.
        full = getattr(trainer.strategy, "full_state_dict", None)  # DistillFSDP, sharded ckpts
        state = full() if full else trainer.strategy.lightning_module_state_dict()
        if trainer.is_global_zero:
            student = {k.removeprefix("student."): v for k, v in state.items()
                       if k.startswith("student.") and k.removeprefix("student.")
                       not in _tied_aliases(pl_module.student)}
            check_finite(student, "the trained student")
            tmp = self.dirpath.with_name(f".{self.dirpath.name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                save_student(pl_module.student, student, tmp, self.merge)
                if self.tokenizer is not None:
                    self.tokenizer.save_pretrained(tmp)
                write_card(tmp, {**run_info(trainer, pl_module, self.merge),
                                 "command": self.command or hydra_command("distill-train")})
                move_aside(self.dirpath)
                os.replace(tmp, self.dirpath)  # the whole folder appears at once
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        trainer.strategy.barrier("export")  # the other ranks may read the folder next
        self.saved_to = self.dirpath
        if self.push_to_hub and trainer.is_global_zero:
            upload(self.dirpath, self.push_to_hub)


def upload(folder: Path, repo: str) -> None:
    """Push the export; a failure keeps the saved folder and says how to retry."""
    try:
        push_to_hub(folder, repo)
    except Exception as err:  # network, token, permissions: all worth the same sentence
        raise RuntimeError(f"the student is saved in {folder}, but pushing it to the Hub repo "
                           f"{repo!r} failed ({type(err).__name__}: {err}); retry with "
                           f"`huggingface-cli upload {repo} {folder}`") from err


def run_info(trainer, pl_module, merge: bool) -> dict:
    """What the model card says about this run, read from the trained objects."""
    from distill.models.lora import ADAPTER, card_facts, is_lora

    student, teacher = pl_module.student, getattr(pl_module, "teacher", None)
    info = {"student": getattr(student, "name_or_path", None) or None,
            "teacher": getattr(teacher, "name", None),
            "teacher_kind": "live" if getattr(teacher, "model", None) is not None else "cached",
            "steps": getattr(trainer, "global_step", None),
            "metrics": {k: float(v) for k, v in getattr(trainer, "callback_metrics", {}).items()
                        if (torch.is_tensor(v) and v.numel() == 1) or isinstance(v, float)}}
    if is_lora(student):
        info["student"] = student.peft_config[ADAPTER].base_model_name_or_path
        info["lora"] = card_facts(student, merge)
    cfg = getattr(pl_module, "cfg", None)
    if dataclasses.is_dataclass(cfg):
        info["loss"] = dataclasses.asdict(cfg)
    data = getattr(trainer, "datamodule", None)
    info["data"] = {"train": getattr(data, "train_sources", None),
                    "val": getattr(data, "val_sources", None)}
    return info


def hydra_command(app: str) -> str | None:
    """`<app> <this job's overrides>` when Hydra launched the run, else None."""
    import shlex

    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return " ".join([app, *(shlex.quote(o) for o in HydraConfig.get().overrides.task)])


def save_student(model, state: dict, dirpath: Path, merge: bool) -> None:
    from distill.models.lora import is_lora

    if not is_lora(model):
        model.save_pretrained(dirpath, state_dict=state)
        return
    from distill.models.lora import merged_state_dict, save_adapter, trained_head_key

    if merge:
        model.save_pretrained(dirpath, state_dict=merged_state_dict(model, state))
    else:
        save_adapter(model, state, dirpath, head_key=trained_head_key(model, state))
    log.info("LoRA student exported to %s (%s)", dirpath, "merged" if merge else
             "adapter: PeftModel.from_pretrained(base model, this folder) loads it")


def move_aside(path: Path) -> Path | None:
    """Rename a non-empty `path` to `<name>.<its modification time>`; None if nothing was there."""
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return None
    stamp = datetime.fromtimestamp(path.stat().st_mtime).strftime("%Y-%m-%d_%H-%M-%S")
    target, n = path.with_name(f"{path.name}.{stamp}"), 1
    while target.exists():  # two exports within one second
        target, n = path.with_name(f"{path.name}.{stamp}.{n}"), n + 1
    path.rename(target)
    log.warning("%s already held an export (an earlier run in this output dir): moved it to "
                "%s, the new student goes to %s", path, target, path)
    return target


def _tied_aliases(model) -> set[str]:
    """Names under which an already-named parameter appears again (tied embeddings).

    A gathered FSDP state dict holds such a weight twice, as separate tensors; without
    this, the export would keep a key that `save_pretrained` drops everywhere else.
    """
    seen, aliases = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        name = unwrapped(name)
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return aliases
