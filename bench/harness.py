"""What the rollout bench and the GPU check share: a time limit per step, CUDA timing and
memory, results written as they come (a killed run keeps what it measured)."""

from __future__ import annotations

import json
import signal
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def on_path() -> None:
    """distill from this checkout (installed or not), and bench/ for the shared shapes."""
    for path in (ROOT, ROOT / "bench"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


@contextmanager
def time_limit(seconds: float, what: str):
    """Raise TimeoutError in the main thread after `seconds` (checked between Python lines:
    a hung kernel is the command's own timeout's job)."""

    def fire(signum, frame):
        raise TimeoutError(f"{what}: over its {seconds:.0f} s limit")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def timed(fn, repeats: int = 1) -> tuple[float, list[float], object]:
    """(median seconds, every run's seconds, the last result), synchronized around each run."""
    runs, out = [], None
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs), runs, out


def gib(nbytes: float) -> float:
    return round(nbytes / 2**30, 3)


class Results:
    """Rows of results, printed as they come and rewritten to `path` (JSON) after each."""

    def __init__(self, path: Path | None, meta: dict):
        self.path, self.meta, self.rows = path, meta, []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, **row) -> dict:
        self.rows.append(row)
        print("RESULT " + json.dumps(row, default=str), flush=True)
        if self.path is not None:
            self.path.write_text(json.dumps({"meta": self.meta, "rows": self.rows}, indent=1,
                                            default=str))
        return row

    def attempt(self, what: str, seconds: float, fn, **row) -> dict:
        """Run fn() -> dict under a time limit; an error becomes a row that says so."""
        start = time.perf_counter()
        try:
            with time_limit(seconds, what):
                row.update(fn())
        except Exception as err:  # noqa: BLE001 - every failure is reported, the run goes on
            traceback.print_exc()
            row.update(error=f"{type(err).__name__}: {err}"[:500])
            torch.cuda.synchronize() if torch.cuda.is_available() else None
        row["wall_s"] = round(time.perf_counter() - start, 2)
        row["status"] = "ERROR" if "error" in row else (
            ("PASS" if row["ok"] else "FAIL") if "ok" in row else "done")
        return self.add(what=what, **row)


def environment() -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    return info
