"""The Triton row kernels at the numerical extremes, against the float64 oracle.

On CPU the kernels run in Triton's interpreter (fp32, small vocabularies, two blocks per
row so the running largest-logit bookkeeping crosses blocks); on the GPU, bf16 and fp32 at
the shapes of the reported failure (a student 40 above the rest, a random teacher: forward
KL was inf, reverse KL / JSD gradients 80-97% off, V/K = 64/4, 32000/16, 128256/64) and
every regime of tests/losses/test_extremes.py at V = 32000. Tolerances:
tests/losses/helpers.py (EXTREME_RTOL, EXTREME_LOSS_TOL).
"""

import pytest
import torch

from distill.losses import linear_divergence
from tests.losses.helpers import assert_close_extreme, extreme_inputs, run_both
from tests.losses.test_extremes import KINDS, REGIMES, TARGETS, check

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
# interpreter time is scarce: each regime once, at one setting
CPU_REGIMES = [("student", 40.0, dict(temperature=1.0)),
               ("both", 60.0, dict(temperature=0.7, ce_weight=0.4)),
               ("opposite", 20.0, dict(temperature=1.0, ce_weight=0.4)),
               ("huge", 0.0, dict(temperature=0.7)),
               ("onehot", 0.0, dict(temperature=1.0))]


@pytest.mark.parametrize("case,gap,setting", CPU_REGIMES)
@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("target", list(TARGETS))
def test_kernels_at_the_extremes(triton_kernels, monkeypatch, case, gap, setting, kind, extra,
                                 target):
    if not torch.cuda.is_available():
        monkeypatch.setitem(triton_kernels.CONFIG, "live", (32, 4))
        monkeypatch.setitem(triton_kernels.CONFIG, "sparse", (32, 4))
    check(case, gap, kind, extra, target, "triton", settings=[setting], device=DEVICE)


@pytest.mark.parametrize("kind,extra", [("forward_kl", {}), ("jsd", {"beta": 0.3})])
def test_kernels_one_hot_cached_teacher_with_minus_inf(triton_kernels, kind, extra):
    check("onehot_inf", 0.0, kind, extra, "tail", "triton", settings=[dict(ce_weight=0.4)],
          device=DEVICE)


# --------------------------------------------------------------------------- GPU only

def _gpu_check(case, gap, kind, extra, target, v, k, dtype, settings):
    opts = dict(TARGETS[target])
    opts.pop("k")
    for setting in settings:
        x = extreme_inputs(case, n=64, v=v, gap=gap, k=None if target == "live" else k,
                           dtype=dtype, device="cuda")
        got, ref = run_both(x, linear_divergence, grad_scale=0.5, kind=kind, chunk_size=24,
                            **opts, **setting, **extra)
        assert_close_extreme(got, ref, x, dtype, setting.get("temperature", 1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("v,k", [(64, 4), (32000, 16), (128256, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("target", list(TARGETS))
def test_gpu_reported_confident_student(v, k, dtype, kind, extra, target):
    _gpu_check("student", 40.0, kind, extra, target, v, k, dtype,
               [dict(temperature=1.0), dict(temperature=0.7, ce_weight=0.4)])


@pytest.mark.gpu
@pytest.mark.parametrize("case,gap", REGIMES + [("onehot_inf", 0.0)])
@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("target", list(TARGETS))
def test_gpu_every_regime(case, gap, kind, extra, target):
    """bf16, the training dtype (fp32 is covered above and by the interpreter)."""
    if case == "onehot_inf" and (target == "live" or kind == "reverse_kl"):
        pytest.skip("-inf log-probs are cached only; reverse KL is infinite there")
    _gpu_check(case, gap, kind, extra, target, 32000, 16, torch.bfloat16,
               [dict(temperature=0.7, ce_weight=0.4)])
