"""linear_divergence (CPU chunked path) against the float64 full-logit oracle (tests/oracle.py)."""

import pytest
import torch

from distill.losses import linear_divergence
from tests.losses.helpers import (
    assert_close,
    frozen_head_grads,
    make_inputs,
    row_tolerance,
    run_both,
)
from tests.oracle import assert_rows_close

KINDS = [("forward_kl", {}), ("reverse_kl", {}), ("jsd", {"beta": 0.5}), ("jsd", {"beta": 0.1})]


@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("ce_weight", [0.0, 0.5])
def test_live_teacher_matches_the_oracle(kind, extra, temperature, ce_weight):
    x = make_inputs()
    got, ref = run_both(x, linear_divergence, grad_scale=0.5, kind=kind, chunk_size=16,
                        temperature=temperature, ce_weight=ce_weight, **extra)
    assert_close(got, ref, torch.float32)


@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("sparse_mode", ["tail", "renormalize"])
@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_cached_topk_matches_the_oracle(kind, extra, sparse_mode, temperature):
    x = make_inputs(k=8)
    got, ref = run_both(x, linear_divergence, grad_scale=1.7, kind=kind, chunk_size=16,
                        sparse_mode=sparse_mode, temperature=temperature, ce_weight=0.3,
                        **extra)
    assert_close(got, ref, torch.float32)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_sparse_with_k_equal_v_equals_dense(kind):
    v = 97
    x = make_inputs(v=v, ht=48, k=None)
    zt = x["teacher_hidden"].double() @ x["teacher_weight"].double().T
    logp = torch.log_softmax(zt, -1)
    ids = torch.arange(v).expand(len(logp), v).contiguous()
    dense = linear_divergence(x["student_hidden"], x["student_weight"],
                              teacher_hidden=x["teacher_hidden"],
                              teacher_weight=x["teacher_weight"], labels=x["labels"], kind=kind)
    sparse = linear_divergence(x["student_hidden"], x["student_weight"], target_ids=ids,
                               target_logprobs=logp.float(), labels=x["labels"], kind=kind)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)


def test_weights_and_temperature_squared():
    x = make_inputs()
    x["weights"] = torch.rand(41) * (x["labels"] != -100)
    got, ref = run_both(x, linear_divergence, grad_scale=-2.0, kind="jsd", beta=0.3,
                        temperature=3.0, temperature_squared=True, chunk_size=7)
    assert_close(got, ref, torch.float32)


def test_ignored_positions_get_zero_gradient_and_all_ignored_gives_zero():
    x = make_inputs()
    hs = x["student_hidden"].requires_grad_(True)
    loss = linear_divergence(hs, x["student_weight"], teacher_hidden=x["teacher_hidden"],
                             teacher_weight=x["teacher_weight"], labels=x["labels"])
    loss.backward()
    ignored = x["labels"] == -100
    assert ignored.any() and (hs.grad[ignored] == 0).all()
    assert (hs.grad[~ignored].abs().sum(-1) > 0).all()
    hs.grad = None
    labels = torch.full_like(x["labels"], -100)
    loss = linear_divergence(hs, x["student_weight"], teacher_hidden=x["teacher_hidden"],
                             teacher_weight=x["teacher_weight"], labels=labels)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(hs.grad).all() and (hs.grad == 0).all()


def test_padded_heads_use_first_vocab_rows():
    x = make_inputs(v=101)
    v = 101
    pad_s = torch.cat([x["student_weight"], torch.randn(27, 48)])
    pad_t = torch.cat([x["teacher_weight"], torch.randn(3, 40)])
    a = linear_divergence(x["student_hidden"], pad_s, teacher_hidden=x["teacher_hidden"],
                          teacher_weight=pad_t, labels=x["labels"], vocab_size=v)
    b = linear_divergence(x["student_hidden"], x["student_weight"],
                          teacher_hidden=x["teacher_hidden"],
                          teacher_weight=x["teacher_weight"], labels=x["labels"])
    torch.testing.assert_close(a, b)


def test_no_grad_matches_grad_path():
    x = make_inputs()
    kw = dict(teacher_hidden=x["teacher_hidden"], teacher_weight=x["teacher_weight"],
              labels=x["labels"], kind="jsd")
    with torch.no_grad():
        a = linear_divergence(x["student_hidden"], x["student_weight"], **kw)
    b = linear_divergence(x["student_hidden"].requires_grad_(), x["student_weight"], **kw)
    torch.testing.assert_close(a, b.detach())


def test_components_split_divergence_and_ce():
    x = make_inputs()
    kw = dict(teacher_hidden=x["teacher_hidden"], teacher_weight=x["teacher_weight"],
              labels=x["labels"], kind="forward_kl", temperature=2.0)
    total, parts = linear_divergence(x["student_hidden"], x["student_weight"], ce_weight=0.7,
                                     return_components=True, **kw)
    div_only = linear_divergence(x["student_hidden"], x["student_weight"], **kw)
    zs = x["student_hidden"].double() @ x["student_weight"].double().T
    keep = x["labels"] != -100
    ce = torch.nn.functional.cross_entropy(zs[keep], x["labels"][keep])
    torch.testing.assert_close(parts["ce"].double(), ce, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(parts["divergence"], div_only, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total, div_only + 0.7 * parts["ce"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_head_extras_bias_scale_softcap(kind):
    from distill.losses import HeadTransform
    from tests.oracle import Head, oracle_loss

    x = make_inputs(n=23, v=301)
    bias_s = torch.randn(301, dtype=torch.float64)
    bias_t = torch.randn(301, dtype=torch.float64)

    def run(cast):
        hs = x["student_hidden"].to(cast).clone().requires_grad_(True)
        ws = x["student_weight"].to(cast).clone().requires_grad_(True)
        bs = bias_s.to(cast).clone().requires_grad_(True)
        common = dict(teacher_hidden=x["teacher_hidden"].to(cast),
                      teacher_weight=x["teacher_weight"].to(cast), labels=x["labels"],
                      kind=kind, ce_weight=0.2)
        if cast == torch.float64:
            loss = oracle_loss(hs, ws, student_head=Head(bs, 0.7, 5.0),
                               teacher_head=Head(bias_t, 1.3, 8.0), **common)
        else:
            loss = linear_divergence(hs, ws, student_head=HeadTransform(bs, 0.7, 5.0),
                                     teacher_head=HeadTransform(bias_t.to(cast), 1.3, 8.0),
                                     chunk_size=5, **common)
        (loss * 3).backward()
        return loss, hs.grad, ws.grad, bs.grad

    got, ref = run(torch.float32), run(torch.float64)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-6)
    # row by row: each position's d hidden, each vocab entry's d weight and d bias
    for name, a, b in zip(("hidden", "weight", "bias"), got[1:], ref[1:]):
        assert_rows_close(a, b, 1e-4, 1e-9, f"grad {name}")


def test_weight_grad_is_taken_not_copied_and_second_backward_is_refused():
    """An uncut head gets the op's gradient tensor itself (no slice view routing it through
    a weight-sized zero buffer, no clone); a second backward says why it cannot work."""
    x = make_inputs(n=12, v=50, hs=8, ht=8)
    ws = x["student_weight"].clone().requires_grad_(True)
    hs = x["student_hidden"].clone().requires_grad_(True)
    loss = linear_divergence(hs, ws, teacher_hidden=x["teacher_hidden"],
                             teacher_weight=x["teacher_weight"], kind="forward_kl")
    assert loss.grad_fn.next_functions[1][0].name().endswith("AccumulateGrad")
    returned = []
    # (the pointer only: holding the tensor would itself make autograd copy it)
    loss.grad_fn.register_hook(lambda grad_in, _: returned.append(grad_in[1].data_ptr()))
    loss.backward(retain_graph=True)
    assert ws.grad.data_ptr() == returned[0]  # the op's tensor became .grad, no copy
    ref = ws.grad.clone()
    with pytest.raises(RuntimeError, match="backward through the same loss twice"):
        loss.backward()
    torch.testing.assert_close(ws.grad, ref)


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("trainable", [("student_hidden",), ("student_weight",)])
def test_frozen_head_or_hidden_skips_that_gradient(cached, trainable):
    """A frozen LM head (LoRA): d hidden right, weight.grad stays None, and no tensor of
    the weight's shape is ever made (no GEMM into it, no buffer). Likewise a hidden state
    without grad: no d hidden GEMM (no mm output of width Hs). Both against the float64
    oracle; a run with both trainable shows the recorder sees what it must."""
    x = make_inputs(n=13, v=61, hs=24, ht=20, k=5 if cached else None)
    frozen = ({"student_hidden", "student_weight"} - set(trainable)).pop()
    got_loss, got, rec = frozen_head_grads(x, linear_divergence, trainable, kind="jsd",
                                           ce_weight=0.3, temperature=1.5, chunk_size=4)
    ref_result = run_both(x, linear_divergence, grad_scale=0.5, kind="jsd", ce_weight=0.3,
                          temperature=1.5, chunk_size=4)[1]
    ref_loss, ref = ref_result
    torch.testing.assert_close(got_loss.double(), ref_loss, rtol=2e-5, atol=1e-6)
    name = trainable[0]
    torch.testing.assert_close(got[name].double(), ref[name], rtol=1e-4, atol=1e-6)
    scales = ref_result.row_scales(row_tolerance(torch.float32), torch.float32)
    assert_rows_close(got[name], ref[name], row_tolerance(torch.float32), 1e-30, name,
                      scales[name])
    assert got[frozen] is None
    weight_shape = (61, 24)

    def d_hidden_gemms(rec):  # (chunk rows, Hs) products
        return [s for s in rec.shapes("mm", new_memory=False) if s[0] <= 4 and s[1] == 24]

    if frozen == "student_weight":
        assert weight_shape not in rec.shapes()
    else:
        assert not d_hidden_gemms(rec)
    _, _, both = frozen_head_grads(x, linear_divergence, ("student_hidden", "student_weight"),
                                   kind="jsd", chunk_size=4)
    assert weight_shape in both.shapes() and d_hidden_gemms(both)


def _heads_reaching_the_chunk_loop(monkeypatch):
    """Spy on the chunk loop: the (student, teacher) heads of each call."""
    from distill.ops import function

    seen = []
    real = function.fused_rows

    def spy(hs, ws, targets, *args, student_head=None, **kwargs):
        seen.append((student_head, targets.teacher_head))
        return real(hs, ws, targets, *args, student_head=student_head, **kwargs)

    monkeypatch.setattr(function, "fused_rows", spy)
    return seen


def test_a_plain_lm_head_reaches_the_chunk_loop_as_no_head(monkeypatch):
    """models.lm_head gives every family a HeadTransform, an identity one for Llama's head.
    The chunk loop takes its fast path only for None (the row kernel applies the weights and
    writes the gradient; a live teacher's logits come from the stats GEMM on CUDA): the
    head a run passes must reach it as None, and a head with extras as itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from distill.models.causal_lm import lm_head
    from distill.ops.spec import HeadTransform

    model = LlamaForCausalLM(LlamaConfig(vocab_size=53, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2))
    weight, head = lm_head(model)
    assert isinstance(head, HeadTransform) and head.identity
    x = make_inputs(v=53, hs=16, ht=16)
    seen = _heads_reaching_the_chunk_loop(monkeypatch)
    scaled = HeadTransform(scale=0.5)
    for h in (head, scaled):
        linear_divergence(x["student_hidden"].requires_grad_(), weight,
                          teacher_hidden=x["teacher_hidden"], teacher_weight=x["teacher_weight"],
                          labels=x["labels"], student_head=h, teacher_head=h)
    assert seen == [(None, None), (scaled, scaled)]


def test_all_ignored_with_per_position_ce_weights_gives_zero():
    # a (N,) CE weight tensor splits the trained rows into groups; with no trained row
    # there is no group, and the loss is still a zero with zero gradients
    x = make_inputs()
    hs = x["student_hidden"].requires_grad_(True)
    labels = torch.full_like(x["labels"], -100)
    loss = linear_divergence(hs, x["student_weight"], teacher_hidden=x["teacher_hidden"],
                             teacher_weight=x["teacher_weight"], labels=labels,
                             ce_weight=torch.rand(len(labels)))
    loss.backward()
    assert loss.item() == 0.0 and (hs.grad == 0).all()


def test_the_options_are_checked_on_every_call():
    # a valid set of options seen before must not let an equal-comparing invalid one
    # through (True == 1), nor a refusal be kept (were the options ever cached)
    x = make_inputs()
    kw = dict(teacher_hidden=x["teacher_hidden"], teacher_weight=x["teacher_weight"],
              labels=x["labels"], temperature=2.0)
    linear_divergence(x["student_hidden"], x["student_weight"], temperature_squared=True,
                      **kw)
    for _ in range(2):
        with pytest.raises(ValueError, match="temperature_squared=1: must be true or false"):
            linear_divergence(x["student_hidden"], x["student_weight"], temperature_squared=1,
                              **kw)
    with pytest.raises(ValueError, match="kind=\\['jsd'\\]: must be one of"):  # unhashable
        linear_divergence(x["student_hidden"], x["student_weight"], kind=["jsd"], **kw)
