"""The GPU presets keep the student's small updates: fp32 master weights under bf16-mixed.

AdamW's update at lr 1e-5 is about 1e-5 per weight; a bf16 weight of 0.02 has a spacing
of 2**-14 (6e-5) near it, so the update rounds away. The composed GPU configuration must
keep the trainable student's weights in a dtype where it does not.
"""

import pytest
import torch

from distill.models.causal_lm import trainable_dtype
from tests.fixtures import student_from


def moved_fraction(dtype: torch.dtype, steps: int = 10, lr: float = 1e-5) -> float:
    """Fraction of weights of scale 0.02 that AdamW at `lr` moves at all in `steps` steps."""
    start = torch.randn(4096, dtype=torch.float64) * 0.02
    weight = torch.nn.Parameter(start.to(dtype))
    opt = torch.optim.AdamW([weight], lr=lr, weight_decay=0.0)
    for _ in range(steps):
        weight.grad = torch.randn_like(weight)
        opt.step()
    return (weight.detach() != start.to(dtype)).double().mean().item()


@pytest.mark.parametrize("preset", ["gpu", "ddp"], ids=["one_gpu", "ddp"])
def test_default_gpu_config_keeps_small_updates(compose_cfg, tiny_assets, preset):
    cfg = compose_cfg("student=hf", "teacher=hf", f"trainer={preset}",
                      f"student.name_or_path={tiny_assets['student']}",
                      f"teacher.name_or_path={tiny_assets['teacher']}")
    dtype = trainable_dtype(cfg.student.dtype, cfg.trainer.precision)
    assert dtype == torch.float32
    student = student_from(cfg)  # what the composed config really loads
    assert {p.dtype for p in student.parameters() if p.requires_grad} == {dtype}
    assert moved_fraction(dtype) > 0.99
    assert cfg.teacher.dtype == "bfloat16"  # the frozen teacher is bf16 on GPUs


def test_bf16_weights_lose_small_updates():
    # the same check fails for bf16 weights: this is what it guards against
    assert moved_fraction(torch.bfloat16) < 0.5


def test_bf16_true_preset_is_explicitly_lossy(compose_cfg, tiny_assets):
    cfg = compose_cfg("student=hf", "teacher=hf", "trainer=gpu_bf16_true",
                      f"student.name_or_path={tiny_assets['student']}",
                      f"teacher.name_or_path={tiny_assets['teacher']}")
    # Lightning converts the module whatever dtype the student was loaded in
    assert trainable_dtype(cfg.student.dtype, cfg.trainer.precision) == torch.bfloat16
    assert trainable_dtype("float32", "bf16-mixed") == torch.float32
    assert trainable_dtype("bfloat16", "bf16-mixed") == torch.bfloat16
    assert trainable_dtype("float32", "64-true") == torch.float64


@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
def test_loss_under_autocast_keeps_fp32_logits(kind):
    """bf16-mixed runs the loss inside autocast with fp32 master weights: its GEMMs take
    bf16 operands (as autocast would) but the logits and everything after stay fp32."""
    from distill.losses import linear_divergence
    from tests.oracle import assert_rows_close, divergence

    n, v = 37, 1271
    hs = torch.randn(n, 48, requires_grad=True)
    ws = (torch.randn(v, 48) * 0.5).requires_grad_()
    ht, wt = torch.randn(n, 64).bfloat16(), torch.randn(v, 64).bfloat16()  # a bf16 teacher
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_divergence(hs, ws, teacher_hidden=ht, teacher_weight=wt, kind=kind)
    loss.backward()
    assert loss.dtype == torch.float32 and ws.grad.dtype == torch.float32

    # float64 reference on the bf16-rounded operands, logits never rounded
    h64 = hs.detach().bfloat16().double().requires_grad_()
    w64 = ws.detach().bfloat16().double().requires_grad_()
    logq = torch.log_softmax(h64 @ w64.T, -1)
    logp = torch.log_softmax(ht.double() @ wt.double().T, -1)
    ref = divergence(logp, logq, kind).mean()
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=2e-5, atol=1e-6)
    # the gradients come back through the bf16 operands (as autocast's own GEMMs would
    # give them): within one bf16 rounding (2**-8 relative) of the reference
    for got, want in ((hs.grad, h64.grad), (ws.grad, w64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-7)
        assert (got.double() - want).abs().max() < 2**-8 * want.abs().max()
        assert_rows_close(got, want, 2**-8, 1e-7)  # each position, each vocab row


def test_a_16_bit_student_under_mixed_precision_is_warned(compose_cfg, tiny_assets):
    import warnings

    from distill.train import train
    from distill.training.callbacks.precision_check import half_trainable

    base = ["student=hf", "teacher=hf", f"student.name_or_path={tiny_assets['student']}",
            f"teacher.name_or_path={tiny_assets['teacher']}", "trainer.precision=bf16-mixed",
            "trainer.max_steps=1", "callbacks.export=null", "callbacks.checkpoint=null"]
    with pytest.warns(UserWarning, match=r"trainable weights are 16-bit .* under precision "
                                         r"bf16-mixed.*student.dtype=float32"):
        train(compose_cfg(*base, "student.dtype=bfloat16"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(compose_cfg(*base))  # student=hf's float32: fp32 master weights, no warning
    assert not [w for w in seen if "trainable weights are 16-bit" in str(w.message)]
    # a frozen bf16 base with fp32 adapters (LoRA) trains fp32 weights only
    frozen = torch.nn.Linear(4, 4).bfloat16().requires_grad_(False)
    adapter = torch.nn.Linear(4, 2)
    assert half_trainable(torch.nn.Sequential(frozen, adapter)) == {}
    assert half_trainable(torch.nn.Linear(4, 4).bfloat16()) == {torch.bfloat16: 20}
