"""Bad input to linear_divergence: a clear ValueError that names the problem."""

import pytest
import torch

from distill.losses import linear_divergence
from tests.losses.helpers import make_inputs


def _live(x, **kw):
    args = dict(teacher_hidden=x["teacher_hidden"], teacher_weight=x["teacher_weight"],
                labels=x["labels"])
    args.update(kw)
    return linear_divergence(x["student_hidden"], x["student_weight"], **args)


def _cached(x, **kw):
    args = dict(target_ids=x["target_ids"], target_logprobs=x["target_logprobs"],
                labels=x["labels"])
    args.update(kw)
    return linear_divergence(x["student_hidden"], x["student_weight"], **args)


def test_labels_out_of_range():
    x = make_inputs(n=9, v=50)
    x["labels"][3] = 50
    with pytest.raises(ValueError, match="labels out of range"):
        _live(x)


def test_k_larger_than_vocab_and_ids_out_of_range():
    x = make_inputs(n=9, v=50, k=8)
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        _cached(x, target_ids=torch.zeros(9, 51, dtype=torch.long),
                target_logprobs=torch.zeros(9, 51))
    x["target_ids"][0, 0] = 50
    with pytest.raises(ValueError, match="target_ids out of range"):
        _cached(x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logprobs(bad):
    x = make_inputs(n=9, v=50, k=8)
    x["target_logprobs"][2, 1] = bad
    with pytest.raises(ValueError, match=r"NaN or \+inf"):
        _cached(x)


def test_mismatched_shapes():
    x = make_inputs(n=9, v=50)
    with pytest.raises(ValueError, match="teacher_hidden must be"):
        _live(x, teacher_hidden=x["teacher_hidden"][:8])
    with pytest.raises(ValueError, match="hidden size"):
        linear_divergence(x["student_hidden"][:, :10], x["student_weight"],
                          teacher_hidden=x["teacher_hidden"],
                          teacher_weight=x["teacher_weight"])
    with pytest.raises(ValueError, match="LM heads have"):
        _live(x, teacher_weight=x["teacher_weight"][:49])
    with pytest.raises(ValueError, match="exactly one target"):
        linear_divergence(x["student_hidden"], x["student_weight"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_mismatched_devices():
    x = make_inputs(n=9, v=50)
    with pytest.raises(ValueError, match="one device"):
        _live(x, teacher_hidden=x["teacher_hidden"].cuda())


@pytest.mark.parametrize("elsewhere", ["meta", "cuda"])
def test_cached_targets_on_two_devices_are_named_before_their_values(elsewhere):
    """The cached checks combine the ids' and the log-probs' flags in one transfer; the
    device mismatch is reported first, as itself (a meta tensor stands in for a second device
    on the CPU: its values cannot be read at all)."""
    if elsewhere == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    y = make_inputs(n=9, v=50, k=4)
    for moved in ("target_ids", "target_logprobs"):
        targets = {k: y[k].to(elsewhere) if k == moved else y[k]
                   for k in ("target_ids", "target_logprobs")}
        with pytest.raises(ValueError, match="one device"):
            linear_divergence(y["student_hidden"], y["student_weight"], **targets)
