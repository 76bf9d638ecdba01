"""Where the GPU waits: a torch.profiler trace of a few steps, reduced to the device's idle
time and the host work that ran while it idled.

bench/bench_run.py profiles the same steps of the run (the `GapProfile` callback) and of
the benchmark's step (`profiled`), so the two gap lists can be read side by side. The
profiler slows the host a little in both, so gaps read larger than they are; what they
overlap with is what matters.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "user_annotation", "python_function")


def _busy(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals, sorted."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def summarize(trace: dict, min_gap_us: float = 200.0, top: int = 12) -> dict:
    """Device busy / idle time over the trace's span, and its largest idle gaps, each with
    the host events that overlap it most."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = _busy([(e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("cat") in DEVICE_CATEGORIES])
    if not device:
        return {"device_events": 0}
    start, end = device[0][0], device[-1][1]
    busy = sum(b - a for a, b in device)
    gaps = [(a_end, b_start) for (_, a_end), (b_start, _) in zip(device, device[1:])
            if b_start - a_end >= min_gap_us]
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES
            and not e["name"].startswith("ProfilerStep")]
    listed = []
    for g0, g1 in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        overlap = Counter()
        for e in host:
            o = min(g1, e["ts"] + e["dur"]) - max(g0, e["ts"])
            if o > 0.2 * (g1 - g0):
                overlap[e["name"][:80]] += o
        listed.append({"at_ms": round((g0 - start) / 1e3, 2), "ms": round((g1 - g0) / 1e3, 3),
                       "host": [n for n, _ in overlap.most_common(6)]})
    kernels = Counter()
    for e in events:
        if e.get("cat") in DEVICE_CATEGORIES:
            kernels[e["name"][:70]] += e["dur"]
    return {"kernels_ms": {n: round(t / 1e3, 2) for n, t in kernels.most_common(5 * top)},
            "span_ms": round((end - start) / 1e3, 2), "busy_ms": round(busy / 1e3, 2),
            "idle_ms": round((end - start - busy) / 1e3, 2),
            "gaps_over_min": len(gaps), "gap_ms_over_min": round(
                sum(b - a for a, b in gaps) / 1e3, 2), "largest": listed}


@contextmanager
def profiled(path: Path):
    """Profile the block (CPU and CUDA) and write its summary as JSON to `path`."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        summary = summarize(json.loads(trace.read_text()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))


class GapProfile(L.Callback):
    """Profile optimizer steps [start, start + steps) of a run (`profiled` above)."""

    def __init__(self, path: str, start: int = 10, steps: int = 2):
        self.path, self.start, self.steps = Path(path), start, steps
        self._ctx, self._done = None, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if (self._ctx is None and not self._done and trainer.is_global_zero
                and trainer.global_step == self.start):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._ctx = profiled(self.path)
            self._ctx.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._ctx is not None and trainer.global_step == self.start + self.steps:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._close()

    def on_train_end(self, trainer, pl_module):
        if self._ctx is not None:  # training ended inside the profiled steps
            self._close()

    def _close(self):
        self._ctx.__exit__(None, None, None)
        self._ctx, self._done = None, True
