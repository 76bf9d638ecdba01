"""Policies -> per-token weights on hand-made masks: counts, weights, the empty step, the
once-only warning of the biased per-micro-batch mean."""

import warnings

import pytest
import torch

from distill.data import masks as masks_mod
from distill.training import normalization as norm

# two rows: a prompt-masked SFT row (3 valid of 5 real) and a padded CPT row (2 of 2)
BATCH = {
    "input_ids": torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 0, 0, 0]]),
    "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]),
    "labels": torch.tensor([[-100, -100, -100, 8, 9, 10], [5, 6, 7, -100, -100, -100]]),
}


def test_counts_of_a_micro_batch():
    masks = masks_mod.batch_masks(BATCH)
    assert masks_mod.count(masks) == {"valid": 5, "real": 7, "sequences": 2}
    assert masks_mod.count_tensor(BATCH).tolist() == [5, 7, 2]


def test_packed_rows_count_documents_and_skip_boundaries():
    batch = {**BATCH, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 0, 0]])}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    masks = masks_mod.batch_masks(batch)
    # row 0: two documents of 3; the position predicting the second's first token is not real
    assert masks.real[0].tolist() == [True, True, False, True, True]
    assert masks_mod.count(masks)["sequences"] == 2


@pytest.mark.parametrize("policy", norm.POLICIES)
def test_weights_sum_to_the_policy_total(policy):
    masks = masks_mod.batch_masks(BATCH)
    step = masks_mod.StepCounts(valid=20, real=40, sequences=8, micro_batches=2, world_size=2,
                           accumulate=4)
    w = norm.token_weights(policy, masks, step)
    assert (w[~masks.valid] == 0).all()
    want = {"valid_tokens": 5 / 20, "all_tokens": 5 / 40, "sequence_mean": 2 / 8,
            "micro_batch_valid_tokens": 1 / (2 * 2)}[policy]
    torch.testing.assert_close(w.sum().item(), want)


@pytest.mark.parametrize("policy", norm.POLICIES)
def test_an_empty_step_gives_zero_weights(policy):
    batch = {**BATCH, "labels": torch.full_like(BATCH["labels"], -100)}
    masks = masks_mod.batch_masks(batch)
    w = norm.token_weights(policy, masks, masks_mod.StepCounts(valid=0, real=7, sequences=0))
    assert torch.isfinite(w).all() and (w == 0).all()


def test_micro_batch_mean_warns_once_and_only_when_biased():
    norm._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        norm.warn_if_biased("micro_batch_valid_tokens", 1, 1)  # one micro-batch: exact
        norm.warn_if_biased("valid_tokens", 4, 2)
    with pytest.warns(UserWarning, match="biased"):
        norm.warn_if_biased("micro_batch_valid_tokens", 4, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        norm.warn_if_biased("micro_batch_valid_tokens", 4, 2)


def test_unknown_policy_lists_the_choices():
    with pytest.raises(ValueError, match="valid_tokens, all_tokens"):
        norm.check_policy("tokens")
