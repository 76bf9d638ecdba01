"""On-policy steps keep the normalization exact: the counter samples the whole window, then
counts it, then trains it. With seeded sampling, K micro-batches give exactly the float64
gradient of the rolled-out window computed in one pass, one batch of 4B rows gives the
gradient of 4 micro-batches of B, and a resumed run samples and trains the same steps."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from distill.data import DistillDataModule
from distill.models.causal_lm import load_tokenizer
from distill.onpolicy.rollout import rollout, window_seed
from distill.training.module import DistillModule
from tests.callbacks import proof
from tests.fixtures import child_env

ON_POLICY = {"fraction": 0.5, "temperature": 1.0, "max_new_tokens": 5, "seed": 3}


@pytest.fixture(scope="module")
def assets(tiny_assets) -> str:
    return str(tiny_assets["student"].parent)


def _module(assets: str, lr: float = 0.0, policy: str = "valid_tokens") -> DistillModule:
    student, teacher = proof.models(assets)
    student = copy.deepcopy(student)
    return DistillModule(student, teacher, loss={**proof.LOSS, "normalization": policy,
                                                 "on_policy": ON_POLICY},
                         optimizer=functools.partial(torch.optim.SGD, lr=lr),
                         vocab_size=student.config.vocab_size)


def _rolled(module: DistillModule, window: list[dict], step: int) -> list[dict]:
    """The window as the fit rolls it out (same weights: SGD with lr=0)."""
    seed = window_seed(ON_POLICY["seed"], 0, step, 0)
    op = module.onpolicy
    out, _ = rollout(window, op.cfg, seed, op.pad, op.eos, op._sampler("student", "cpu"),
                     module.student)
    return out


def _reference(assets: str, step: list[dict], policy: str) -> dict:
    """float64 gradient of the rolled-out step in one pass: sampled rows are trained on the
    divergence alone, the dataset's rows on divergence + ce_weight * CE."""
    student, s, t = proof.float64_models(assets)
    ids, attn, labels, micro = proof.padded_step(step)
    sampled = torch.cat([b["sampled"] for b in step])
    v = student.config.vocab_size
    zs = proof.model_logits(s, ids, attn, v).flatten(0, 1)
    with torch.no_grad():
        zt = proof.model_logits(t, ids, attn, v).flatten(0, 1)
    target = labels[:, 1:]
    on = sampled[:, None].expand_as(target).flatten()
    ce = torch.where(on, 0.0, proof.LOSS["ce_weight"]).double()
    per_token = proof.per_token_loss(zs, zt, target.flatten(), ce=ce)
    valid = (target != -100) & attn[:, 1:].bool()
    real = attn[:, 1:].bool() & attn[:, :-1].bool()
    w = proof.policy_weights(policy, valid, real, micro, len(step)).flatten()
    params = dict(s.named_parameters())
    grads = torch.autograd.grad((w * per_token).sum(), list(params.values()), allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), grads)}


@pytest.mark.parametrize("k,policy", [(1, "valid_tokens"), (4, "valid_tokens"),
                                      (3, "sequence_mean")])
def test_on_policy_step_is_the_one_pass_gradient_of_the_rolled_out_window(assets, k, policy):
    batches = proof.micro_batches(0, proof.models(assets)[0].config.vocab_size)
    module = _module(assets, policy=policy)
    got = proof.fit_grads(module, batches, k)
    windows = proof.windows(proof.N_MICRO, k)
    assert len(got) == len(windows)
    kinds = set()
    for i, window in enumerate(windows):
        step = _rolled(module, [batches[j] for j in window], i)
        kinds |= {bool(x) for b in step for x in b["sampled"]}
        proof.assert_grads_match(got[i], _reference(assets, step, policy))
    assert kinds == {True, False}  # both sampled and dataset rows were trained


def _equal_width_batches(vocab: int, n: int, rows: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    return [proof._batch("sft", rows, 18, vocab, g) for _ in range(n)]


def test_one_batch_of_4b_rows_equals_four_micro_batches_of_b(assets):
    vocab = proof.models(assets)[0].config.vocab_size
    parts = _equal_width_batches(vocab, 4, 2)
    whole = {key: torch.cat([b[key] for b in parts]) for key in parts[0]}
    split = proof.fit_grads(_module(assets), parts, 4)
    joined = proof.fit_grads(_module(assets), [whole], 1)
    assert len(split) == len(joined) == 1
    proof.assert_grads_match(split[0], {n: g.double() for n, g in joined[0].items()})
    assert any(g.abs().sum() > 0 for g in split[0].values())


def _datamodule(tiny_assets) -> DistillDataModule:
    tokenizer = load_tokenizer(str(tiny_assets["student"]))
    return DistillDataModule(tokenizer, batch_size=4, max_length=64,
                             train=[{"kind": "sft", "path": tiny_assets["sft_train"]}])


def _fit(assets, tiny_assets, ckpt_dir, ckpt_path=None):
    """K=2 with real training (lr 0.5): the samples of later steps depend on the weights."""
    capture = proof.GradCapture()
    save = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)
    trainer = proof.trainer(2, callbacks=[capture, save], max_epochs=-1, max_steps=4,
                            enable_checkpointing=True)
    trainer.fit(_module(assets, lr=0.5), datamodule=_datamodule(tiny_assets),
                ckpt_path=ckpt_path)
    return capture.steps


def test_resumed_on_policy_run_samples_and_trains_the_same_steps(assets, tiny_assets,
                                                                 tmp_path):
    steps = _fit(assets, tiny_assets, tmp_path / "a")
    ckpt = next((tmp_path / "a").glob("epoch=*-step=2.ckpt"))
    resumed = _fit(assets, tiny_assets, tmp_path / "b", ckpt_path=str(ckpt))
    assert len(resumed) == 2
    for got, want in zip(resumed, steps[2:]):
        proof.assert_grads_match(got, {n: g.double() for n, g in want.items()}, rtol=1e-6)


@pytest.mark.slow  # >10 s on a 2-core CPU (make test runs it)
def test_ddp_on_policy_step_is_the_one_pass_gradient_of_both_ranks_windows(assets, tmp_path):
    """K=3 on W=2 ranks: each rank rolls out its own window (its own seed), the counts are
    summed over the ranks after sampling, and the step is the one-pass gradient of both."""
    import subprocess
    import sys
    from pathlib import Path

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "grads.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(root / "tests/callbacks/onpolicy_ddp_worker.py"), assets, str(out)]
    env = child_env()
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    got = torch.load(out)
    vocab = proof.models(assets)[0].config.vocab_size
    per_rank = [proof.micro_batches(r, vocab) for r in range(2)]
    module = _module(assets)
    windows = proof.windows(proof.N_MICRO, 3)
    assert len(got) == len(windows)
    for i, window in enumerate(windows):
        step = []
        for rank, batches in enumerate(per_rank):
            seed = window_seed(ON_POLICY["seed"], 0, i, rank)
            op = module.onpolicy
            rolled, _ = rollout([batches[j] for j in window], op.cfg, seed, op.pad, op.eos,
                                op._sampler("student", "cpu"), module.student)
            step += rolled
        proof.assert_grads_match(got[i], _reference(assets, step, "valid_tokens"))
