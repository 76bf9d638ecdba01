"""linear_divergence (CPU path) at the numerical extremes, against the float64 oracle.

Confident students and teachers (a logit 20-60 above the rest), logits of +-1e4, one-hot
teachers: the regimes where 1 - sum(q_k) cancels, where q_* (G_* - <q, G>) loses the
exp(-gap) it should be, and where log(1 + tiny) rounds to 0. Every kind, live and cached
(both sparse modes), at temperature 1 and 0.7 with the cross-entropy on. Tolerances:
tests/losses/helpers.py (EXTREME_RTOL, EXTREME_LOSS_TOL).
"""

import pytest
import torch

from distill.losses import linear_divergence
from tests.losses.helpers import assert_close_extreme, extreme_inputs, run_both

KINDS = [("forward_kl", {}), ("reverse_kl", {}), ("jsd", {"beta": 0.3})]
REGIMES = [("student", 20.0), ("student", 40.0), ("student", 60.0), ("teacher", 40.0),
           ("both", 40.0), ("both", 60.0), ("opposite", 40.0), ("huge", 0.0),
           ("onehot", 0.0)]
TARGETS = {"live": dict(k=None), "tail": dict(k=5, sparse_mode="tail"),
           "renormalize": dict(k=5, sparse_mode="renormalize")}
SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, ce_weight=0.4)]
# numpy-free, but torch warns nowhere; the oracle takes log(0) in discarded branches
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def check(case, gap, kind, extra, target, backend, v=61, settings=SETTINGS, chunk=5,
          device="cpu"):
    opts = dict(TARGETS[target])
    k = opts.pop("k")
    for setting in settings:
        x = extreme_inputs(case, v=v, gap=gap, k=k, device=device)
        got, ref = run_both(x, lambda **a: linear_divergence(**a, backend=backend),
                            grad_scale=0.5, kind=kind, chunk_size=chunk, **opts, **setting,
                            **extra)
        assert_close_extreme(got, ref, x, torch.float32,
                             setting.get("temperature", 1.0))


@pytest.mark.parametrize("case,gap", REGIMES)
@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("target", list(TARGETS))
def test_extremes_match_the_oracle(case, gap, kind, extra, target):
    check(case, gap, kind, extra, target, "torch")


@pytest.mark.parametrize("kind,extra", [("forward_kl", {}), ("jsd", {"beta": 0.3})])
@pytest.mark.parametrize("target", ["tail", "renormalize"])
def test_one_hot_cached_teacher_with_minus_inf(kind, extra, target):
    """Cached log-probs 0 and -inf (exact zeros). Reverse KL is infinite there by
    definition (q > 0 where p = 0); the 'onehot' regime covers it with -1e4."""
    check("onehot_inf", 0.0, kind, extra, target, "torch")


def test_reverse_kl_against_zero_probability_is_infinite_in_both():
    x = extreme_inputs("onehot_inf", k=5)
    got, ref = run_both(x, linear_divergence, kind="reverse_kl", sparse_mode="renormalize")
    assert got[0] == ref[0] == float("inf")
