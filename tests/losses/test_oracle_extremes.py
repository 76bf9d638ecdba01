"""The float64 oracle (tests/oracle.py) itself at the extremes: two categories, where the
divergences and their derivatives have closed forms computed here without any softmax."""

import math

import pytest
import torch

from tests.oracle import TAIL_FLOOR, oracle_per_token

BETA = 0.3


def _closed_form(x, lp1, lp2, kind):
    """Loss and d loss / d x for student logits (x, 0) and teacher log-probs (lp1, lp2).

    With q1 = sigmoid(x): dq1/dx = q1 q2, and every divergence has dD/dx = q1 q2 (G1 - G2)
    for its G = dD/dq (forward KL's q1 - p1 is written p2 - q2: no 1 - 1 at large x)."""
    x = torch.tensor(x, dtype=torch.float64)
    lq1, lq2 = -torch.log1p(torch.exp(-x)), -x - torch.log1p(torch.exp(-x))
    q1, q2, p1, p2 = lq1.exp(), lq2.exp(), math.exp(lp1), math.exp(lp2)
    q12 = torch.sigmoid(x) * torch.sigmoid(-x)
    if kind == "forward_kl":
        return p1 * (lp1 - lq1) + p2 * (lp2 - lq2), p2 - q2
    if kind == "reverse_kl":
        return q1 * (lq1 - lp1) + q2 * (lq2 - lp2), q12 * ((lq1 - lq2) - (lp1 - lp2))
    lm1 = torch.logaddexp(torch.tensor(lp1 + math.log(BETA), dtype=x.dtype),
                          lq1 + math.log(1 - BETA))
    lm2 = torch.logaddexp(torch.tensor(lp2 + math.log(BETA), dtype=x.dtype),
                          lq2 + math.log(1 - BETA))
    loss = BETA * (p1 * (lp1 - lm1) + p2 * (lp2 - lm2)) + (1 - BETA) * (
        q1 * (lq1 - lm1) + q2 * (lq2 - lm2))
    return loss, q12 * (1 - BETA) * ((lq1 - lm1) - (lq2 - lm2))


def _teacher(y):
    """log-probs of teacher logits (y, 0), exact: -log1p(exp(-y)) and -y - log1p(exp(-y))."""
    return -math.log1p(math.exp(-y)), -y - math.log1p(math.exp(-y))


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("gap", [20.0, 40.0, 60.0])
@pytest.mark.parametrize("teacher", ["same", "opposite", "flat"])
@pytest.mark.parametrize("cached", [False, True])
def test_oracle_is_exact_for_two_categories(kind, gap, teacher, cached):
    """Confident student (gap 20-60) against a teacher confident on the same category, on
    the other, or nearly flat; live (V = 2) and cached (K = 1: the tail is the other
    category). The loss and the gradient match the closed form to 1e-12 relative, though
    the gradient is as small as exp(-60) ~ 1e-26."""
    y = {"same": gap - 3.0, "opposite": -gap, "flat": 0.3}[teacher]
    lp1, lp2 = _teacher(y)
    if cached and kind == "reverse_kl":  # the contract floors the teacher's tail bucket
        lp2 = max(lp2, math.log(TAIL_FLOOR))
    want_loss, want_grad = _closed_form(gap, lp1, lp2, kind)
    z = torch.tensor([[gap, 0.0]], dtype=torch.float64, requires_grad=True)
    if cached:
        loss, _ = oracle_per_token(z, target_ids=torch.tensor([[0]]),
                                   target_logprobs=torch.tensor([[lp1]], dtype=torch.float64),
                                   kind=kind, beta=BETA)
    else:
        loss, _ = oracle_per_token(z, torch.tensor([[y, 0.0]], dtype=torch.float64), kind=kind,
                                   beta=BETA)
    loss.sum().backward()
    torch.testing.assert_close(loss[0], want_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(z.grad[0, 0], want_grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(z.grad[0, 1], -want_grad, rtol=1e-12, atol=0)
