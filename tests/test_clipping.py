"""Gradient clipping by norm: through the FSDP-wrapped model under FSDP, Lightning's elsewhere."""

from types import SimpleNamespace

from lightning.pytorch.strategies import FSDPStrategy

from distill.module import DistillModule


class _FakeFSDP(FSDPStrategy):  # routing only: no process group, no GPU
    def __init__(self, wrapped):
        self._wrapped = wrapped

    @property
    def model(self):
        return self._wrapped


def _module(strategy, calls):
    return SimpleNamespace(trainer=SimpleNamespace(strategy=strategy),
                           clip_gradients=lambda *a: calls.append(("lightning", *a)))


def test_fsdp_clips_through_the_wrapped_model_other_strategies_through_lightning():
    calls = []
    wrapped = SimpleNamespace(clip_grad_norm_=lambda v: calls.append(("fsdp", v)))
    clip = DistillModule.configure_gradient_clipping
    clip(_module(_FakeFSDP(wrapped), calls), "opt", 1.0, "norm")
    clip(_module(_FakeFSDP(wrapped), calls), "opt", 0.5, None)
    clip(_module(_FakeFSDP(wrapped), calls), "opt", None, None)  # clipping off
    clip(_module(SimpleNamespace(), calls), "opt", 1.0, "norm")  # DDP, one device...
    assert calls == [("fsdp", 1.0), ("fsdp", 0.5), ("lightning", "opt", None, None),
                     ("lightning", "opt", 1.0, "norm")]
