"""`ckpt_path=last`: resume the run whose checkpoints are in the checkpoint callback's folder,
or start fresh when there is none (Lightning's own "last" says to set save_last=True, which
the default callbacks already do, and does not say where it looked)."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn


def resolve_ckpt_path(ckpt_path: str | None, callbacks: list) -> str | None:
    """The checkpoint file to resume from, or None to start fresh."""
    if ckpt_path != "last":
        return ckpt_path
    folders = [Path(cb.dirpath) for cb in callbacks
               if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None]
    if not folders:
        raise ValueError("ckpt_path=last resumes from the checkpoint callback's folder, but no "
                         "ModelCheckpoint with a dirpath is configured: use callbacks=default, "
                         "or give ckpt_path=<file>")
    # a file, or a folder for FSDP's sharded checkpoints
    found = [p for d in folders for p in d.glob("last*.ckpt") if p.exists()]
    if not found:
        rank_zero_warn(f"ckpt_path=last: no last.ckpt in {', '.join(map(str, folders))}; "
                       "starting a fresh run. To resume a run, set paths.output_dir to its "
                       "folder (the default output_dir is new at every launch)")
        return None
    latest = max(found, key=lambda p: p.stat().st_mtime)
    rank_zero_info(f"ckpt_path=last: resuming from {latest}")
    return str(latest)
