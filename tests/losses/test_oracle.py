"""The oracle (tests/oracle.py) against closed forms worked out by hand.

Logits are chosen so that the tempered softmax gives round probabilities: at T = 2.5,
logits 2.5 * ln(c) give probabilities proportional to c. The expected values below are
the definitions of DESIGN.md evaluated on those numbers, never the output of any code.
"""

import math

import pytest
import torch

from tests.oracle import Head, assert_rows_close, log_softmax, oracle_loss

T = 2.5
LN = math.log
# student q = (1/2, 1/4, 1/4) and teacher p = (1/8, 1/4, 5/8) at T = 2.5
ZS = [T * LN(2), 0.0, 0.0]
ZT = [0.0, T * LN(2), T * LN(5)]
P, Q = (1 / 8, 1 / 4, 5 / 8), (1 / 2, 1 / 4, 1 / 4)
BETA = 0.3
M = tuple(BETA * p + (1 - BETA) * q for p, q in zip(P, Q))  # (0.3875, 0.25, 0.3625)


def kl(a, b):
    return sum(x * LN(x / y) for x, y in zip(a, b) if x > 0)


# The three divergences of (P, Q), each from its definition with the numbers written out.
CLOSED = {
    "forward_kl": 1 / 8 * LN((1 / 8) / (1 / 2)) + 5 / 8 * LN((5 / 8) / (1 / 4)),
    "reverse_kl": 1 / 2 * LN((1 / 2) / (1 / 8)) + 1 / 4 * LN((1 / 4) / (5 / 8)),
    "jsd": 0.3 * (1 / 8 * LN(0.125 / 0.3875) + 5 / 8 * LN(0.625 / 0.3625))
    + 0.7 * (1 / 2 * LN(0.5 / 0.3875) + 1 / 4 * LN(0.25 / 0.3625)),
}


def one_hot_head(*logit_rows):
    """(hidden, weight) whose logits are exactly the given rows: hidden = I, weight = Z.T."""
    z = torch.tensor(logit_rows, dtype=torch.float64)
    return torch.eye(len(z), dtype=torch.float64), z.T.contiguous()


def live(zs_rows, zt_rows, **kw):
    hs, ws = one_hot_head(*zs_rows)
    ht, wt = one_hot_head(*zt_rows)
    return oracle_loss(hs, ws, teacher_hidden=ht, teacher_weight=wt, **kw)


def cached(zs_rows, ids, probs, **kw):
    hs, ws = one_hot_head(*zs_rows)
    lp = torch.tensor(probs, dtype=torch.float64).log()
    return oracle_loss(hs, ws, target_ids=torch.tensor(ids), target_logprobs=lp, **kw)


def close(got, want, rtol=1e-12):
    assert got.item() == pytest.approx(want, rel=rtol, abs=1e-300), (got.item(), want)


def test_the_hand_numbers_agree_with_each_other():
    """The closed forms above are consistent: JSD from its entropy form
    H(m) - beta H(p) - (1 - beta) H(q), and the probabilities sum to one."""
    def h(a):
        return -sum(x * LN(x) for x in a)

    assert sum(P) == sum(Q) == pytest.approx(sum(M)) == pytest.approx(1.0)
    assert CLOSED["jsd"] == pytest.approx(h(M) - BETA * h(P) - (1 - BETA) * h(Q), rel=1e-12)
    assert CLOSED["forward_kl"] == pytest.approx(kl(P, Q), rel=1e-12)
    assert CLOSED["reverse_kl"] == pytest.approx(kl(Q, P), rel=1e-12)


@pytest.mark.parametrize("kind", list(CLOSED))
def test_every_kind_at_temperature_2_5(kind):
    """Temperature divides both logits: at T = 1 the same logits give p ~ (1, 2^2.5, 5^2.5)."""
    close(live([ZS], [ZT], kind=kind, beta=BETA, temperature=T), CLOSED[kind])


@pytest.mark.parametrize("kind", list(CLOSED))
def test_temperature_squared_and_divergence_weight_scale_the_divergence(kind):
    kw = dict(kind=kind, beta=BETA, temperature=T)
    close(live([ZS], [ZT], temperature_squared=True, **kw), 6.25 * CLOSED[kind])
    close(live([ZS], [ZT], temperature_squared=False, **kw), CLOSED[kind])
    close(live([ZS], [ZT], divergence_weight=0.3, **kw), 0.3 * CLOSED[kind])
    close(live([ZS], [ZT], divergence_weight=0.3, temperature_squared=True, **kw),
          0.3 * 6.25 * CLOSED[kind])


def test_cross_entropy_is_of_the_untempered_student():
    """Label 0 of logits (2.5 ln 2, 0, 0): softmax at T = 1 is 2^2.5 / (2^2.5 + 2), so
    CE = ln(1 + 2^-1.5); at T = 2.5 it would be ln 2."""
    labels = torch.tensor([0])
    got = live([ZS], [ZT], labels=labels, ce_weight=0.7, divergence_weight=0.0, temperature=T)
    close(got, 0.7 * LN(1 + 2**-1.5))
    got = live([ZS], [ZT], labels=labels, ce_weight=0.7, temperature=T, temperature_squared=True,
               kind="forward_kl")
    close(got, 6.25 * CLOSED["forward_kl"] + 0.7 * LN(1 + 2**-1.5))


def test_labels_ignore_index_weights_and_components():
    """Three positions, the middle one ignored: CE of label 0 is ln(1 + 2^-1.5), of label 2
    ln(2^2.5 + 2). Without weights: the mean over the two trained ones."""
    ce0, ce2 = LN(1 + 2**-1.5), LN(2**2.5 + 2)
    d = 0.3 * CLOSED["reverse_kl"]
    kw = dict(kind="reverse_kl", temperature=T, divergence_weight=0.3, ce_weight=0.7)
    zs, zt = [ZS, [9.0, -3.0, 1.0], ZS], [ZT, [0.0, 5.0, 2.0], ZT]
    labels = torch.tensor([0, -100, 2])
    close(live(zs, zt, labels=labels, **kw), 0.5 * (d + 0.7 * ce0) + 0.5 * (d + 0.7 * ce2))
    w = torch.tensor([0.2, 5.0, 0.3], dtype=torch.float64)  # the ignored 5.0 counts nothing
    loss, parts = live(zs, zt, labels=labels, weights=w, return_components=True, **kw)
    close(loss, 0.2 * (d + 0.7 * ce0) + 0.3 * (d + 0.7 * ce2))
    close(parts["divergence"], 0.5 * d)
    close(parts["ce"], 0.2 * ce0 + 0.3 * ce2)
    # another ignore_index marks the untrained position
    close(live(zs, zt, labels=torch.tensor([0, 1, 2]), ignore_index=1, **kw),
          0.5 * (d + 0.7 * ce0) + 0.5 * (d + 0.7 * ce2))


def test_every_position_ignored_gives_zero():
    labels = torch.tensor([-100, -100])
    assert live([ZS, ZS], [ZT, ZT], labels=labels, ce_weight=0.5).item() == 0.0


# Cached targets: student logits 2.5 ln (4, 2, 1, 1) give q = (1/2, 1/4, 1/8, 1/8) at
# T = 2.5; the cached log-probs are already at the training temperature (not divided).
ZS4 = [T * LN(4), T * LN(2), 0.0, 0.0]


@pytest.mark.parametrize("kind,want", [
    # ids (1, 0) with p = (1/2, 1/4): teacher buckets (1/2, 1/4, tail 1/4), student
    # (q1, q0, tail) = (1/4, 1/2, 1/4)
    ("forward_kl", 1 / 2 * LN(2) + 1 / 4 * LN(1 / 2)),
    ("reverse_kl", 1 / 4 * LN(1 / 2) + 1 / 2 * LN(2)),
    ("jsd", 0.3 * (1 / 2 * LN(0.5 / 0.325) + 1 / 4 * LN(0.25 / 0.425))
     + 0.7 * (1 / 4 * LN(0.25 / 0.325) + 1 / 2 * LN(0.5 / 0.425))),  # m = (.325, .425, .25)
])
def test_cached_tail_with_two_ids(kind, want):
    close(cached([ZS4], [[1, 0]], [[1 / 2, 1 / 4]], kind=kind, beta=BETA, temperature=T), want)
    close(cached([ZS4], [[1, 0]], [[1 / 2, 1 / 4]], kind=kind, beta=BETA, temperature=T,
                 temperature_squared=True, divergence_weight=0.5), 0.5 * 6.25 * want)


def test_cached_tail_with_one_id():
    """K = 1: id 0 at p = 0.6, the teacher's tail 0.4; the student's (1/2, 1/2)."""
    got = cached([ZS4], [[0]], [[0.6]], kind="forward_kl", temperature=T)
    close(got, 0.6 * LN(0.6 / 0.5) + 0.4 * LN(0.4 / 0.5))


def test_reverse_kl_floors_an_empty_teacher_tail():
    """ids (1, 0) at p = (1/2, 1/2) leave the teacher no tail: reverse KL takes it as 1e-8
    (the student's tail 1/4 against it); forward KL has 0 log 0 = 0 there."""
    args = ([ZS4], [[1, 0]], [[1 / 2, 1 / 2]])
    close(cached(*args, kind="reverse_kl", temperature=T),
          1 / 4 * LN((1 / 4) / (1 / 2)) + 1 / 4 * LN((1 / 4) / 1e-8))
    close(cached(*args, kind="forward_kl", temperature=T), 1 / 2 * LN(2))


@pytest.mark.parametrize("kind", list(CLOSED))
def test_cached_with_every_id_equals_the_dense_closed_form(kind):
    """K = V = 3 in a shuffled order: no tail bucket; the same number as the live teacher."""
    got = cached([ZS], [[2, 0, 1]], [[5 / 8, 1 / 8, 1 / 4]], kind=kind, beta=BETA,
                 temperature=T)
    close(got, CLOSED[kind])
    # a top-k of every id that sums to a little less than one (rounded log-probs) still has
    # no tail: the loss is the sum over the V ids, finite
    s = 1 - 1e-6
    got = cached([ZS], [[2, 0, 1]], [[5 / 8 * s, 1 / 8 * s, 1 / 4 * s]], kind="forward_kl",
                 temperature=T)
    close(got, s * CLOSED["forward_kl"] + s * LN(s))


@pytest.mark.parametrize("kind,want", [
    # ids (2, 0) at p = (0.3, 0.1) -> (3/4, 1/4); the student's (q2, q0) = (1/8, 1/2) -> (1/5, 4/5)
    ("forward_kl", 3 / 4 * LN((3 / 4) / (1 / 5)) + 1 / 4 * LN((1 / 4) / (4 / 5))),
    ("reverse_kl", 1 / 5 * LN((1 / 5) / (3 / 4)) + 4 / 5 * LN((4 / 5) / (1 / 4))),
])
def test_renormalize_mode(kind, want):
    got = cached([ZS4], [[2, 0]], [[0.3, 0.1]], kind=kind, temperature=T,
                 sparse_mode="renormalize")
    close(got, want)


def test_head_bias_scale_softcap_and_vocab_size():
    """logits = cap tanh((h w + b) s / cap). Raw values chosen so that the capped logits are
    exactly ZS (cap atanh(ZS / cap) before the cap); two padding rows past vocab_size carry
    huge logits that would dominate any softmax they entered."""
    cap, s, h = 2.0, 1.5, 2.0
    b = torch.tensor([0.5, 0.3, -0.2, 0.0, 0.0], dtype=torch.float64)
    raw0 = cap * math.atanh(ZS[0] / cap) / s  # = h w0 + b0
    w = torch.tensor([[(raw0 - 0.5) / h], [-0.3 / h], [0.2 / h], [500.0], [-500.0]],
                     dtype=torch.float64)
    ht, wt = one_hot_head(ZT + [800.0, 900.0])
    got = oracle_loss(torch.tensor([[h]], dtype=torch.float64), w, teacher_hidden=ht,
                      teacher_weight=wt, kind="forward_kl", temperature=T, vocab_size=3,
                      student_head=Head(bias=b, scale=s, softcap=cap))
    close(got, CLOSED["forward_kl"])
    # the teacher's head too: scale 2 and a bias that shifts every logit alike
    ht, wt = one_hot_head([z / 2 for z in ZT] + [0.0])
    got = oracle_loss(*one_hot_head(ZS), teacher_hidden=ht, teacher_weight=wt, vocab_size=3,
                      kind="forward_kl", temperature=T,
                      teacher_head=Head(bias=torch.full((4,), 0.7, dtype=torch.float64),
                                        scale=2.0))
    close(got, CLOSED["forward_kl"])


def grads(fn, hidden, weight, scale=1.0):
    """fn(hidden, weight) and its gradients (times `scale`), by autograd."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(hidden, weight)
    (loss * scale).backward()
    return loss.detach(), hidden.grad, weight.grad


def test_gradient_of_forward_kl_is_q_minus_p_over_t():
    """d loss / d z = (q - p) / T = (3/8, 0, -3/8) / 2.5, times T^2 with the option; with
    logits z = h w: d w = h dz, d h = sum_j w_j dz_j."""
    h = torch.tensor([[2.0]], dtype=torch.float64)
    w = torch.tensor(ZS, dtype=torch.float64)[:, None] / 2
    ht, wt = one_hot_head(ZT)
    dz = torch.tensor([3 / 8, 0.0, -3 / 8], dtype=torch.float64) / T
    for squared, factor in ((False, 1.0), (True, 6.25)):
        _, gh, gw = grads(lambda a, b, sq=squared: oracle_loss(
            a, b, teacher_hidden=ht, teacher_weight=wt, kind="forward_kl", temperature=T,
            temperature_squared=sq), h, w, scale=0.37)
        want = 0.37 * factor * dz
        torch.testing.assert_close(gw[:, 0], 2.0 * want, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(gh[0, 0], (w[:, 0] * want).sum(), rtol=1e-12, atol=1e-15)


def test_gradient_of_reverse_kl_and_cross_entropy():
    """Reverse KL: dD/da_j = q_j (ln q_j - ln p_j - D), a = z / T. CE: softmax(z) - onehot
    at T = 1 (softmax of (2.5 ln 2, 0, 0) is (2^2.5, 1, 1) / (2^2.5 + 2))."""
    hs, ws = one_hot_head(ZS)
    ht, wt = one_hot_head(ZT)
    d = CLOSED["reverse_kl"]
    da = torch.tensor([q * (LN(q) - LN(p) - d) for p, q in zip(P, Q)], dtype=torch.float64)
    e = 2**2.5
    dce = torch.tensor([e / (e + 2) - 1, 1 / (e + 2), 1 / (e + 2)], dtype=torch.float64)
    _, _, gw = grads(lambda a, b: oracle_loss(
        a, b, teacher_hidden=ht, teacher_weight=wt, kind="reverse_kl", temperature=T,
        labels=torch.tensor([0]), ce_weight=0.7), hs, ws)
    torch.testing.assert_close(gw[:, 0], da / T + 0.7 * dce, rtol=1e-12, atol=1e-15)


def test_gradient_of_the_tail_is_shared_by_the_ids_outside():
    """Forward KL over (ids 1, 0, tail), p = (1/2, 3/8, 1/8), q = (1/4, 1/2, 1/4): an id
    gets q_j - p_j; a token outside gets q_j (1 - p_tail / q_tail) = 1/8 (1 - 1/2)."""
    hs, ws = one_hot_head(ZS4)
    lp = torch.tensor([[LN(1 / 2), LN(3 / 8)]], dtype=torch.float64)
    _, _, gw = grads(lambda a, b: oracle_loss(
        a, b, target_ids=torch.tensor([[1, 0]]), target_logprobs=lp, kind="forward_kl",
        temperature=T), hs, ws)
    want = torch.tensor([1 / 2 - 3 / 8, 1 / 4 - 1 / 2, 1 / 16, 1 / 16], dtype=torch.float64)
    torch.testing.assert_close(gw[:, 0], want / T, rtol=1e-12, atol=1e-15)


def test_one_hot_cached_teacher_with_minus_inf_log_probs():
    """ids (0, 1) at log-probs (0, -inf), q = (1/2, 1/4, 1/4): forward KL = ln 2 (zero
    probabilities add nothing), and d a = (q_0 - 1, q_1 - 0, q_2 (1 - 0 / q_tail)) =
    (-1/2, 1/4, 1/4), finite."""
    hs, ws = one_hot_head(ZS)
    lp = torch.tensor([[0.0, -math.inf]], dtype=torch.float64)
    loss, _, gw = grads(lambda a, b: oracle_loss(
        a, b, target_ids=torch.tensor([[0, 1]]), target_logprobs=lp, kind="forward_kl",
        temperature=T), hs, ws)
    close(loss, LN(2))
    want = torch.tensor([-1 / 2, 1 / 4, 1 / 4], dtype=torch.float64) / T
    torch.testing.assert_close(gw[:, 0], want, rtol=1e-12, atol=1e-15)


def test_gradient_through_the_softcap():
    """d z_raw = d logit * (1 - tanh^2(z_raw / cap)) (scale 1, no bias)."""
    cap = 3.0
    raw = [2.0, -1.0, 0.5]
    hs, ws = one_hot_head(raw)
    ht, wt = one_hot_head(raw)  # divergence_weight 0: only the CE's gradient is left
    _, _, gw = grads(lambda a, b: oracle_loss(
        a, b, teacher_hidden=ht, teacher_weight=wt, labels=torch.tensor([1]), ce_weight=1.0,
        divergence_weight=0.0, student_head=Head(softcap=cap)), hs, ws)
    capped = [cap * math.tanh(r / cap) for r in raw]
    total = sum(math.exp(c) for c in capped)
    want = [(math.exp(c) / total - (j == 1)) * (1 - math.tanh(r / cap) ** 2)
            for j, (c, r) in enumerate(zip(capped, raw))]
    torch.testing.assert_close(gw[:, 0], torch.tensor(want, dtype=torch.float64), rtol=1e-12,
                               atol=1e-15)


def test_exact_where_logits_are_tens_apart():
    """Student (40, 0) and teacher (40, 1) at T = 1: the gradient at the argmax is
    q_0 - p_0 = p_1 - q_1 ~ 1e-17, far below float64's rounding of 1 (a log_softmax
    whose backward forms q_0 * sum(p) - p_0 loses it); the log-prob of a 60-logit lead
    is -ln(1 + 2 e^-60), not 0."""
    hs, ws = one_hot_head([40.0, 0.0])
    ht, wt = one_hot_head([40.0, 1.0])
    _, _, gw = grads(lambda a, b: oracle_loss(a, b, teacher_hidden=ht, teacher_weight=wt,
                                              kind="forward_kl"), hs, ws)
    p1, q1 = math.exp(-39) / (1 + math.exp(-39)), math.exp(-40) / (1 + math.exp(-40))
    torch.testing.assert_close(gw[:, 0], torch.tensor([p1 - q1, q1 - p1], dtype=torch.float64),
                               rtol=1e-12, atol=0)
    lq = log_softmax(torch.tensor([[60.0, 0.0, 0.0]], dtype=torch.float64))
    assert lq[0, 0].item() == pytest.approx(-2 * math.exp(-60), rel=1e-12)
    assert lq[0, 1].item() == pytest.approx(-60 - 2 * math.exp(-60), rel=1e-15)


def test_ignored_positions_get_exactly_zero_gradient():
    hs, ws = one_hot_head(ZS, [50.0, -50.0, 0.0], ZS)
    ht, wt = one_hot_head(ZT, ZT, ZT)
    _, gh, gw = grads(lambda a, b: oracle_loss(
        a, b, teacher_hidden=ht, teacher_weight=wt, labels=torch.tensor([0, -100, 1]),
        ce_weight=0.4), hs, ws)
    assert (gh[1] == 0).all() and (gw[:, 1] == 0).all()
    assert (gh[0] != 0).any() and (gw[:, 2] != 0).any()


def test_assert_rows_close_holds_a_small_row_to_its_own_size():
    """Doubling one row 1e-6 the size of the others moves the whole-matrix relative error by
    ~1e-7 (within a 1e-4 Frobenius test) but fails the row-wise comparison."""
    g = torch.Generator().manual_seed(1)
    want = torch.randn(50, 8, generator=g, dtype=torch.float64)
    want[7] *= 1e-6
    got = want.clone()
    got[7] *= 2
    assert (got - want).norm() / want.norm() < 1e-4
    with pytest.raises(AssertionError, match="row 7"):
        assert_rows_close(got, want, rtol=1e-4, name="d weight")
    near = want * (1 + 1e-6 * torch.randn(50, 8, generator=g, dtype=torch.float64))
    assert_rows_close(near, want, rtol=1e-5)
    with pytest.raises(AssertionError, match="rows off"):  # a 1-D tensor: entry by entry
        assert_rows_close(torch.tensor([1.0, 2e-9]), torch.tensor([1.0, 1e-9]), rtol=1e-3)
