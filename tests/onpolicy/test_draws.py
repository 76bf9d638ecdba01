"""The token choice: counter-based draws equal their integer oracle; the inverse CDF picks
each token with exactly the probability of temperature + top-p sampling; padded rows and
the nucleus tail are never chosen."""

import pytest
import torch

from distill.onpolicy.draws import choose, reference_probs, uniforms, uniforms_reference


@pytest.mark.parametrize("seed", [0, 7, 2**62 - 3, 123456789012345])
def test_uniforms_equal_the_integer_oracle(seed):
    rows = torch.tensor([0, 1, 2, 5, 1000, 2**40])
    for step in (0, 1, 17, 4095):
        got = uniforms(torch.tensor(seed), rows, torch.tensor(step))
        want = torch.tensor([uniforms_reference(seed, int(r), step) for r in rows])
        assert got.dtype == torch.float32
        assert torch.equal(got.double(), want)


def test_uniforms_look_uniform_and_independent():
    rows = torch.arange(20000)
    a = uniforms(torch.tensor(3), rows, torch.tensor(0)).double()
    b = uniforms(torch.tensor(3), rows, torch.tensor(1)).double()
    c = uniforms(torch.tensor(4), rows, torch.tensor(0)).double()
    assert ((a > 0) & (a < 1)).all()
    assert abs(a.mean() - 0.5) < 0.01 and abs(a.var() - 1 / 12) < 0.003
    hist = torch.histc(a, bins=20, min=0, max=1)
    assert (hist - 1000).abs().max() < 160  # ~5 sigma for 1000 per bin
    for x, y in ((a, b), (a, c)):
        assert abs(torch.corrcoef(torch.stack([x, y]))[0, 1]) < 0.03


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9),
                                               (0.5, 0.5), (1.0, 0.05)])
def test_inverse_cdf_gives_the_reference_probabilities(temperature, top_p):
    torch.manual_seed(1)
    logits = torch.randn(3, 41) * 2  # odd vocabulary
    grid = 20000  # evenly spaced u: each token's share of the grid is its probability
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    want = reference_probs(logits, temperature, top_p)
    for row in range(3):
        picks = choose(logits[row].expand(grid, -1), u.float(), temperature, top_p)
        share = torch.bincount(picks, minlength=41).double() / grid
        assert (share - want[row]).abs().max() < 2e-4
        assert (share[want[row] == 0] == 0).all()  # outside the nucleus: never


def test_greedy_is_the_argmax_and_ignores_u():
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [5.0, 0.0, 0.0, 0.0]])
    assert choose(logits, None, 0.0, 0.3).tolist() == [1, 0]  # first of tied maxima, as torch


def test_tiny_top_p_keeps_only_the_most_likely_token():
    logits = torch.randn(64, 50)
    u = uniforms(torch.tensor(0), torch.arange(64), torch.tensor(0))
    assert torch.equal(choose(logits, u, 1.0, 1e-6), logits.argmax(-1))
