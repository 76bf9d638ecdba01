"""StepTimer: the wall time, tokens and memory of each optimizer step of a real run, with the
clock and the allocator peak the benchmarks use (bench/bench_run.py puts them side by side).

A step's time runs from the previous step's end to this one's, the device synchronized at
both ends, so it holds everything the run does per step (data, rollout, logging, the
optimizer), validation excluded (timed apart). The allocator's peak is reset after `warmup`
steps; the JSON written to `path` when training ends has the per-step numbers, the medians
and each validation's seconds.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import lightning as L
import torch

from distill.training.callbacks.throughput import real_tokens, trained_batch


class StepTimer(L.Callback):
    def __init__(self, path: str, warmup: int = 5):
        self.path, self.warmup = Path(path), warmup
        self.ms: list[float] = []
        self.tokens: list[int] = []
        self.widths: list[int] = []  # the widest micro-batch of each step (its padded length)
        self.val_s: list[float] = []  # each validation's wall time (the sanity check's too)
        self._step_tokens, self._step_width, self._last, self._seen_step = 0, 0, None, 0
        self._at_step_end = False  # no batch has started since the last step's end

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def start(self, step: int = 0) -> None:
        """The clock starts: the first step's time runs from now. Any trainer's loop can drive
        the timer through `start`, `step_done` and `write` (bench/peers_trl.py: transformers')."""
        self._sync()
        self._last, self._seen_step = time.perf_counter(), step

    def on_train_start(self, trainer, pl_module) -> None:
        self.start(trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._at_step_end = False

    def on_validation_start(self, trainer, pl_module) -> None:
        self._sync()
        # right after a step: from that step's end, so that what Lightning does before this
        # hook (the loop's set-up, the loader's iterator and its workers) is validation's
        self._val_t0 = self._last if self._at_step_end else time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        self._sync()
        took = time.perf_counter() - self._val_t0
        self.val_s.append(took)
        if self._last is not None:  # validation is not part of a training step
            self._last += took

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        trained = trained_batch(batch)
        self._step_tokens += real_tokens(trained)
        self._step_width = max(self._step_width, int(trained["input_ids"].shape[-1]))
        if trainer.global_step == self._seen_step:
            return  # still inside the step's window
        self._seen_step = trainer.global_step
        self.step_done(self._step_tokens, self._step_width)
        self._step_tokens, self._step_width = 0, 0

    def step_done(self, tokens: int, width: int) -> None:
        """An optimizer step ended now: its time since the last one's end, its tokens and its
        widest micro-batch; after `warmup` steps the allocator's peak starts afresh."""
        self._sync()
        now = time.perf_counter()
        self.ms.append(1000 * (now - self._last))
        self.tokens.append(tokens)
        self.widths.append(width)
        self._last = now
        self._at_step_end = True
        if len(self.ms) == self.warmup and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def summary(self) -> dict:
        steady = list(zip(self.ms, self.tokens))[self.warmup:]
        out = {"steps": len(self.ms), "warmup": self.warmup, "ms": self.ms,
               "tokens": self.tokens, "widths": self.widths, "val_s": self.val_s}
        if steady:
            ms = statistics.median(m for m, _ in steady)
            toks = statistics.median(t for _, t in steady)
            out.update(median_ms=ms, median_tokens=toks, tokens_per_s=toks / ms * 1000)
        if torch.cuda.is_available():
            out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        return out

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.summary(), indent=1))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.write()
