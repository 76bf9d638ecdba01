"""The Triton row kernels at the numerical extremes, against the float64 oracle.

On CPU the kernels run in Triton's interpreter (fp32, small vocabularies, two blocks per
row so the running largest-logit bookkeeping crosses blocks); on the GPU, bf16 and fp32 at
the shapes of the reported failure (a student 40 above the rest, a random teacher: forward
KL was inf, reverse KL / JSD gradients 80-97% off, V/K = 64/4, 32000/16, 128256/64) and
every regime of tests/losses/test_extremes.py at V = 32000. Every CPU case runs both ways
of finding the largest logit (`Tuning.row_fixup`), and ties of it are checked apart.
Tolerances: tests/losses/helpers.py (EXTREME_RTOL, EXTREME_LOSS_TOL).
"""

import pytest
import torch

from distill.losses import linear_divergence
from distill.ops.chunked import Tuning
from tests.losses.helpers import assert_close_extreme, extreme_inputs, run_both
from tests.losses.test_extremes import KINDS, REGIMES, TARGETS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
# interpreter time is scarce: each regime once, at one setting
CPU_REGIMES = [("student", 40.0, dict(temperature=1.0)),
               ("both", 60.0, dict(temperature=0.7, ce_weight=0.4)),
               ("opposite", 20.0, dict(temperature=1.0, ce_weight=0.4)),
               ("huge", 0.0, dict(temperature=0.7)),
               ("onehot", 0.0, dict(temperature=1.0))]


FIXUPS = ["lane", "block"]
BLOCK = 32  # the interpreter's row block: V = 61 is two blocks, the second one partial


@pytest.fixture(params=FIXUPS)
def tuning(request, triton_kernels, monkeypatch):
    """The op's knobs with each row fixup in turn (small row blocks in the interpreter)."""
    if not torch.cuda.is_available():
        monkeypatch.setitem(triton_kernels.CONFIG, "live", (BLOCK, 4))
        monkeypatch.setitem(triton_kernels.CONFIG, "sparse", (BLOCK, 4))
    # the same blocks on a GPU: the tie layouts below (one lane of two blocks, two lanes of
    # one block) depend on them
    return Tuning(row_fixup=request.param, row_config=(BLOCK, 4))


def _check(x, target, tuning, setting, kind, extra):
    opts = dict(TARGETS[target])
    opts.pop("k")
    got, ref = run_both(x, linear_divergence, grad_scale=0.5, kind=kind, chunk_size=5,
                        backend="triton", tuning=tuning, **opts, **setting, **extra)
    assert_close_extreme(got, ref, x, torch.float32, setting.get("temperature", 1.0))


@pytest.mark.parametrize("case,gap,setting", CPU_REGIMES)
@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("target", list(TARGETS))
def test_kernels_at_the_extremes(tuning, case, gap, setting, kind, extra, target):
    k = TARGETS[target]["k"]
    _check(extreme_inputs(case, gap=gap, k=k, device=DEVICE), target, tuning, setting, kind,
           extra)


@pytest.mark.parametrize("kind,extra", [("forward_kl", {}), ("jsd", {"beta": 0.3})])
def test_kernels_one_hot_cached_teacher_with_minus_inf(tuning, kind, extra):
    _check(extreme_inputs("onehot_inf", gap=0.0, k=TARGETS["tail"]["k"], device=DEVICE),
           "tail", tuning, dict(ce_weight=0.4), kind, extra)


def tied_inputs(target, gap=40.0, n=12, v=61):
    """extreme_inputs' confident student with its top logit exactly equal at 2 or 3 ids:
    in one lane of two blocks, in two lanes of one block, or both (BLOCK apart, adjacent).
    Every other row the teacher favours the first tied id, which is then a cached id (a
    tie between a cached id and the tail)."""
    x = extreme_inputs("student", n=n, v=v, gap=gap, k=None if target == "live" else 5)
    zs = x["student_weight"].T.clone()  # (n, v): row i's logits
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    j = torch.randint(0, v - BLOCK - 1, (n,), generator=g)
    top = zs.max(-1).values + gap
    for i in range(n):
        tied = [[j[i], j[i] + BLOCK], [j[i], j[i] + 1], [j[i], j[i] + 1, j[i] + BLOCK]][i % 3]
        zs[i, tied] = top[i]
    x["student_weight"] = zs.T.contiguous()
    if target == "live":
        zt = x["teacher_weight"].T.clone()
        zt[::2] = zt[::2].scatter(-1, j[::2, None], zt[::2].max(-1, keepdim=True).values + 4)
        x["teacher_weight"] = zt.T.contiguous()
    else:  # the first tied id among the cached ones, with the smallest cached log-prob
        for i in range(0, n, 2):
            if not (x["target_ids"][i] == j[i]).any():
                x["target_ids"][i, -1] = j[i]
    return {k: t.to(DEVICE) for k, t in x.items()}


@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.7,
                                                                  ce_weight=0.4)])
@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("target", list(TARGETS))
def test_kernels_tied_largest_logit(tuning, setting, kind, extra, target):
    """One tied entry is written as minus the sum of all the others, the other tied entries
    included (O(1) gradients each: leaving them out of the sum is far off)."""
    _check(tied_inputs(target), target, tuning, setting, kind, extra)


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
