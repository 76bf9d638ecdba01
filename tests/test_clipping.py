"""Gradient clipping by norm: through the FSDP-wrapped model under FSDP, by the step's known
norm (the guard's and the logs') elsewhere, else through Lightning."""

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy

from distill.training.module import DistillModule
from distill.training.state import grad_norm


class _FakeFSDP(FSDPStrategy):  # routing only: no process group, no GPU
    def __init__(self, wrapped):
        self._wrapped = wrapped

    @property
    def model(self):
        return self._wrapped


def _module(strategy, calls):
    return SimpleNamespace(trainer=SimpleNamespace(strategy=strategy),
                           clip_gradients=lambda *a: calls.append(("lightning", *a)))


def test_fsdp_clips_through_the_wrapped_model():
    calls = []
    wrapped = SimpleNamespace(clip_grad_norm_=lambda v: calls.append(("fsdp", v)))
    clip = DistillModule.configure_gradient_clipping
    clip(_module(_FakeFSDP(wrapped), calls), "opt", 1.0, "norm")
    clip(_module(_FakeFSDP(wrapped), calls), "opt", 0.5, None)
    clip(_module(_FakeFSDP(wrapped), calls), "opt", None, None)  # clipping off
    assert calls == [("fsdp", 1.0), ("fsdp", 0.5), ("lightning", "opt", None, None)]


def _grads():
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (7, 300, 1)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 10
    return params


def test_the_steps_known_norm_clips_as_torchs_clip_grad_norm():
    ours, theirs = _grads(), _grads()
    opt = torch.optim.SGD(ours, lr=0.1)
    norm = grad_norm(opt, SimpleNamespace())
    module = SimpleNamespace(trainer=SimpleNamespace(strategy=SimpleNamespace()),
                             sums=SimpleNamespace(grad_norm=(norm,)),
                             clip_gradients=lambda *a: pytest.fail("clipped twice"))
    DistillModule.configure_gradient_clipping(module, opt, 1.5, "norm")
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.5)
    assert float(norm) == pytest.approx(float(want))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_the_known_norm_is_the_one_used_and_small_gradients_stay():
    params = _grads()
    before = [p.grad.clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.1)
    module = SimpleNamespace(trainer=SimpleNamespace(strategy=SimpleNamespace()),
                             sums=SimpleNamespace(grad_norm=(torch.tensor(4.0),)),
                             clip_gradients=lambda *a: pytest.fail("clipped twice"))
    DistillModule.configure_gradient_clipping(module, opt, 1.0, None)
    for p, b in zip(params, before):  # scaled by 1 / (4 + 1e-6), whatever the true norm is
        torch.testing.assert_close(p.grad, b / (4.0 + 1e-6), rtol=1e-6, atol=0)
    module.sums.grad_norm = (torch.tensor(0.5),)  # under the limit: untouched
    DistillModule.configure_gradient_clipping(module, opt, 1.0, "norm")
    for p, b in zip(params, before):
        torch.testing.assert_close(p.grad, b / (4.0 + 1e-6), rtol=1e-6, atol=0)


def test_a_norm_not_yet_taken_is_taken_once_and_kept_for_the_step(monkeypatch):
    import distill.training.state

    params, theirs = _grads(), _grads()
    opt = torch.optim.SGD(params, lr=0.1)
    module = SimpleNamespace(trainer=SimpleNamespace(strategy=SimpleNamespace()),
                             sums=SimpleNamespace(grad_norm=None),
                             clip_gradients=lambda *a: pytest.fail("clipped twice"))
    taken, take = [], distill.training.state.grad_norm
    monkeypatch.setattr(distill.training.state, "grad_norm", lambda *a: taken.append(1) or take(*a))
    DistillModule.configure_gradient_clipping(module, opt, 1.5, "norm")
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.5)
    assert float(module.sums.grad_norm[0]) == pytest.approx(float(want))  # for the step's logs
    norm = distill.training.state.step_grad_norm(module.trainer, module, opt)
    assert norm is module.sums.grad_norm[0]
    assert taken == [1]
    for a, b in zip(params, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_value_clipping_or_a_grad_scaler_goes_through_lightning():
    calls = []
    scaler = SimpleNamespace(precision_plugin=SimpleNamespace(scaler=object()))
    for trainer, algorithm in ((SimpleNamespace(), "value"), (scaler, "norm"),
                               (scaler, None)):
        trainer.strategy = SimpleNamespace()
        module = SimpleNamespace(trainer=trainer, sums=SimpleNamespace(grad_norm=(2.0,)),
                                 clip_gradients=lambda *a: calls.append(a))
        DistillModule.configure_gradient_clipping(module, "opt", 1.0, algorithm)
    assert calls == [("opt", 1.0, "value"), ("opt", 1.0, "norm"), ("opt", 1.0, None)]


def _fit_weights(compose_cfg, out, monkeypatch, *overrides, lightning=False):
    """A 3-step run clipping hard (every step's norm is far above 1e-3): the student's
    weights, and how often torch's clip_grad_norm_ (Lightning's clipping) ran. `lightning`:
    the module's clipping hook is Lightning's own (the reference)."""
    import lightning as L
    from safetensors.torch import load_file

    from distill.train import train

    calls, clip = [], torch.nn.utils.clip_grad_norm_
    with monkeypatch.context() as m:
        m.setattr(torch.nn.utils, "clip_grad_norm_",
                  lambda *a, **kw: calls.append(1) or clip(*a, **kw))
        if lightning:
            m.setattr(DistillModule, "configure_gradient_clipping",
                      L.LightningModule.configure_gradient_clipping)
        train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=3",
                          "trainer.gradient_clip_val=0.001", *overrides, out=out))
    return load_file(out / "student" / "model.safetensors"), len(calls)


def _assert_same(ours: dict, theirs: dict, rtol: float, atol: float) -> None:
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=rtol, atol=atol, msg=name)


def test_a_run_clips_by_the_steps_known_norm_exactly_as_lightning_would(
        compose_cfg, tmp_path, monkeypatch):
    theirs, calls = _fit_weights(compose_cfg, tmp_path / "lightning", monkeypatch,
                                 lightning=True)
    known, known_calls = _fit_weights(compose_cfg, tmp_path / "known", monkeypatch)
    # no callback took the norm: the clipping takes it itself
    alone, alone_calls = _fit_weights(compose_cfg, tmp_path / "alone", monkeypatch,
                                      "callbacks.step_logs=null", "callbacks.guard=null")
    with monkeypatch.context() as m:  # torch < 2.6: no clip_grads_with_norm_
        m.delattr(torch.nn.utils, "clip_grads_with_norm_")
        old, old_calls = _fit_weights(compose_cfg, tmp_path / "old", m)
    assert calls == 3 and known_calls == alone_calls == old_calls == 0  # no second pass
    for ours in (known, alone, old):
        _assert_same(ours, theirs, rtol=1e-6, atol=1e-9)


def test_a_fp64_run_clips_as_lightning_would(compose_cfg, tmp_path, monkeypatch):
    """trainer.precision=64-true: the norm is taken in fp64 (torch refuses to narrow fp64
    gradients into an fp32 norm)."""
    fp64 = ("trainer.precision=64-true",)
    ours, _ = _fit_weights(compose_cfg, tmp_path / "ours", monkeypatch, *fp64)
    theirs, _ = _fit_weights(compose_cfg, tmp_path / "lightning", monkeypatch, *fp64,
                             lightning=True)
    _assert_same(ours, theirs, rtol=1e-12, atol=1e-15)


def test_a_fused_adamw_clips_under_bf16_mixed(compose_cfg, tmp_path, monkeypatch):
    """Lightning's AMP plugin would stop this run at its first step (it refuses to clip for a
    fused optimizer); with no GradScaler to fear, the clipping by norm runs without it, and
    the weights are those of torch's foreach AdamW clipped by Lightning."""
    bf16 = ("trainer.precision=bf16-mixed",)
    fused, calls = _fit_weights(compose_cfg, tmp_path / "fused", monkeypatch, *bf16,
                                "+optimizer.fused=true", "callbacks.step_logs=null",
                                "callbacks.guard=null")  # and no callback took the norm
    foreach, lightning_calls = _fit_weights(compose_cfg, tmp_path / "foreach", monkeypatch,
                                            *bf16, lightning=True)
    assert calls == 0 and lightning_calls == 3
    _assert_same(fused, foreach, rtol=1e-5, atol=1e-7)


def test_each_closure_run_takes_the_norm_of_its_own_gradients(compose_cfg, tmp_path,
                                                               monkeypatch):
    """LBFGS runs the step's closure (forward, backward, Lightning's clipping) several
    times; each run clips by the norm of the gradients it just made, not the first run's."""
    import distill.training.state
    from distill.train import train

    norms, take = [], distill.training.state.grad_norm
    monkeypatch.setattr(distill.training.state, "grad_norm",
                        lambda *a: norms.append(take(*a)) or norms[-1])
    runs, step = [], DistillModule.training_step
    monkeypatch.setattr(DistillModule, "training_step",
                        lambda self, *a: runs.append(1) or step(self, *a))
    # no scheduler (the default one's lr is 0 at the first step) and a limit above every
    # norm: the weights move, so each run's gradients differ
    train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=1", "optimizer=sgd",
                      "optimizer._target_=torch.optim.LBFGS", "optimizer.lr=0.5",
                      "+optimizer.max_iter=3", "trainer.gradient_clip_val=1000",
                      "scheduler=none", "callbacks.export=null", out=tmp_path / "lbfgs"))
    assert len(runs) >= 2 and len(norms) == len(runs), (runs, norms)
    assert len({float(n) for n in norms}) == len(norms), norms
