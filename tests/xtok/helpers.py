"""Random cross-tokenizer cases: two vocabularies, a partial map, spans of every shape."""

from __future__ import annotations

import random

import torch

from distill.xtok import VocabMap

SHAPES = [(1, 1)] * 5 + [(1, 2), (2, 1), (2, 3), (3, 1), (1, 3), (3, 2)]


def random_spans(ns: int, nt: int, rng: random.Random):
    """Spans over a student of ns rows and a teacher of nt rows, with gaps on either side."""
    out, s, t = [], 1, 1
    while True:
        a, b = rng.choice(SHAPES)
        if s + a > ns or t + b > nt:
            return out
        out.append((s, s + a, t, t + b))
        s += a + (rng.random() < 0.15)
        t += b + (rng.random() < 0.1)


def make_case(ns=41, nt=38, vs=53, vt=47, hs=24, ht=20, pairs=30, ignore_frac=0.1,
              logit_std=3.0, seed=None):
    """Float64 inputs of one case; the map pairs `pairs` random tokens (both rests stay
    non-empty, as the oracle needs)."""
    rng = random.Random(seed if seed is not None else torch.randint(0, 2**31, ()).item())
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    x = dict(
        student_hidden=torch.randn(ns, hs, generator=g, dtype=torch.float64),
        student_weight=torch.randn(vs, hs, generator=g, dtype=torch.float64)
        * logit_std / hs**0.5,
        teacher_hidden=torch.randn(nt, ht, generator=g, dtype=torch.float64),
        teacher_weight=torch.randn(vt, ht, generator=g, dtype=torch.float64)
        * logit_std / ht**0.5,
        labels=torch.randint(0, vs, (ns,), generator=g),
        teacher_targets=torch.randint(0, vt, (nt,), generator=g),
        spans=torch.tensor(random_spans(ns, nt, rng), dtype=torch.long),
    )
    x["labels"][torch.rand(ns, generator=g) < ignore_frac] = -100
    s_ids = torch.randperm(vs, generator=g)[:pairs]
    t_ids = torch.randperm(vt, generator=g)[:pairs]
    # most real spans start with the same token on both sides: a pair
    partner = dict(zip(s_ids.tolist(), t_ids.tolist()))
    for s_lo, _, t_lo, _ in x["spans"].tolist():
        label = int(x["labels"][s_lo])
        if label in partner and rng.random() < 0.6:
            x["teacher_targets"][t_lo] = partner[label]
    return x, VocabMap(s_ids, t_ids, vs, vt)


def as_dtype(x: dict, dtype) -> dict:
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in x.items()}
