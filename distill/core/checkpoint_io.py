"""Checkpoints written beside their final name and renamed into place: a kill or a full disk
mid-save leaves the previous good checkpoint where it was.

Lightning's own writer goes through a temporary file that may sit on another filesystem,
where the final move is a copy: a truncated `last.ckpt` under its final name (a full disk),
or a 0-byte one (SIGKILL during the save). Here the file is written in the checkpoint's own
folder, flushed to disk, then renamed over the old one (atomic on one filesystem), and the
folder itself is synced so the rename survives a crash. A writer killed mid-save leaves its
temporary file behind (`.last.ckpt.tmp-<pid>`): the next save into the folder removes it
once its process is gone.
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_temporaries(final: Path) -> None:
    """The temporary files of writers of `final` that were killed mid-save."""
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if "://" in str(path):  # remote storage: Lightning's fsspec path
            return super().save_checkpoint(checkpoint, path, storage_options)
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(final)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            torch.save(checkpoint, tmp)
            replace_file(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk: the old checkpoint stays as it was
            raise


# --- reading checkpoints back, and what may leave a run -----------------------------------
def non_finite(state: dict) -> list[str]:
    """The keys of the floating-point tensors of `state` that hold a NaN or an inf."""
    return [k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()
            and not bool(torch.isfinite(v).all())]


DIVERGED = "The run diverged; resume from an earlier checkpoint with a lower optimizer.lr"


def check_finite(state: dict, what: str, hint: str = DIVERGED) -> None:
    """Refuse weights with a NaN or an inf (`what` names them: 'the checkpoint x.ckpt'):
    nothing non-finite is exported, by a run (callbacks.export) or by distill-export."""
    bad = non_finite(state)
    if bad:
        raise ValueError(f"{what} has non-finite weights ({len(bad)} tensors, e.g. {bad[:3]}): "
                         f"not exported. {hint}")


def read_checkpoint(path) -> dict:
    """A Lightning checkpoint file, memory-mapped where it can be (cheap even at 7B); a file
    cut short (a full disk, a copy that did not finish) is named as such."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except (RuntimeError, OSError):
        pass  # an old, non-zip checkpoint cannot be mapped; nor can a damaged one
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, OSError, EOFError) as err:
        raise ValueError(f"{path} is not a whole checkpoint ({path.stat().st_size} bytes; "
                         f"{str(err).splitlines()[0]}): it was cut short or damaged; use "
                         "another checkpoint (checkpoints/ keeps last.ckpt and the "
                         "step-numbered ones)") from err


def check_resume(ckpt_path, student, name: str, prefix: str = "student.") -> None:
    """Refuse to resume from a checkpoint of another student (Lightning's error would be a
    raw `size mismatch` list), before the teacher loads. A sharded folder (FSDP) is left to
    Lightning."""
    if ckpt_path is None or "://" in str(ckpt_path) or Path(ckpt_path).is_dir():
        return
    state = read_checkpoint(ckpt_path).get("state_dict", {})
    theirs = {k: tuple(v.shape) for k, v in state.items() if k.startswith(prefix)}
    mine = {f"{prefix}{k}": tuple(v.shape) for k, v in student.state_dict().items()}
    shapes = [(k, theirs[k], mine[k]) for k in mine if k in theirs and theirs[k] != mine[k]]
    missing = sorted(set(mine) - set(theirs))
    extra = sorted(set(theirs) - set(mine))
    if not (shapes or missing or extra):
        return
    found = []
    if shapes:
        k, a, b = shapes[0]
        found.append(f"{len(shapes)} weights differ in shape (e.g. {k}: {a} in the "
                     f"checkpoint, {b} in this student)")
    if missing:
        found.append(f"{len(missing)} of this student's weights are not in it (e.g. "
                     f"{missing[0]})")
    if extra:
        found.append(f"{len(extra)} of its weights are not in this student (e.g. {extra[0]})")
    raise ValueError(f"ckpt_path={ckpt_path} is a checkpoint of another student than "
                     f"student.name_or_path={name} ({'; '.join(found)}). Resume with the "
                     "student (and student.lora settings) it was trained with, or start "
                     "fresh with ckpt_path=null")
