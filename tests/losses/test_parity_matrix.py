"""`linear_divergence` against the independent float64 oracle (tests/oracle.py) over every
option of the loss contract, the loss and every gradient row by row.

A full cartesian product of the options is ~10^5 cases; instead the cases cover every
option's every level and every pair of levels of two options (a greedy all-pairs design,
built below and checked for coverage), plus a few cases with every option on at once.
Backends: the CPU torch path with fp32 and float64 inputs, and the Triton kernels in
Triton's interpreter (fp32, smaller shapes: the interpreter is slow).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from distill import linear_divergence
from distill.losses import HeadTransform
from tests.ops.conftest import triton_kernels  # noqa: F401  (used by name, lazily)
from tests.oracle import Head, assert_rows_close, oracle_loss

# numpy (the interpreter) warns where the kernels take log(0) in a discarded branch
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

FACTORS = {
    "impl": ["torch-fp32", "torch-fp64", "triton-fp32"],
    "target": ["live", "tail-1", "tail-7", "renormalize-1", "renormalize-7"],
    "kind": ["forward_kl", "reverse_kl", "jsd"],
    "temperature": [1.0, 2.5],
    "squared": [False, True],
    "divergence_weight": [1.0, 0.3, 0.0],
    "ce_weight": [0.0, 0.7],
    "labels": ["none", "some ignored"],
    "weights": ["mean", "explicit"],
    "head": ["plain", "bias+scale", "softcap", "padded vocab", "all extras"],
    "chunk": [None, 7],
    "grad_output": [0.37, -1.9],
    "components": [False, True],
}


def allowed(case: dict) -> bool:
    """Combinations the contract allows and that test something (a partial case is judged
    on the options it has): CE needs labels; divergence_weight 0 without CE is a zero loss."""
    dw, ce, labels = (case.get(k) for k in ("divergence_weight", "ce_weight", "labels"))
    if dw == 0.0 and ce == 0.0:
        return False
    return not (labels == "none" and (ce == 0.7 or dw == 0.0))


def all_pairs(factors: dict, ok, seed: int = 0, tries: int = 30) -> list[dict]:
    """Cases covering every allowed pair of levels of every two factors, built greedily:
    each case starts from an uncovered pair and takes, factor by factor, the level that
    covers the most uncovered pairs (best of `tries` random factor orders)."""
    names = list(factors)
    rng = random.Random(seed)
    todo = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
            for x in factors[a] for y in factors[b] if ok({a: x, b: y})}
    cases = []
    while todo:
        (a, x), (b, y) = min(todo, key=repr)
        best, best_gain = None, -1
        for _ in range(tries):
            case = {a: x, b: y}
            rest = [n for n in names if n not in case]
            rng.shuffle(rest)
            for name in rest:
                levels = [v for v in factors[name] if ok({**case, name: v})]
                rng.shuffle(levels)
                case[name] = max(levels, key=lambda v, n=name, c=case: sum(
                    _pair(n, v, m, c[m]) in todo for m in c))
            gain = len(_pairs_of(case) & todo)
            if ok(case) and gain > best_gain:
                best, best_gain = case, gain
        cases.append(best)
        todo -= _pairs_of(best)
    return cases


def _pair(a, x, b, y):
    names = list(FACTORS)
    return ((a, x), (b, y)) if names.index(a) < names.index(b) else ((b, y), (a, x))


def _pairs_of(case):
    return {_pair(a, case[a], b, case[b]) for a, b in itertools.combinations(case, 2)}


PAIRWISE = all_pairs(FACTORS, allowed)
EVERYTHING_ON = dict(target="tail-7", kind="jsd", temperature=2.5, squared=True,
                     divergence_weight=0.3, ce_weight=0.7, labels="some ignored",
                     weights="explicit", head="all extras", chunk=7, grad_output=-1.9,
                     components=True)
FULL = [
    *({**EVERYTHING_ON, "impl": impl} for impl in FACTORS["impl"]),
    {**EVERYTHING_ON, "impl": "torch-fp32", "target": "renormalize-7", "kind": "reverse_kl"},
    {**EVERYTHING_ON, "impl": "torch-fp64", "target": "tail-all", "kind": "forward_kl"},
    {**EVERYTHING_ON, "impl": "triton-fp32", "target": "tail-all", "kind": "reverse_kl",
     "head": "plain"},
    {**EVERYTHING_ON, "impl": "triton-fp32", "target": "live", "head": "plain",
     "components": False, "beta": 0.7},
    {**EVERYTHING_ON, "impl": "torch-fp32", "target": "live", "ignore_index": -1},
    {**EVERYTHING_ON, "impl": "torch-fp32", "target": "tail-7-sharp", "kind": "reverse_kl"},
    {**EVERYTHING_ON, "impl": "torch-fp64", "target": "tail-7-sharp", "kind": "forward_kl"},
    {**EVERYTHING_ON, "impl": "triton-fp32", "target": "tail-7-sharp", "kind": "reverse_kl",
     "head": "plain"},
    {**EVERYTHING_ON, "impl": "triton-fp32", "target": "renormalize-7", "ignore_index": -1,
     "head": "bias+scale"},
]
CASES = PAIRWISE + FULL

# (n tokens, vocab, student hidden, teacher hidden): odd sizes, several chunks of 7
SHAPES = {"torch": (41, 1271, 48, 40), "triton": (19, 263, 24, 20)}
# the kernels run interpreted on CPU tensors without a GPU, compiled on the GPU's otherwise
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Tolerances on the loss and each gradient row. The op does its math in fp32 whatever the
# input dtype (float64 inputs are rounded to fp32 logits), so both share them.
LOSS_TOL = (2e-5, 1e-6)
ROW_RTOL = 1e-4
ROW_ATOL = 1e-12  # rows that must be zero (ignored positions, padding rows) are zero


def case_id(i, case):
    return f"{i}-" + "-".join(str(case[k]) for k in ("impl", "target", "kind", "head"))


def make_inputs(case, seed):
    """Random tensors for one case (float64, cast later): logits std ~4 like a trained
    model's; cached targets are the top-k of a random teacher distribution."""
    g = torch.Generator().manual_seed(seed)
    n, v, hs, ht = SHAPES[case["impl"].split("-")[0]]
    pad_s, pad_t = (3, 5) if case["head"] in ("padded vocab", "all extras") else (0, 0)

    def rnd(*shape, std=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * std

    x = dict(student_hidden=rnd(n, hs), student_weight=rnd(v + pad_s, hs, std=4 / hs**0.5))
    target = case["target"]
    if target == "live":
        x.update(teacher_hidden=rnd(n, ht), teacher_weight=rnd(v + pad_t, ht, std=4 / ht**0.5))
    else:
        k = v if target == "tail-all" else int(target.split("-")[1])
        zt = rnd(n, v, std=4.0)
        if target.endswith("sharp"):  # a confident teacher: tails 1e-3 to 1e-16, some under
            # the floor; in fp16 (below) some top-k sum to one or more
            peak = 20.0 + 25.0 * torch.rand(n, generator=g, dtype=torch.float64)
            zt[torch.arange(n), torch.randint(0, v, (n,), generator=g)] += peak
        values, ids = torch.log_softmax(zt, -1).topk(k, dim=-1)
        if target.endswith("sharp"):  # stored in fp16, as caches are: sums can pass one
            values = values.half().double()
        perm = torch.randperm(k, generator=g)  # the cache's order is not the sorted one
        x.update(target_ids=ids[:, perm], target_logprobs=values[:, perm])
    if case["labels"] != "none":
        labels = torch.randint(0, v, (n,), generator=g)
        labels[torch.rand(n, generator=g) < 0.3] = case.get("ignore_index", -100)
        labels[0] = case.get("ignore_index", -100)
        x["labels"] = labels
    if case["weights"] == "explicit":
        w = torch.rand(n, generator=g, dtype=torch.float64) * 0.1
        w[torch.rand(n, generator=g) < 0.2] = 0.0
        x["weights"] = w
    heads = {"student_head": None, "teacher_head": None}
    if case["head"] in ("bias+scale", "all extras"):
        heads["student_head"] = dict(bias=rnd(v + pad_s), scale=0.8)
        heads["teacher_head"] = dict(bias=rnd(v + pad_t), scale=1.25)
    if case["head"] in ("softcap", "all extras"):
        for name, cap in (("student_head", 6.0), ("teacher_head", 5.0)):
            heads[name] = {**(heads[name] or {}), "softcap": cap}
    if target != "live":
        heads["teacher_head"] = None
    vocab_size = v if pad_s else None
    return x, heads, vocab_size


def loss_options(case, vocab_size):
    return dict(kind=case["kind"], beta=case.get("beta", 0.3), temperature=case["temperature"],
                temperature_squared=case["squared"], divergence_weight=case["divergence_weight"],
                ce_weight=case["ce_weight"], vocab_size=vocab_size,
                sparse_mode="renormalize" if case["target"].startswith("renorm") else "tail",
                return_components=case["components"],
                ignore_index=case.get("ignore_index", -100))


def run(fn, x, heads, head_cls, dtype, grad_output, device="cpu", **options):
    """Loss, components and {name: grad} of fn on copies of x in `dtype` on `device` (the
    student's hidden, weight and bias require grad), all brought back to the CPU."""
    args, leaves = {}, {}
    for name, t in x.items():
        t = t.to(device, dtype if t.is_floating_point() else t.dtype, copy=True)
        if name in ("student_hidden", "student_weight"):
            t.requires_grad_(True)
            leaves[name] = t
        args[name] = t
    for name, spec in heads.items():
        if spec is None:
            continue
        spec = dict(spec)
        if spec.get("bias") is not None:
            bias = spec["bias"].to(device, dtype, copy=True)
            spec["bias"] = bias.requires_grad_(name == "student_head")
            if name == "student_head":
                leaves["student_bias"] = spec["bias"]
        args[name] = head_cls(**spec)
    out = fn(**args, **options)
    loss, parts = out if isinstance(out, tuple) else (out, None)
    (loss * grad_output).backward()
    parts = parts and {k: v.cpu() for k, v in parts.items()}
    grads = {k: None if t.grad is None else t.grad.cpu() for k, t in leaves.items()}
    return loss.detach().cpu(), parts, grads


def logit_grads(x, heads, grad_output, **options):
    """C = grad_output * d loss / d (student_hidden @ student_weight.T), (n, V'), from the
    oracle: with hidden = I and weight = the logits' transpose the logits are unchanged and
    d weight is C.T."""
    z = x["student_hidden"] @ x["student_weight"].T
    eye = {"student_hidden": torch.eye(len(z), dtype=torch.float64),
           "student_weight": z.T.contiguous()}
    _, _, grads = run(oracle_loss, {**x, **eye}, heads, Head, torch.float64, grad_output,
                      **options)
    return grads["student_weight"].T


def row_scales(x, c):
    """Per row of each gradient, the norm of the sum of the magnitudes of the terms it sums:
    d weight = C.T H, d hidden = C W, d bias = C summed over tokens."""
    h, w, c = x["student_hidden"].abs(), x["student_weight"].abs(), c.abs()
    dw = c.T @ h
    return {"student_hidden": (c @ w).norm(dim=1), "student_weight": dw.norm(dim=1),
            "student_weight columns": dw.norm(dim=0), "student_bias": c.sum(0)}


@pytest.mark.parametrize("case", CASES, ids=[case_id(i, c) for i, c in enumerate(CASES)])
def test_matches_the_oracle(case, request):
    impl = case["impl"]
    dtype = torch.float64 if impl.endswith("fp64") else torch.float32
    fused_kw = dict(chunk_size=case["chunk"], backend="torch")
    if impl.startswith("triton"):
        request.getfixturevalue("triton_kernels")
        fused_kw.update(backend="triton", device=TRITON_DEVICE)
    x, heads, vocab_size = make_inputs(case, seed=CASES.index(case))
    opts = loss_options(case, vocab_size)
    g = case["grad_output"]
    got, got_parts, got_grads = run(linear_divergence, x, heads, HeadTransform, dtype, g,
                                    **opts, **fused_kw)
    want, want_parts, want_grads = run(oracle_loss, x, heads, Head, torch.float64, g, **opts)

    assert got.dtype == torch.float32, got.dtype
    torch.testing.assert_close(got.double(), want, rtol=LOSS_TOL[0], atol=LOSS_TOL[1])
    if case["components"]:
        for name in ("divergence", "ce"):
            torch.testing.assert_close(got_parts[name].double(), want_parts[name],
                                       rtol=LOSS_TOL[0], atol=LOSS_TOL[1], msg=name)
    assert set(got_grads) == set(want_grads)
    scales = row_scales(x, logit_grads(x, heads, g, **{**opts, "return_components": False}))
    for name, want_g in want_grads.items():
        assert got_grads[name] is not None, name
        if name != "student_bias":  # the bias gradient comes back in fp32
            assert got_grads[name].dtype == dtype, (name, got_grads[name].dtype)
        assert_rows_close(got_grads[name], want_g, ROW_RTOL, ROW_ATOL, name, scales[name])
        if name == "student_weight":  # per hidden unit too
            assert_rows_close(got_grads[name].T, want_g.T, ROW_RTOL, ROW_ATOL,
                              "student_weight columns", scales["student_weight columns"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_renormalize_gives_no_gradient_outside_the_cached_ids(backend, request):
    """With sparse_mode='renormalize' and no CE the loss depends on the K cached logits
    alone: every other vocab row of d weight is exactly zero (the oracle's is)."""
    if backend == "triton":
        request.getfixturevalue("triton_kernels")
    case = {**EVERYTHING_ON, "impl": f"{backend}-fp32", "target": "renormalize-7",
            "kind": "forward_kl", "ce_weight": 0.0, "divergence_weight": 1.0,
            "head": "plain", "labels": "none", "weights": "mean", "components": False}
    x, heads, vocab_size = make_inputs(case, seed=5)
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    _, _, grads = run(linear_divergence, x, heads, HeadTransform, torch.float32, 1.0,
                      device, **loss_options(case, vocab_size), backend=backend)
    cached = torch.zeros(len(x["student_weight"]), dtype=torch.bool)
    cached[x["target_ids"].flatten()] = True
    nonzero = int((grads["student_weight"][~cached] != 0).any(1).sum())
    assert nonzero == 0, f"{nonzero} vocab rows outside every position's ids have a gradient"


def test_the_design_covers_every_level_and_pair():
    """Every allowed pair of two options' levels is in some pairwise case, every case is
    allowed, and the design stays far smaller than the product."""
    covered = set().union(*(_pairs_of(c) for c in PAIRWISE))
    for a, b in itertools.combinations(FACTORS, 2):
        for x, y in itertools.product(FACTORS[a], FACTORS[b]):
            if allowed({a: x, b: y}):
                assert _pair(a, x, b, y) in covered, (a, x, b, y)
    assert all(allowed(c) for c in CASES)
    assert len(PAIRWISE) < 60
