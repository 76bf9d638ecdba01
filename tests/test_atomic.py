"""Checkpoints and exports are written beside their final name and renamed into place: a
SIGKILL in the middle of a save or a full disk never loses the previous good `last.ckpt`
(nor a good exported student), and `ckpt_path=last` resumes from it afterwards."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distill.core.checkpoint_io as cio
from distill.train import train
from tests.fixtures import child_env

ROOT = Path(__file__).resolve().parents[1]
EVERY_2 = "callbacks.checkpoint.every_n_train_steps=2"


def _half_then_full_disk(obj, f, *args, **kwargs):
    """torch.save on a disk that fills up halfway through the file."""
    with open(f, "wb") as out:
        out.write(b"PK\x03\x04" + b"\0" * 1000)  # the start of a zip archive, then no room
    raise OSError(errno.ENOSPC, "No space left on device", str(f))


def _global_step(path: Path) -> int:
    return torch.load(path, weights_only=False)["global_step"]


def test_a_full_disk_mid_save_keeps_the_previous_checkpoint(compose_cfg, tmp_path, monkeypatch):
    out = tmp_path / "full"
    train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=2", EVERY_2, out=out))
    last = out / "checkpoints/last.ckpt"
    good = last.read_bytes()
    monkeypatch.setattr(cio.torch, "save", _half_then_full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=4", EVERY_2,
                          "ckpt_path=last", out=out))
    assert last.read_bytes() == good  # untouched, still loadable
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # no temp file left
    monkeypatch.undo()
    summary = train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=4", EVERY_2,
                                "ckpt_path=last", out=out))
    assert summary["global_step"] == 4 and _global_step(last) == 4


def test_a_sigkill_in_the_middle_of_a_save_keeps_the_previous_checkpoint(
        tiny_assets, compose_cfg, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-c", "import tests.faults as f; f.train_with_a_save_that_hangs(2)",
           "+experiment=sft_fkl", f"paths.output_dir={out}",
           f"student.name_or_path={tiny_assets['student']}",
           f"teacher.name_or_path={tiny_assets['teacher']}",
           f"paths.data={tiny_assets['sft_train'].parent}", "evaluate=null",
           "data.batch_size=4", "trainer.max_steps=100", EVERY_2,
           "callbacks.progress.refresh_rate=0"]
    env = child_env()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = next((x for x in proc.stdout if x.startswith("HALF-WRITTEN")), None)
        assert line is not None, "the run ended before its second save"
        proc.send_signal(signal.SIGKILL)  # mid-write: half the file is on disk
    finally:
        proc.kill()
        proc.wait(timeout=60)
    last = out / "checkpoints/last.ckpt"
    half = Path(line.split()[1])
    assert half.parent == last.parent and half.name.startswith(".last.ckpt.tmp-")
    assert _global_step(last) == 2  # the save before it, whole
    summary = train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=6", EVERY_2,
                                "ckpt_path=last", out=out))
    assert summary["global_step"] == 6 and _global_step(last) == 6
    assert not half.exists()  # the killed writer's leftover is cleared by the next save


def test_a_full_disk_during_the_export_keeps_the_earlier_student(compose_cfg, tmp_path,
                                                                monkeypatch):
    import distill.export.callback as export

    out = tmp_path / "export"
    train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=2", out=out))
    student = out / "student"
    before = {p.name: p.read_bytes() for p in student.iterdir()}

    def full_disk(model, state, dirpath, merge):
        dirpath.mkdir(parents=True)
        (dirpath / "model.safetensors").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export, "save_student", full_disk)
    with pytest.raises(OSError, match="No space left"):
        train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=2", out=out))
    assert {p.name: p.read_bytes() for p in student.iterdir()} == before
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".student", "student"))) \
        == ["student"]
