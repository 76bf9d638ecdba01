"""Save the student as a Hugging Face folder (model + tokenizer) when training ends."""

from __future__ import annotations

from pathlib import Path

import lightning as L


class ExportStudent(L.Callback):
    def __init__(self, dirpath: str, tokenizer=None):
        self.dirpath = Path(dirpath)
        self.tokenizer = tokenizer
        self.saved_to: Path | None = None

    def on_train_end(self, trainer, pl_module):
        # Every rank takes part: under FSDP this gathers the sharded parameters into a full
        # state dict (on rank 0); under DDP or one device it is the module's own.
        state = trainer.strategy.lightning_module_state_dict()
        if trainer.is_global_zero:
            student = {k.removeprefix("student."): v for k, v in state.items()
                       if k.startswith("student.") and k.removeprefix("student.")
                       not in _tied_aliases(pl_module.student)}
            pl_module.student.save_pretrained(self.dirpath, state_dict=student)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(self.dirpath)
        trainer.strategy.barrier("export")  # the other ranks may read the folder next
        self.saved_to = self.dirpath


_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _tied_aliases(model) -> set[str]:
    """Names under which an already-named parameter appears again (tied embeddings).

    A gathered FSDP state dict holds such a weight twice, as separate tensors; without
    this, the export would keep a key that `save_pretrained` drops everywhere else.
    """
    seen, aliases = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        for wrapper in _WRAPPERS:  # FSDP, activation checkpointing, torch.compile
            name = name.replace(wrapper, "")
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return aliases
