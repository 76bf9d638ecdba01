"""Choosing the next token: greedy, or temperature and top-p sampling from counter-based draws.

The one idea: a row's random number at a decoding step is a hash of (seed, row, step), not a
draw from a stateful generator. So a row's completion never depends on the batch it was
decoded in (its bucket padding, the fake rows that fill a bucket, the chunk it fell in), the
same numbers come out on CPU and CUDA, and the whole choice is plain tensor arithmetic that a
CUDA graph can capture (no generator state, no host sync). One uniform per row per step is
enough: the token is read off the inverse CDF of the (filtered) distribution.

The distribution is the one `generate` samples from: logits in fp32, divided by the
temperature, the nucleus of `TopPLogitsWarper` (the smallest set of most likely tokens whose
mass reaches top_p, at least one token), renormalized.
"""

from __future__ import annotations

import torch

_M64 = 1 << 64


def _signed(c: int) -> int:
    return c - _M64 if c >= 1 << 63 else c


# splitmix64 (Steele et al., 2014): int64 tensors wrap on overflow; the masks turn torch's
# arithmetic right shift of a negative int64 into the logical shift the hash is defined with
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_C1, _C2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _C1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _C2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def uniforms(seed: torch.Tensor, rows: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """(B,) float32 in (0, 1): one draw per row, a function of (seed, row, step) alone.

    seed, step: 0-d int64 tensors (device tensors, so a captured graph reads their current
    value); rows: (B,) int64, each row's index in the caller's list of prompts.
    """
    x = _mix(_mix(seed * _GOLDEN + rows) + step * _GOLDEN)
    return (((x >> 40) & 0xFFFFFF).to(torch.float32) + 0.5) * 2.0**-24  # 24 bits, like fp32


def uniforms_reference(seed: int, row: int, step: int) -> float:
    """The same draw in Python integers (mod 2**64): the oracle for `uniforms`."""

    def mix(x):
        x ^= x >> 30
        x = (x * (_C1 % _M64)) % _M64
        x ^= x >> 27
        x = (x * (_C2 % _M64)) % _M64
        return x ^ (x >> 31)

    x = mix((seed * (_GOLDEN % _M64) + row) % _M64)
    x = mix((x + step * (_GOLDEN % _M64)) % _M64)
    return ((x >> 40) + 0.5) * 2.0**-24


def choose(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float,
           ) -> torch.Tensor:
    """(B,) int64 next tokens from (B, V) logits (already cut to the tokenizer's vocabulary,
    so padded head rows are never candidates) and (B,) uniforms; temperature 0 is greedy."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    scores = logits if temperature == 1 else logits / temperature
    if top_p >= 1.0:
        weights = (scores - scores.amax(-1, keepdim=True)).exp()  # unnormalized, max 1
        cum = weights.cumsum(-1)  # (B, V)
        pick = torch.searchsorted(cum, u[:, None] * cum[:, -1:])  # first cum >= u * total
        return pick.clamp(max=scores.shape[-1] - 1).squeeze(-1)
    ordered, order = scores.sort(-1, descending=True)
    weights = (ordered - ordered[:, :1]).exp()
    cum = weights.cumsum(-1)
    # keep a token while the mass ranked above it is below top_p (TopPLogitsWarper), as a
    # count, so the kept set is a prefix of the order even where cum rounds unevenly
    keep = ((cum - weights) < top_p * cum[:, -1:]).sum(-1, keepdim=True).clamp(min=1)
    kept_mass = cum.gather(-1, keep - 1)  # (B, 1)
    pick = torch.searchsorted(cum, u[:, None] * kept_mass)
    pick = torch.minimum(pick, keep - 1)
    return order.gather(-1, pick).squeeze(-1)


def reference_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """(B, V) float64 probabilities `choose` samples from, written the plain way (sort
    ascending, drop the tail of mass <= 1 - top_p, softmax): the test oracle."""
    scores = logits.double() / temperature
    if top_p < 1.0:
        ascending, order = scores.sort(-1)
        cum = ascending.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False
        scores = scores.scatter(-1, order, ascending.masked_fill(drop, float("-inf")))
    return scores.softmax(-1)
