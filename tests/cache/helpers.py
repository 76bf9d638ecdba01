"""Run the caching script in a subprocess (to kill it, or to launch DDP ranks)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import lightning as L

from tests.fixtures import child_env

ROOT = Path(__file__).resolve().parents[2]


class Throttle(L.Callback):
    """Sleeps after each predict batch, so a test can kill the job in the middle."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_predict_batch_end(self, *args, **kwargs):
        time.sleep(self.seconds)


def script(overrides: list[str], **kw) -> subprocess.Popen:
    env = child_env()
    cmd = [sys.executable, str(ROOT / "scripts/cache_teacher_logits.py"), *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def run_script(overrides: list[str], timeout: float = 240) -> str:
    proc = script(overrides)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def wait_for(predicate, timeout: float = 120.0, every: float = 0.05) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError("condition not reached")
        time.sleep(every)
