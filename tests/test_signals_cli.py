"""`python -m distill.train` as a scheduler or a user stops it: a real SIGTERM / SIGINT from
outside the process. It exits 143 / 130 (never 0: `train && eval` must not carry on),
prints the resume command, and that command, run as printed, resumes the run."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.faults import windows_state
from tests.fixtures import child_env

ROOT = Path(__file__).resolve().parents[1]


def _command(tiny_assets, out: Path, marker: Path) -> list[str]:
    return [sys.executable, "-m", "distill.train", "+experiment=sft_fkl",
            f"paths.output_dir={out}", f"student.name_or_path={tiny_assets['student']}",
            f"teacher.name_or_path={tiny_assets['teacher']}",
            f"paths.data={tiny_assets['sft_train'].parent}", "evaluate=null",
            "data.batch_size=4", "trainer.accumulate_grad_batches=2",
            "trainer.max_steps=100000", "trainer.val_check_interval=1000",
            "callbacks.progress.refresh_rate=0", "+callbacks.marker._target_=tests.faults.Marker",
            f"+callbacks.marker.path={marker}"]


def _env() -> dict:
    return {**child_env(),
            "HYDRA_FULL_ERROR": "1"}


def _wait_for_steps(proc, marker: Path, steps: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()[1][-3000:]}")
        if marker.exists() and marker.read_text().strip().isdigit() and \
                int(marker.read_text()) >= steps:
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the run did not start training in time")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_from_outside_exits_non_zero_with_a_resume_command_that_works(
        tiny_assets, tmp_path, signum):
    out, marker = tmp_path / "run", tmp_path / "marker"
    proc = subprocess.Popen(_command(tiny_assets, out, marker), cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_steps(proc, marker, 2)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signum, err[-3000:]
    line = next(x for x in err.splitlines() if x.startswith(f"stopped by {signum.name}"))
    ckpt = torch.load(out / "checkpoints/last.ckpt", weights_only=False)
    assert f"at the end of optimizer step {ckpt['global_step']}" in line
    assert windows_state(ckpt)["position"] % 2 == 0  # a step boundary (K=2)
    assert not (out / "student").exists()
    if signum != signal.SIGTERM:
        return
    # the printed command, as a user would paste it, runs two more steps and exports
    resume = shlex.split(line.split("Resume with: ")[1])
    assert resume[:3] == ["python", "-m", "distill.train"]
    assert f"ckpt_path={out / 'checkpoints/last.ckpt'}" in resume
    more = ckpt["global_step"] + 2
    resume = [sys.executable, *resume[1:]]
    resume = [a for a in resume if not a.startswith("trainer.max_steps=")]
    done = subprocess.run([*resume, f"trainer.max_steps={more}"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Restored all states from the checkpoint at {out / 'checkpoints/last.ckpt'}" \
        in done.stderr
    assert "middle of a step window" not in done.stderr
    assert re.search(rf"optimizer steps:\s+{more}\b", done.stdout), done.stdout[-2000:]
    assert (out / "student/model.safetensors").exists()
