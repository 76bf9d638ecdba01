"""DistillFSDP training on CPU: two gloo ranks, torch's FSDP (tests/callbacks/fsdp_worker.py,
which says what the CPU needs changed: FSDP's device argument and an offload in the full
state dict). The valid_tokens step of K=2 micro-batches on W=2 ranks is the float64
one-pass gradient of all four, and a sharded checkpoint resumes to exactly the weights of
the uninterrupted run, with SGD and with AdamW (sharded optimizer state). The GPU check
(tests/gpu/check_multi_gpu.py) runs the same on NCCL, with DistillFSDP unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.callbacks import proof

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fsdp_results(tiny_assets, tmp_path_factory):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    tmp = tmp_path_factory.mktemp("fsdp")
    assets = str(tiny_assets["student"].parent)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests/callbacks/fsdp_worker.py"), assets, str(tmp / "out.pt"),
           str(tmp / "ckpt")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return assets, torch.load(tmp / "out.pt")


@pytest.mark.slow  # >10 s on a 2-core CPU (make test runs it)
def test_fsdp_step_is_the_one_pass_gradient_of_both_ranks(fsdp_results):
    assets, got = fsdp_results
    vocab = proof.models(assets)[0].config.vocab_size
    step = proof.micro_batches(0, vocab)[:2] + proof.micro_batches(1, vocab)[:2]
    want = proof.reference_grads(assets, step, ["valid_tokens"])["valid_tokens"]
    grads = got["equality"]
    # the state dict names the tied head too: the same tensor as the embedding
    assert set(grads) - set(want) <= {"lm_head.weight"}
    if "lm_head.weight" in grads:
        torch.testing.assert_close(grads["lm_head.weight"], grads["model.embed_tokens.weight"])
    proof.assert_grads_match({k: grads[k] for k in want}, want)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fsdp_sharded_checkpoint_resumes_the_same_run(fsdp_results, optimizer):
    _, got = fsdp_results
    r = got[optimizer]
    assert r["sharded"]  # last.ckpt is a folder of per-rank shards
    assert r["loaded"] == 4  # the resumed fit trained steps 3 and 4 only (K = 2)
    whole, first, resumed = r["whole"], r["first"], r["resumed"]
    assert set(whole) == set(resumed) == set(first)
    # two steps more change the student, so the equality below means something
    assert max((whole[k] - first[k]).abs().max().item() for k in whole) > 1e-4
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k], rtol=0, atol=1e-6, msg=k)
