"""Under DDP only rank 0 receives SIGTERM (a scheduler may signal one process): the flag is
summed over the ranks at each step boundary, so both ranks save one checkpoint together and
stop at the same step, each exiting 143; a NaN on one rank stops both at the same step."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import torch

from tests.faults import windows_state
from tests.fixtures import torchrun_train


def _ddp_run(tiny_assets, out: Path, *extra: str):
    return torchrun_train(tiny_assets, out, "trainer.accumulate_grad_batches=2",
                          "trainer.max_steps=50", *extra)


def test_sigterm_on_rank_0_stops_every_rank_at_the_same_step(tiny_assets, tmp_path):
    out = tmp_path / "ddp"
    run = _ddp_run(tiny_assets, out, "+callbacks.kill._target_=tests.faults.SendSignal",
                   "+callbacks.kill.batch=2", f"+callbacks.kill.signum={int(signal.SIGTERM)}",
                   "+callbacks.kill.rank=0")
    text = run.stdout + run.stderr
    assert run.returncode != 0
    steps = re.findall(r"stopped by SIGTERM at the end of optimizer step (\d+)", text)
    assert steps == ["2", "2"], text[-4000:]  # both ranks, the same step
    assert "[rank 0] SIGTERM received" in text and "[rank 1] SIGTERM received" not in text
    ckpt = torch.load(out / "checkpoints/last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 2 and windows_state(ckpt)["position"] == 4


def test_a_nan_gradient_on_rank_1_only_stops_both_ranks_at_that_step(tiny_assets, tmp_path):
    run = _ddp_run(tiny_assets, tmp_path / "nan", "+callbacks.poison._target_=tests.faults."
                   "PoisonGrads", "+callbacks.poison.at=3", "+callbacks.poison.rank=1")
    text = run.stdout + run.stderr
    assert run.returncode != 0
    assert len(re.findall(r"TrainingDiverged: the run diverged at optimizer step 3\b", text)) \
        == 2, text[-4000:]
