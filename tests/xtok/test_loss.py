"""cross_tokenizer_divergence against the float64 oracle, the same-vocabulary loss, itself."""

import pytest
import torch

from distill.losses import linear_divergence
from distill.ops.spec import HeadTransform
from distill.xtok import VocabMap, cross_tokenizer_divergence
from tests.conftest import TOLERANCES
from tests.oracle import oracle_loss
from tests.xtok.helpers import as_dtype, make_case
from tests.xtok.reference import reference_loss

KINDS = [("forward_kl", {}), ("reverse_kl", {}), ("jsd", {"beta": 0.3})]
TEACHER_KEYS = ("teacher_hidden", "teacher_weight")


def fast(x, grad_scale=1.0, **kw):
    """Loss and (d hidden, d weight) of the fast path in fp32."""
    x = as_dtype(x, torch.float32)
    h = x["student_hidden"].clone().requires_grad_()
    w = x["student_weight"].clone().requires_grad_()
    rest = {k: v for k, v in x.items() if k not in ("student_hidden", "student_weight")}
    loss = cross_tokenizer_divergence(h, w, **rest, **kw)
    (loss * grad_scale).backward()
    return loss.detach().double(), h.grad.double(), w.grad.double()


def oracle(x, vmap, grad_scale=1.0, temperature=1.0, **kw):
    h = x["student_hidden"].clone().requires_grad_()
    w = x["student_weight"].clone().requires_grad_()
    logp = torch.log_softmax(x["teacher_hidden"] @ x["teacher_weight"].T / temperature, -1)
    pairs = list(zip(vmap.student_ids.tolist(), vmap.teacher_ids.tolist()))
    loss = reference_loss(h, w, logp, spans=x["spans"], labels=x["labels"],
                          teacher_targets=x["teacher_targets"], weights=x.get("weights"),
                          pairs=pairs, temperature=temperature, **kw)
    (loss * grad_scale).backward()
    return loss.detach(), h.grad, w.grad


def assert_all_close(got, ref, dtype=torch.float32):
    rtol, atol = TOLERANCES[dtype]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * max(1.0, float(b.abs().max())))


@pytest.mark.parametrize("mode,kind,extra", [("uld", "reverse_kl", {})]
                         + [("hybrid", k, e) for k, e in KINDS])
@pytest.mark.parametrize("temperature,ce_weight", [(1.0, 0.0), (2.0, 0.4)])
def test_matches_float64_oracle(mode, kind, extra, temperature, ce_weight):
    x, vmap = make_case()
    x["weights"] = torch.rand(len(x["labels"]), dtype=torch.float64)
    kw = dict(mode=mode, kind=kind, temperature=temperature, ce_weight=ce_weight, **extra)
    got = fast(x, grad_scale=-1.7, vocab_map=vmap, chunk_size=7, **kw)
    ref = oracle(x, vmap, grad_scale=-1.7, **kw)
    assert_all_close(got, ref)


@pytest.mark.parametrize("mode", ["uld", "hybrid"])
def test_hybrid_weights_and_factors(mode):
    x, vmap = make_case(seed=3)
    kw = dict(mode=mode, kind="jsd", beta=0.6, temperature=1.5, temperature_squared=True,
              divergence_weight=0.7, uld_weight=0.25, ce_weight=0.2)
    assert_all_close(fast(x, vocab_map=vmap, **kw), oracle(x, vmap, **kw))


def test_chunking_does_not_change_the_result():
    x, vmap = make_case(ns=60, nt=55, seed=1)
    runs = [fast(x, vocab_map=vmap, mode="hybrid", ce_weight=0.3, chunk_size=c)
            for c in (1, 4, 13, None)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("temperature,ce_weight", [(1.0, 0.0), (2.0, 0.5)])
def test_identical_tokenizers_equal_linear_divergence(kind, extra, temperature, ce_weight):
    """Same vocabulary, every span one token on both sides: the hybrid is the package's
    divergence, loss and gradients."""
    x, _ = make_case(nt=41, vt=53, ht=20)
    n = len(x["labels"])
    x = as_dtype(x, torch.float32)
    weights = torch.rand(n) * (x["labels"] != -100)
    rows = (x["labels"] != -100).nonzero().squeeze(1)
    spans = torch.stack([rows, rows + 1, rows, rows + 1], 1)
    kw = dict(kind=kind, temperature=temperature, ce_weight=ce_weight, weights=weights,
              labels=x["labels"], **extra)
    teacher = dict(teacher_hidden=x["teacher_hidden"][:n], teacher_weight=x["teacher_weight"])
    grads = []
    for fn in ("xtok", "same"):
        h = x["student_hidden"].clone().requires_grad_()
        w = x["student_weight"].clone().requires_grad_()
        if fn == "xtok":
            loss = cross_tokenizer_divergence(h, w, spans=spans, teacher_targets=x["labels"],
                                              mode="hybrid", vocab_map=VocabMap.identity(53),
                                              **teacher, **kw)
        else:
            loss = linear_divergence(h, w, **teacher, **kw)
        (loss * 0.7).backward()
        grads.append((loss.detach(), h.grad, w.grad))
    assert_all_close(*grads)  # both in fp32: equal up to its rounding


@pytest.mark.parametrize("kind,extra", KINDS)
def test_identical_tokenizers_oracle_is_the_package_oracle(kind, extra):
    """The same identity in float64, on the definitions themselves."""
    x, _ = make_case(ns=20, nt=20, vt=53, ht=24, seed=5)
    x["teacher_hidden"] = torch.randn(20, 24, dtype=torch.float64)
    rows = (x["labels"] != -100).nonzero().squeeze(1)
    x["spans"] = torch.stack([rows, rows + 1, rows, rows + 1], 1)
    x["teacher_targets"] = x["labels"].clamp_min(0)
    x["teacher_weight"] = torch.randn(53, 24, dtype=torch.float64)
    ident = VocabMap.identity(53)
    got = oracle(x, ident, kind=kind, temperature=1.3, ce_weight=0.2, mode="hybrid", **extra)
    h = x["student_hidden"].clone().requires_grad_()
    w = x["student_weight"].clone().requires_grad_()
    ref = oracle_loss(h, w, teacher_hidden=x["teacher_hidden"],
                      teacher_weight=x["teacher_weight"], labels=x["labels"], kind=kind,
                      beta=extra.get("beta", 0.5), temperature=1.3, ce_weight=0.2)
    ref.backward()
    assert_all_close(got, (ref.detach(), h.grad, w.grad), torch.float64)


@pytest.mark.parametrize("mode", ["uld", "hybrid"])
def test_oracle_gradients_by_finite_differences(mode):
    x, vmap = make_case(ns=9, nt=9, vs=11, vt=9, hs=5, ht=4, pairs=5, seed=2)
    pairs = list(zip(vmap.student_ids.tolist(), vmap.teacher_ids.tolist()))
    logp = torch.log_softmax(x["teacher_hidden"] @ x["teacher_weight"].T, -1)

    def f(h, w):
        return reference_loss(h, w, logp, spans=x["spans"], labels=x["labels"],
                              teacher_targets=x["teacher_targets"], pairs=pairs, mode=mode,
                              kind="jsd", ce_weight=0.3)

    inputs = (x["student_hidden"].requires_grad_(), x["student_weight"].requires_grad_())
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)


def test_untrained_rows_drop_their_span_and_get_no_gradient():
    x, vmap = make_case(ignore_frac=0.0, seed=4)
    multi = next(j for j, s in enumerate(x["spans"].tolist()) if s[1] - s[0] >= 2)
    inner = int(x["spans"][multi, 0]) + 1
    x["labels"][inner] = -100
    loss, gh, _ = fast(x, vocab_map=vmap, mode="hybrid", ce_weight=0.5)
    lo, hi = x["spans"][multi, :2].tolist()
    assert (gh[inner] == 0).all()
    # the rest of that span keeps its CE only: the same as if the span were not given
    keep = torch.ones(len(x["spans"]), dtype=torch.bool)
    keep[multi] = False
    loss2, gh2, _ = fast({**x, "spans": x["spans"][keep]}, vocab_map=vmap, mode="hybrid",
                         ce_weight=0.5)
    torch.testing.assert_close(loss, loss2)
    torch.testing.assert_close(gh[lo:hi], gh2[lo:hi])
    x["labels"][:] = -100
    loss, gh, gw = fast(x, vocab_map=vmap, mode="hybrid", ce_weight=0.5)
    assert loss.item() == 0.0 and (gh == 0).all() and (gw == 0).all()


def test_cached_teacher_with_every_id_equals_live():
    x, vmap = make_case(seed=6)
    vt = x["teacher_weight"].shape[0]
    logp = torch.log_softmax(x["teacher_hidden"] @ x["teacher_weight"].T, -1)
    top = logp.topk(vt, -1)
    cached = {k: v for k, v in x.items() if k not in TEACHER_KEYS}
    cached.update(teacher_topk_ids=top.indices, teacher_topk_logprobs=top.values,
                  teacher_target_logprobs=logp.gather(1, x["teacher_targets"][:, None])[:, 0])
    for mode in ("uld", "hybrid"):
        live = fast(x, vocab_map=vmap, mode=mode, ce_weight=0.1)
        got = fast(cached, vocab_map=vmap, mode=mode, ce_weight=0.1)
        assert_all_close(got, live)


def test_cached_top_k_matches_the_oracle_on_its_reconstruction():
    """K < V: the top-k and the row's own token as stored, the rest spread evenly."""
    x, vmap = make_case(seed=7)
    logp = torch.log_softmax(x["teacher_hidden"] @ x["teacher_weight"].T, -1)
    k, vt = 6, logp.shape[1]
    top = logp.topk(k, -1)
    own = logp.gather(1, x["teacher_targets"][:, None])[:, 0]
    dense = torch.empty_like(logp)
    for r in range(len(logp)):
        known = dict(zip(top.indices[r].tolist(), top.values[r].tolist()))
        known[int(x["teacher_targets"][r])] = float(own[r])
        left = 1 - sum(torch.tensor(list(known.values())).exp().tolist())
        dense[r] = torch.log(torch.tensor(left / (vt - len(known)), dtype=torch.float64))
        for i, v in known.items():
            dense[r, i] = v
    cached = {kk: v for kk, v in x.items() if kk not in TEACHER_KEYS}
    cached.update(teacher_topk_ids=top.indices, teacher_topk_logprobs=top.values,
                  teacher_target_logprobs=own)
    got = fast(cached, vocab_map=vmap, mode="hybrid", kind="forward_kl", teacher_vocab_size=vt)
    h = x["student_hidden"].clone().requires_grad_()
    w = x["student_weight"].clone().requires_grad_()
    pairs = list(zip(vmap.student_ids.tolist(), vmap.teacher_ids.tolist()))
    ref = reference_loss(h, w, dense, spans=x["spans"], labels=x["labels"],
                         teacher_targets=x["teacher_targets"], pairs=pairs, kind="forward_kl")
    ref.backward()
    assert_all_close(got, (ref.detach(), h.grad, w.grad))


def test_student_head_scale_and_padded_heads():
    x, vmap = make_case(seed=8)
    scaled = dict(x, student_weight=x["student_weight"] * 0.5)
    a = fast(scaled, vocab_map=vmap, mode="hybrid", ce_weight=0.2)
    pad = torch.randn(5, x["student_weight"].shape[1], dtype=torch.float64)
    padded = dict(x, student_weight=torch.cat([x["student_weight"], pad]),
                  teacher_weight=torch.cat([x["teacher_weight"], pad[:, :20]]))
    b = fast(padded, vocab_map=vmap, mode="hybrid", ce_weight=0.2,
             student_head=HeadTransform(scale=0.5))
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-7)
    # d loss / d W through the scale: half the gradient of the scaled weight
    torch.testing.assert_close(b[2][:53], 0.5 * a[2], rtol=1e-5, atol=1e-7)
    assert (b[2][53:] == 0).all()


def test_no_grad_and_components():
    x, vmap = make_case(seed=9)
    x = as_dtype(x, torch.float32)
    args = {k: v for k, v in x.items() if k not in ("student_hidden", "student_weight")}
    with torch.no_grad():
        plain = cross_tokenizer_divergence(x["student_hidden"], x["student_weight"],
                                           vocab_map=vmap, ce_weight=0.3, **args)
    loss, parts = cross_tokenizer_divergence(x["student_hidden"], x["student_weight"],
                                             vocab_map=vmap, ce_weight=0.3,
                                             return_components=True, **args)
    torch.testing.assert_close(plain, loss)
    torch.testing.assert_close(parts["divergence"] + 0.3 * parts["ce"], loss)
    assert parts["spans"] > 0 and parts["ce"] > 0


def test_clear_errors():
    x, vmap = make_case(seed=10)
    x = as_dtype(x, torch.float32)
    args = {k: v for k, v in x.items() if k not in ("student_hidden", "student_weight")}
    h, w = x["student_hidden"], x["student_weight"]
    with pytest.raises(ValueError, match="needs the vocabulary map"):
        cross_tokenizer_divergence(h, w, mode="hybrid", **args)
    with pytest.raises(ValueError, match="choose 'uld' or 'hybrid'"):
        cross_tokenizer_divergence(h, w, mode="gold", vocab_map=vmap, **args)
    overlapping = dict(args, spans=torch.tensor([[1, 3, 1, 2], [2, 4, 2, 3]]))
    with pytest.raises(ValueError, match="spans overlap"):
        cross_tokenizer_divergence(h, w, vocab_map=vmap, **overlapping)
    with pytest.raises(ValueError, match="outside the rows"):
        cross_tokenizer_divergence(h, w, vocab_map=vmap,
                                   **dict(args, spans=torch.tensor([[40, 42, 1, 2]])))
