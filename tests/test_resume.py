"""Resumes that cannot go wrong: extending a finished run continues its exact steps, a
mid-epoch resume with another K or batch size is refused and says which, and
`ckpt_path=last` resumes or starts fresh with a message that says where it looked."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from distill.data import DistillDataModule, StepWindows
from distill.models.causal_lm import load_tokenizer
from distill.train import train
from tests.callbacks import proof

MAX_STEPS = 6  # 48 examples in micro-batches of 4, K=5: windows 5, 5, 2 -> 3 steps an epoch


@pytest.fixture(scope="module")
def assets(tiny_assets) -> str:
    return str(tiny_assets["student"].parent)


class ShardedData(DistillDataModule):
    """A loader of the user's own, shuffled by a DistributedSampler as under DDP and windowed
    by StepWindows.from_loader: the order is a function of the epoch number the windows give
    the sampler (set_epoch), which must be the data's epoch after a resume too."""

    def train_dataloader(self):
        sampler = DistributedSampler(self.train_set, num_replicas=1, rank=0, seed=3)
        loader = DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler,
                            collate_fn=self.collate)
        return StepWindows.from_loader(loader, self.trainer.accumulate_grad_batches)


def _fit(assets, tiny_assets, ckpt_dir, *, max_steps, ckpt_path=None, k=5, batch_size=4,
         data_cls=DistillDataModule):
    """SFT data, SGD, the demo's checkpoint settings: `last.ckpt` is only written when
    training ends (every_n_train_steps far away), as after a finished run."""
    capture = proof.GradCapture()
    save = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0,
                           every_n_train_steps=500)
    trainer = proof.trainer(k, callbacks=[capture, save], max_epochs=-1, max_steps=max_steps,
                            enable_checkpointing=True, val_check_interval=4,
                            check_val_every_n_epoch=None, limit_val_batches=1)
    tok = load_tokenizer(str(tiny_assets["student"]))
    data = data_cls(tok, train=[{"kind": "sft", "path": tiny_assets["sft_train"]}],
                    val=[{"kind": "sft", "path": tiny_assets["sft_val"]}],
                    batch_size=batch_size, max_length=64)
    trainer.fit(proof.make_module(assets, "valid_tokens", lr=0.5), datamodule=data,
                ckpt_path=ckpt_path)
    return capture.steps, trainer


@pytest.fixture(scope="module")
def uninterrupted(assets, tiny_assets, tmp_path_factory):
    steps, _ = _fit(assets, tiny_assets, tmp_path_factory.mktemp("full"), max_steps=MAX_STEPS)
    assert len(steps) == MAX_STEPS
    return steps


# 1: stopped mid-epoch 0; 3: at the end of epoch 0; 4: mid-epoch 1 (shuffled by the
# generator state the checkpoint holds)
@pytest.mark.parametrize("stop", [1, 3, 4])
def test_extending_a_finished_run_continues_its_exact_steps(assets, tiny_assets,
                                                            uninterrupted, stop, tmp_path):
    _fit(assets, tiny_assets, tmp_path, max_steps=stop)
    last = tmp_path / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == stop
    steps, trainer = _fit(assets, tiny_assets, tmp_path / "more", max_steps=MAX_STEPS,
                          ckpt_path=str(last))
    assert trainer.global_step == MAX_STEPS and len(steps) == MAX_STEPS - stop
    for got, want in zip(steps, uninterrupted[stop:]):
        proof.assert_grads_match(got, {n: g.double() for n, g in want.items()}, rtol=1e-6)


# (1, 4): extended twice, mid-epoch 0 then mid-epoch 1; (3,): at the end of epoch 0
@pytest.mark.parametrize("stops", [(1, 4), (3,)], ids=["twice", "epoch_end"])
def test_extending_with_an_epoch_seeded_sampler_continues_its_exact_steps(assets, tiny_assets,
                                                                          stops, tmp_path):
    """After an end-of-run checkpoint Lightning numbers the unfinished epoch one higher;
    a DistributedSampler (DDP), whose order is a function of the epoch, must still replay
    the uninterrupted run's order, in this epoch and the next."""
    full, _ = _fit(assets, tiny_assets, tmp_path / "full", max_steps=MAX_STEPS,
                   data_cls=ShardedData)
    _fit(assets, tiny_assets, tmp_path / "0", max_steps=stops[0], data_cls=ShardedData)
    for i, (start, stop) in enumerate(zip(stops, [*stops[1:], MAX_STEPS])):
        steps, _ = _fit(assets, tiny_assets, tmp_path / str(i + 1), max_steps=stop,
                        ckpt_path=str(tmp_path / str(i) / "last.ckpt"), data_cls=ShardedData)
        assert len(steps) == stop - start
        for got, want in zip(steps, full[start:stop]):
            proof.assert_grads_match(got, {n: g.double() for n, g in want.items()}, rtol=1e-6)


@pytest.fixture(scope="module")
def stopped_mid_epoch(assets, tiny_assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("mid")
    _fit(assets, tiny_assets, out, max_steps=1)
    return out / "last.ckpt"


@pytest.mark.parametrize("change,message", [
    ({"k": 3}, "trainer.accumulate_grad_batches=3: the checkpoint was written with "
     "trainer.accumulate_grad_batches=5"),
    ({"batch_size": 2}, "data.batch_size=2: the checkpoint was written with "
     "data.batch_size=4"),
], ids=["accumulate_grad_batches", "batch_size"])
def test_a_mid_epoch_resume_with_another_k_or_batch_size_is_refused(
        assets, tiny_assets, stopped_mid_epoch, change, message, tmp_path):
    with pytest.raises(ValueError, match=f"cannot resume mid-epoch with {message}") as err:
        _fit(assets, tiny_assets, tmp_path, max_steps=3, ckpt_path=str(stopped_mid_epoch),
             **change)
    assert "Resume with" in str(err.value)


def test_another_k_from_an_epoch_end_checkpoint_runs_exact_windows(assets, tiny_assets,
                                                                    tmp_path):
    """Stopped at the end of epoch 0 (3 steps of K=5); epoch 1 with K=4: windows 4, 4, 4."""
    _fit(assets, tiny_assets, tmp_path, max_steps=3)
    seen = []

    class Windows(proof.GradCapture):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(pl_module.sums.counts.micro_batches)

    capture = Windows()
    save = ModelCheckpoint(dirpath=tmp_path / "more", save_last=True, save_top_k=0)
    trainer = proof.trainer(4, callbacks=[capture, save], max_epochs=-1, max_steps=6,
                            enable_checkpointing=True, limit_val_batches=0)
    tok = load_tokenizer(str(tiny_assets["student"]))
    data = DistillDataModule(tok, train=[{"kind": "sft", "path": tiny_assets["sft_train"]}],
                             batch_size=4, max_length=64)
    trainer.fit(proof.make_module(assets, "valid_tokens", lr=0.5), datamodule=data,
                ckpt_path=str(tmp_path / "last.ckpt"))
    assert seen == [4, 4, 4] and trainer.global_step == 6


def test_ckpt_path_last_starts_fresh_then_resumes(compose_cfg, tmp_path):
    out = tmp_path / "run"
    with pytest.warns(UserWarning, match=r"ckpt_path=last: no last.ckpt in .*checkpoints; "
                      "starting a fresh run") as record:
        summary = train(compose_cfg("+experiment=sft_rkl", "trainer.max_steps=2",
                                    "ckpt_path=last", out=out))
    assert summary["global_step"] == 2
    assert not any("save_last=True" in str(w.message) for w in record)  # Lightning's hint
    # the run's own end-of-run last.ckpt, extended with more steps
    summary = train(compose_cfg("+experiment=sft_rkl", "trainer.max_steps=5", "ckpt_path=last",
                                out=out))
    assert summary["global_step"] == 5


def test_a_missing_checkpoint_file_is_refused_before_loading(compose_cfg, tmp_path):
    from distill.run.config import ConfigError

    with pytest.raises(ConfigError, match=r"ckpt_path='.*nope.ckpt': must be null, 'last' "
                       r"\(resume .*\) or the path of an existing checkpoint"):
        train(compose_cfg("+experiment=sft_rkl", f"ckpt_path={tmp_path / 'nope.ckpt'}"))


def test_last_finds_a_sharded_checkpoint_folder(tmp_path, compose_cfg):
    """FSDP's sharded checkpoints are folders: `last` and an explicit path accept them."""
    from distill.run.config import problems
    from distill.run.resume import resolve_ckpt_path

    folder = tmp_path / "checkpoints" / "last.ckpt"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"x")
    save = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True)
    assert resolve_ckpt_path("last", [save]) == str(folder)
    assert problems(compose_cfg(f"ckpt_path={folder}")) == []
