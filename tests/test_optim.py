"""The fine-tuning optimizer leaves norms and biases undecayed; the schedule warms up."""

import pytest
import torch

from distill.training.optim import adamw, cosine_with_warmup, decay_groups


def test_norms_and_biases_are_not_decayed():
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5),
                                torch.nn.Embedding(7, 5))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = adamw(model.parameters(), lr=0.1, weight_decay=0.5, betas=[0.9, 0.95])
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the Adam step is zero: only the decay moves weights
    opt.step()
    for name, p in model.named_parameters():
        factor = 1.0 if p.ndim == 1 else 1 - 0.1 * 0.5
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=0, atol=1e-7)
    assert sorted(len(g["params"]) for g in opt.param_groups) == [2, 3]  # 2 matrices, 3 vectors
    assert {g["weight_decay"] for g in opt.param_groups} == {0.0, 0.5}


def test_decay_groups_edges():
    vector = torch.zeros(3)
    groups = decay_groups([vector], 0.1)  # no empty group for the optimizer to carry
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.0
    assert groups[0]["params"][0] is vector
    with pytest.raises(ValueError, match="takes tensors"):
        decay_groups([{"params": [torch.zeros(2, 2)]}], 0.1)
    with pytest.raises(ValueError, match="optimizer.lr=0.0: must be a finite number > 0"):
        adamw([torch.nn.Parameter(torch.zeros(2))], lr=0.0)


def test_warmup_then_cosine():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = cosine_with_warmup(opt, num_training_steps=100, warmup_ratio=0.1)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(1.0) and lrs[10] == pytest.approx(2.0)
    assert lrs[55] == pytest.approx(1.0, rel=1e-6) and lrs[-1] < 1e-3
    tiny = cosine_with_warmup(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
                              num_training_steps=3, warmup_ratio=0.03)
    assert tiny.get_last_lr() == [0.0]  # one warmup step at least, even for 3 steps
    with pytest.raises(ValueError, match=r"warmup_ratio=1.0: must be a number in \[0, 1\)"):
        cosine_with_warmup(opt, num_training_steps=10, warmup_ratio=1.0)
    with pytest.raises(ValueError, match="set trainer.max_steps"):
        cosine_with_warmup(opt, num_training_steps=float("inf"))


def test_the_fused_kernel_is_the_default_on_cuda_parameters_only():
    from types import SimpleNamespace

    from distill.training.optim import fused_by_default

    def param(cuda, floating=True):
        return SimpleNamespace(is_cuda=cuda, is_floating_point=lambda: floating)

    assert fused_by_default([param(True), param(True)]) is True
    assert fused_by_default([param(True), param(False)]) is None  # one on the CPU
    assert fused_by_default([param(True, floating=False)]) is None
    assert fused_by_default([]) is None
    opt = adamw([torch.nn.Parameter(torch.ones(2, 2))], lr=0.1)
    assert not opt.defaults["fused"]  # CPU: torch's default (foreach / for-loop)
    opt = adamw([torch.nn.Parameter(torch.ones(2, 2))], lr=0.1, fused=False)
    assert opt.defaults["fused"] is False


@pytest.mark.gpu
def test_adamw_on_cuda_parameters_is_fused():
    p = torch.nn.Parameter(torch.ones(4, 4, device="cuda"))
    assert adamw([p], lr=0.1).defaults["fused"] is True


@pytest.mark.parametrize("overrides,fused", [
    # a GradScaler (16-mixed on a GPU) with clipping: fused would unscale after the clipping
    (["trainer=gpu", "trainer.precision=16-mixed"], False),
    (["trainer=auto", "trainer.precision=16-mixed"], False),  # auto may find a GPU
    # value clipping under AMP: Lightning's plugin refuses a fused optimizer
    (["trainer=gpu", "+trainer.gradient_clip_algorithm=value"], False),
    # by norm under bf16-mixed, or no clipping: adamw's own default (fused on CUDA)
    (["trainer=gpu"], "default"),
    (["trainer=gpu", "trainer.precision=16-mixed", "trainer.gradient_clip_val=null"], "default"),
    (["trainer=cpu", "trainer.precision=16-mixed"], "default"),  # CPU: no GradScaler
    # set by the user: kept
    (["trainer=gpu", "+optimizer.fused=true"], True),
    (["trainer=gpu", "trainer.precision=16-mixed", "+optimizer.fused=false"], False),
])
def test_the_run_turns_the_fused_kernel_off_where_its_clipping_needs_it(compose_cfg,
                                                                        overrides, fused):
    from omegaconf import OmegaConf

    from distill.run import assemble

    cfg = compose_cfg("+experiment=hf_sft", "paths.data=.", *overrides)
    # (the trainer as the run reads it; parsing would refuse trainer=gpu on a CPU machine)
    factory = assemble.optimizer(cfg.optimizer, OmegaConf.to_container(cfg.trainer, resolve=True))
    assert factory.keywords.get("fused", "default") == fused
