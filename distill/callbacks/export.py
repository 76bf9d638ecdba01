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
        if trainer.is_global_zero:
            pl_module.student.save_pretrained(self.dirpath)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(self.dirpath)
        self.saved_to = self.dirpath
