"""Checkpoints written beside their final name and renamed into place: a kill or a full disk
mid-save leaves the previous good checkpoint where it was.

Lightning's own writer goes through a temporary file that may sit on another filesystem,
where the final move is a copy: a truncated `last.ckpt` under its final name (a full disk),
or a 0-byte one (SIGKILL during the save). Here the file is written in the checkpoint's own
folder, flushed to disk, then renamed over the old one (atomic on one filesystem), and the
folder itself is synced so the rename survives a crash.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(tmp: Path, final: Path) -> None:
    """Durably rename a finished file over `final`."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(final.parent)


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if "://" in str(path):  # remote storage: Lightning's fsspec path
            return super().save_checkpoint(checkpoint, path, storage_options)
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            torch.save(checkpoint, tmp)
            replace_file(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk: the old checkpoint stays as it was
            raise
