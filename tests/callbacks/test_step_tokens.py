"""StepTokenCounter proofs: for every policy, K micro-batches on W ranks give exactly the
gradient of the step's loss computed in one pass; resume, errors and the command line."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DeepSpeedStrategy
from safetensors.torch import load_file

from distill.data import DistillDataModule
from distill.models.causal_lm import load_tokenizer
from distill.train import train
from distill.training import normalization
from distill.training.callbacks.step_tokens import StepTokenCounter, check_strategy
from distill.training.normalization import POLICIES
from tests.callbacks import proof
from tests.fixtures import child_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tiny_assets) -> str:
    return str(tiny_assets["student"].parent)


def _batches(assets: str, rank: int) -> list[dict]:
    return proof.micro_batches(rank, proof.models(assets)[0].config.vocab_size)


def _check_steps(assets: str, got: dict, k: int, world: int) -> None:
    """Every step of every policy against the one-pass reference over all ranks' data."""
    per_rank = [_batches(assets, r) for r in range(world)]
    windows = proof.windows(proof.N_MICRO, k)
    for policy in POLICIES:
        assert len(got[policy]) == len(windows), policy
    for i, window in enumerate(windows):
        step = [rank[j] for rank in per_rank for j in window]
        want = proof.reference_grads(assets, step, POLICIES)
        for policy in POLICIES:
            proof.assert_grads_match(got[policy][i], want[policy])
            empty = all(not (b["labels"][:, 1:] != -100).any() for b in step)
            if empty:  # no valid token in the whole step: zero gradient, no NaN
                assert all(torch.equal(g, torch.zeros_like(g)) for g in got[policy][i].values())


# k=1: one step has no valid token; k=3: windows 3, 3, 1, the short last one a real SFT
# micro-batch; k=4: windows 4, 3, the short last one with an empty micro-batch in it
@pytest.mark.parametrize("k", [1, 3, 4])
def test_step_gradient_is_the_one_pass_gradient(assets, k):
    batches = _batches(assets, 0)
    last = [batches[j] for j in proof.windows(proof.N_MICRO, k)[-1]]
    if k > 1:  # the epoch's last window is short and trains something
        assert len(last) < k and any((b["labels"][:, 1:] != -100).any() for b in last)
    normalization._warned.clear()
    got = {}
    for policy in POLICIES:
        module = proof.make_module(assets, policy)
        if policy == "micro_batch_valid_tokens" and k > 1:
            with pytest.warns(UserWarning, match="biased"):
                got[policy] = proof.fit_grads(module, batches, k)
        else:
            got[policy] = proof.fit_grads(module, batches, k)
    _check_steps(assets, got, k, world=1)
    if k > 1:  # windows with very different micro-batches: the naive mean is visibly off
        a, b = got["valid_tokens"][0], got["micro_batch_valid_tokens"][0]
        diff = sum((a[n] - b[n]).norm() ** 2 for n in a) ** 0.5
        norm = sum(a[n].norm() ** 2 for n in a) ** 0.5
        assert diff > 0.1 * norm, (diff, norm)


def test_a_short_last_window_with_no_valid_token_trains_nothing(assets):
    """K = 2 over [SFT, empty, empty]: the second window, short, has no valid token. Every
    policy gives it a zero gradient (no NaN), and the first window its one-pass gradient."""
    b = _batches(assets, 0)
    batches = [b[0], b[1], b[proof.EMPTY]]
    assert not (b[1]["labels"] != -100).any() and not (b[proof.EMPTY]["labels"] != -100).any()
    normalization._warned.clear()
    for policy in POLICIES:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*biased", UserWarning)
            got = proof.fit_grads(proof.make_module(assets, policy), batches, 2)
        assert len(got) == 2, policy
        want = proof.reference_grads(assets, batches[:2], [policy])[policy]
        proof.assert_grads_match(got[0], want)
        assert got[1] and all(torch.equal(g, torch.zeros_like(g)) for g in got[1].values())


@pytest.fixture(scope="module")
def ddp_grads(assets, tmp_path_factory):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    out = tmp_path_factory.mktemp("ddp") / "grads.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests/callbacks/ddp_worker.py"), assets, str(out)]
    env = child_env()
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(out)


@pytest.mark.slow  # >10 s on a 2-core CPU (make test runs it)
@pytest.mark.parametrize("k", [1, 3, 4])
def test_ddp_step_gradient_is_the_one_pass_gradient(assets, ddp_grads, k):
    _check_steps(assets, {p: ddp_grads[(p, k)] for p in POLICIES}, k, world=2)


def _sft_datamodule(tiny_assets):
    tokenizer = load_tokenizer(str(tiny_assets["student"]))
    return DistillDataModule(tokenizer, train=[{"kind": "sft", "path": tiny_assets["sft_train"]}],
                             val=[{"kind": "sft", "path": tiny_assets["sft_val"]}],
                             batch_size=4, max_length=64)


def _fit_sft(assets, tiny_assets, ckpt_dir, ckpt_path=None):
    """48 shuffled SFT examples in micro-batches of 4 and K=5: windows 5, 5, 2 per epoch;
    validation every 4 micro-batches, in the middle of a window."""
    capture = proof.GradCapture()
    save = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)
    trainer = proof.trainer(5, callbacks=[capture, save], max_epochs=-1, max_steps=6,
                            enable_checkpointing=True, val_check_interval=4,
                            check_val_every_n_epoch=None, limit_val_batches=1)
    trainer.fit(proof.make_module(assets, "valid_tokens", lr=0.5),
                datamodule=_sft_datamodule(tiny_assets), ckpt_path=ckpt_path)
    return capture.steps


@pytest.fixture(scope="module")
def uninterrupted(assets, tiny_assets, tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("ckpt")
    return _fit_sft(assets, tiny_assets, ckpt_dir), ckpt_dir


# step 1: mid-epoch 0; step 3: the end of epoch 0 (its short window); step 4: mid-epoch 1,
# where the shuffle order comes from the generator state saved with the checkpoint
@pytest.mark.parametrize("step", [1, 3, 4])
def test_resume_mid_epoch_continues_the_same_steps(assets, tiny_assets, uninterrupted, step,
                                                   tmp_path):
    steps, ckpt_dir = uninterrupted
    ckpt = next(ckpt_dir.glob(f"epoch=*-step={step}.ckpt"))
    resumed = _fit_sft(assets, tiny_assets, tmp_path, ckpt_path=str(ckpt))
    assert len(resumed) == 6 - step
    for got, want in zip(resumed, steps[step:]):
        proof.assert_grads_match(got, {n: g.double() for n, g in want.items()}, rtol=1e-6)


def test_refuses_a_strategy_that_accumulates_itself():
    fake = object.__new__(DeepSpeedStrategy)  # deepspeed itself need not be installed
    with pytest.raises(ValueError, match="DeepSpeedStrategy cannot keep the token"):
        check_strategy(fake)


def test_accumulation_without_the_counter_is_an_error(assets):
    module = proof.make_module(assets, "valid_tokens")
    trainer = proof.trainer(2)
    trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, StepTokenCounter)]
    from torch.utils.data import DataLoader

    loader = DataLoader(proof.CountingBatches(_batches(assets, 0)), batch_size=None)
    with pytest.raises(RuntimeError, match="needs the StepTokenCounter callback"):
        trainer.fit(module, train_dataloaders=loader)


def test_command_line_accumulation_equals_one_big_batch(compose_cfg, tmp_path):
    """One SGD step: 4 micro-batches of 2 save the same student as 1 batch of 8."""
    students, metrics = [], []
    for k, size in ((4, 2), (1, 8)):
        cfg = compose_cfg("+experiment=sft_rkl", "optimizer=sgd", "scheduler=none",
                          "trainer.gradient_clip_val=null", "trainer.max_steps=1",
                          f"trainer.accumulate_grad_batches={k}", f"data.batch_size={size}",
                          out=tmp_path / f"k{k}")
        summary = train(cfg)
        students.append(load_file(Path(summary["student_dir"]) / "model.safetensors"))
        metrics.append(summary["metrics"])
    assert metrics[0]["train/step_valid_tokens"] == metrics[1]["train/step_valid_tokens"]
    torch.testing.assert_close(metrics[0]["train/loss"], metrics[1]["train/loss"], rtol=1e-5,
                               atol=0)
    for name, w in students[0].items():
        torch.testing.assert_close(w, students[1][name], rtol=1e-5, atol=1e-7)
