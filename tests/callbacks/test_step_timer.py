"""The run benchmark's parts: StepTimer's per-step record, the same-batch ratio and the
gap profile's reduction (bench/bench_run.py, bench/gaps.py)."""

import json
import time

import lightning as L
import torch
from torch.utils.data import DataLoader

from bench.step_timer import StepTimer
from tests.fixtures import load_script
from tests.test_loggers import _Tiny  # one weight, a loss from the batch, no updates


def test_step_timer_counts_each_optimizer_steps_tokens_and_widest_batch(tmp_path):
    batches = []
    for i in range(6):  # widths 3..8, real tokens 1 + i per row
        mask = torch.zeros(2, 3 + i, dtype=torch.long)
        mask[:, : 1 + i] = 1
        batches.append({"input_ids": torch.ones(2, 3 + i, dtype=torch.long),
                        "attention_mask": mask})
    timer = StepTimer(str(tmp_path / "timer.json"), warmup=1)
    trainer = L.Trainer(max_steps=3, accumulate_grad_batches=2, accelerator="cpu",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer])
    trainer.fit(_Tiny(), train_dataloaders=DataLoader(batches, batch_size=None))
    got = json.loads((tmp_path / "timer.json").read_text())
    assert got["steps"] == 3 and len(got["ms"]) == 3
    # each step: two micro-batches, their real tokens summed, the wider one's width
    assert got["tokens"] == [2 * 1 + 2 * 2, 2 * 3 + 2 * 4, 2 * 5 + 2 * 6]
    assert got["widths"] == [4, 6, 8]
    assert got["median_tokens"] == 18  # the 2 steps after the warm-up: 14 and 22


class _SlowValidation(_Tiny):
    def validation_step(self, batch, batch_idx):
        time.sleep(0.2)


class _SlowStart(list):
    """Validation batches whose iterator takes 0.3 s to start (a loader starting its workers
    or shuffling a large index does this before Lightning calls on_validation_start)."""

    def __iter__(self):
        time.sleep(0.3)
        return super().__iter__()


def test_step_timer_times_each_validation_apart_from_the_steps(tmp_path):
    """A sanity check, then validation after steps 2 and 4: 0.2 s a batch (two batches) and
    0.3 s for the loader's iterator to start. Each validation is timed whole, the start
    included, and no step's time holds any of it (the steps take milliseconds)."""
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long),
             "attention_mask": torch.ones(2, 4, dtype=torch.long)}
    timer = StepTimer(str(tmp_path / "timer.json"), warmup=0)
    trainer = L.Trainer(max_steps=4, val_check_interval=2, limit_val_batches=2,
                        num_sanity_val_steps=2, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer])
    trainer.fit(_SlowValidation(), train_dataloaders=DataLoader([batch] * 4, batch_size=None),
                val_dataloaders=_SlowStart([batch] * 2))
    got = json.loads((tmp_path / "timer.json").read_text())
    sanity, *during = got["val_s"]
    assert len(during) == 2 and all(0.7 <= s < 2.5 for s in during), got
    assert 0.4 <= sanity < 2.5, got  # its loader start-up came before on_validation_start
    assert len(got["ms"]) == 4 and max(got["ms"]) < 200, got


def test_same_batches_ratio_needs_the_same_tokens_and_widths():
    bench_run = load_script("bench/bench_run.py")
    run = {"ms": [900, 10, 20, 30], "tokens": [5, 5, 5, 10], "widths": [8, 8, 8, 16]}
    step = {"ms": [700, 10, 10, 25], "tokens": [5, 5, 5, 10], "widths": [8, 8, 8, 16]}
    got = bench_run.same_batches(run, step, warmup=1, skip={2})
    # steps 1 and 3: the run 15 tokens in 40 ms, the step 15 tokens in 35 ms
    assert got["steps"] == 2
    assert abs(got["run_tokens_per_s"] - 375.0) < 1e-9
    assert abs(got["step_tokens_per_s"] - 15 / 35 * 1000) < 1e-9
    assert abs(got["ratio"] - 35 / 40) < 1e-12
    assert bench_run.same_batches(run, {**step, "widths": [8, 8, 16, 16]}, 1, set()) is None
    assert bench_run.same_batches(run, {**step, "tokens": [5, 5, 6, 10]}, 1, set()) is None


def test_the_table_ends_with_the_runs_ratios_of_one_call(capsys):
    bench_run = load_script("bench/bench_run.py")

    def run(rate):
        return {"run": {"tokens_per_s": rate, "median_ms": 1.0}, "step": {}}
    bench_run.print_table({"packed": run(20000.0), "cached": run(53000.0),
                           "unpacked": run(8000.0)})
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == ["cached / packed run tokens/s: 2.65x (target >= 2.6x)",
                          "packed / unpacked run tokens/s: 2.50x (target >= 1.0x)"]
    bench_run.print_table({"packed": run(20000.0), "cached": {"run": {"rc": 1}, "step": {}}})
    assert "cached / packed" not in capsys.readouterr().out  # a failed run has no rate


def test_gap_summary_finds_the_device_idle_time_and_what_the_host_did():
    gaps = load_script("bench/gaps.py")
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 500, "dur": 1500},  # overlaps
        {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 2100, "dur": 400},
        {"ph": "X", "cat": "kernel", "name": "adam", "ts": 6500, "dur": 500},
        {"ph": "X", "cat": "cpu_op", "name": "Optimizer.step#AdamW.step", "ts": 2600,
         "dur": 3800},
        {"ph": "X", "cat": "cpu_op", "name": "aten::tiny", "ts": 3000, "dur": 10},
        {"ph": "i", "cat": "kernel", "name": "not a span", "ts": 0}]}
    got = gaps.summarize(trace, min_gap_us=200)
    # device busy [0, 2000] + [2100, 2500] + [6500, 7000]: 2.9 of 7.0 ms; the 100 us gap is
    # under the minimum, the 4 ms one is listed with the host op that filled it
    assert (got["span_ms"], got["busy_ms"], got["idle_ms"]) == (7.0, 2.9, 4.1)
    assert got["gaps_over_min"] == 1 and got["gap_ms_over_min"] == 4.0
    assert got["largest"] == [{"at_ms": 2.5, "ms": 4.0, "host": ["Optimizer.step#AdamW.step"]}]
    assert got["kernels_ms"] == {"gemm": 2.5, "adam": 0.5, "copy": 0.4}
