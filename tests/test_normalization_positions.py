"""The weight of every position under every policy, against tables worked out by hand.

One small micro-batch holds what makes policies differ: a row with two packed documents
(position_ids restart at 0; the position before a document's first token predicts across
the boundary and is never trained), a right-padded SFT row, an empty row (no label at
all) and a fully trained CPT row, so the sequences have 2, 3, 2 and 7 valid positions.
The step's counts are bigger than the micro-batch's own (K micro-batches on W ranks).
Position t predicts token t + 1: a batch of length 8 has 7 positions per row.
"""

import pytest
import torch

from distill.data.masks import StepCounts, batch_masks
from distill.training.normalization import POLICIES, token_weights

X = -100
BATCH = {
    "input_ids": torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8],
                               [1, 2, 3, 4, 5, 0, 0, 0],
                               [1, 2, 3, 0, 0, 0, 0, 0],
                               [1, 2, 3, 4, 5, 6, 7, 8]]),
    "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1],
                                    [1, 1, 1, 1, 1, 0, 0, 0],
                                    [1, 1, 1, 0, 0, 0, 0, 0],
                                    [1, 1, 1, 1, 1, 1, 1, 1]]),
    # row 0: document A = tokens 0-2, document B = tokens 3-7; padding restarts at 0 too
    "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4],
                                  [0, 1, 2, 3, 4, 0, 0, 0],
                                  [0, 1, 2, 0, 0, 0, 0, 0],
                                  [0, 1, 2, 3, 4, 5, 6, 7]]),
    # row 0: B's first token (index 3) has a label, but nothing in B predicts it; B's
    # second is prompt. Row 1: prompt, two answer tokens, padding. Row 2: nothing trained.
    "labels": torch.tensor([[X, 12, 13, 14, X, 16, 17, 18],
                            [X, X, X, 24, 25, X, X, X],
                            [X, X, X, X, X, X, X, X],
                            [X, 42, 43, 44, 45, 46, 47, 48]]),
}
# by hand, position by position (1 = yes)
VALID = [[1, 1, 0, 0, 1, 1, 1],  # A: 2 valid; position 2 would predict across A|B
         [0, 0, 1, 1, 0, 0, 0],
         [0, 0, 0, 0, 0, 0, 0],
         [1, 1, 1, 1, 1, 1, 1]]
REAL = [[1, 1, 0, 1, 1, 1, 1],  # position 3 (B's prompt) is real, not valid
        [1, 1, 1, 1, 0, 0, 0],  # position 4 predicts padding
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1]]
LOCAL = {"valid": 14, "real": 19, "sequences": 4}  # sequences with a valid position
# the step: this micro-batch and others, K = 3 micro-batches in the window (the configured
# accumulate is 4: an epoch's short last window) on W = 2 ranks
STEP = StepCounts(valid=56, real=95, sequences=16, micro_batches=3, world_size=2,
                  accumulate=4)
_ = 0.0
WEIGHTS = {
    "valid_tokens": [[1 / 56, 1 / 56, _, _, 1 / 56, 1 / 56, 1 / 56],
                     [_, _, 1 / 56, 1 / 56, _, _, _],
                     [_, _, _, _, _, _, _],
                     [1 / 56] * 7],
    "all_tokens": [[1 / 95, 1 / 95, _, _, 1 / 95, 1 / 95, 1 / 95],
                   [_, _, 1 / 95, 1 / 95, _, _, _],
                   [_, _, _, _, _, _, _],
                   [1 / 95] * 7],
    # 1 / (local valid 14 * K 3 * W 2)
    "micro_batch_valid_tokens": [[1 / 84, 1 / 84, _, _, 1 / 84, 1 / 84, 1 / 84],
                                 [_, _, 1 / 84, 1 / 84, _, _, _],
                                 [_, _, _, _, _, _, _],
                                 [1 / 84] * 7],
    # 1 / (valid in its sequence * 16): A 2, B 3, row 1 2, row 3 7
    "sequence_mean": [[1 / 32, 1 / 32, _, _, 1 / 48, 1 / 48, 1 / 48],
                      [_, _, 1 / 32, 1 / 32, _, _, _],
                      [_, _, _, _, _, _, _],
                      [1 / 112] * 7],
}


def table(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_masks_and_counts_position_by_position():
    masks = batch_masks(BATCH)
    assert masks.valid.tolist() == [[bool(v) for v in row] for row in VALID]
    assert masks.real.tolist() == [[bool(v) for v in row] for row in REAL]
    assert int(masks.valid.sum()) == LOCAL["valid"] and int(masks.real.sum()) == LOCAL["real"]
    # the two documents of row 0 are two sequences; the empty row is none
    seq = masks.sequence[masks.valid]
    assert len(torch.unique(seq)) == LOCAL["sequences"]
    assert masks.sequence[0, 0] == masks.sequence[0, 1] != masks.sequence[0, 4]


def test_the_tables_follow_the_definitions():
    """The tables above, re-derived from the design's formulas on the hand counts (so a typo
    in one of them shows), and each policy's total for the micro-batch."""
    seq_len = [[2, 2, _, _, 3, 3, 3], [_, _, 2, 2, _, _, _], [_] * 7, [7] * 7]
    for policy, rows in WEIGHTS.items():
        for i, row in enumerate(rows):
            for j, w in enumerate(row):
                if not VALID[i][j]:
                    assert w == 0, (policy, i, j)
                    continue
                want = {"valid_tokens": 1 / STEP.valid, "all_tokens": 1 / STEP.real,
                        "micro_batch_valid_tokens": 1 / (LOCAL["valid"] * 3 * 2),
                        "sequence_mean": 1 / (seq_len[i][j] * STEP.sequences)}[policy]
                assert w == pytest.approx(want, rel=1e-12), (policy, i, j)
    totals = {p: sum(map(sum, rows)) for p, rows in WEIGHTS.items()}
    assert totals["sequence_mean"] == pytest.approx(4 / 16)  # 4 of the step's 16 sequences


@pytest.mark.parametrize("policy", POLICIES)
def test_weight_of_every_position(policy):
    w = token_weights(policy, batch_masks(BATCH), STEP)
    assert w.shape == (4, 7) and w.dtype == torch.float32
    torch.testing.assert_close(w, table(WEIGHTS[policy]), rtol=1e-6, atol=0)


def test_a_uniform_sequence_mean_would_fail():
    """Spreading the micro-batch's 4/16 evenly over its 14 valid positions (1/56 each) has
    the right total but the wrong weight at every position."""
    uniform = table(VALID) * (4 / 16) / 14
    want = table(WEIGHTS["sequence_mean"])
    assert torch.isclose(uniform.sum(), want.sum())
    assert not torch.allclose(uniform, want, rtol=1e-3, atol=0)
    got = token_weights("sequence_mean", batch_masks(BATCH), STEP)
    assert not torch.allclose(got, uniform, rtol=1e-3, atol=0)


def test_without_position_ids_a_row_is_one_sequence():
    """No position_ids: row 0 is one sequence of 6 valid positions (position 2 included);
    step K = 2, W = 3 with valid 60, real 100, sequences 12."""
    batch = {k: v for k, v in BATCH.items() if k != "position_ids"}
    masks = batch_masks(batch)
    assert masks.valid[0].tolist() == [True, True, True, False, True, True, True]
    assert int(masks.valid.sum()) == 15 and int(masks.real.sum()) == 20
    step = StepCounts(valid=60, real=100, sequences=12, micro_batches=2, world_size=3,
                      accumulate=2)
    row0, row1 = [1, 1, 1, _, 1, 1, 1], [_, _, 1, 1, _, _, _]
    want = {
        "valid_tokens": [[w / 60 for w in row0], [w / 60 for w in row1], [_] * 7, [1 / 60] * 7],
        "all_tokens": [[w / 100 for w in row0], [w / 100 for w in row1], [_] * 7,
                       [1 / 100] * 7],
        "micro_batch_valid_tokens": [[w / 90 for w in row0], [w / 90 for w in row1], [_] * 7,
                                     [1 / 90] * 7],  # 1 / (15 * 2 * 3)
        "sequence_mean": [[w / 72 for w in row0], [w / 24 for w in row1], [_] * 7,
                          [1 / 84] * 7],  # 1 / (6 * 12), 1 / (2 * 12), 1 / (7 * 12)
    }
    for policy in POLICIES:
        torch.testing.assert_close(token_weights(policy, masks, step), table(want[policy]),
                                   rtol=1e-6, atol=0, msg=policy)


def _rows(batch, rows):
    return {k: v[rows] for k, v in batch.items()}


def test_a_split_step_weighs_each_position_as_one_big_batch():
    """The batch as one step of two uneven micro-batches (rows 0 and 3: 12 valid; rows 1
    and 2: 2 valid) with the step's counts (valid 14, real 19, sequences 4, K = 2): the
    exact policies give every position the weight it has when the batch is one micro-batch;
    the per-micro-batch mean does not: 1 / (12 * 2) and 1 / (2 * 2) instead of 1 / 14."""
    whole = StepCounts(valid=14, real=19, sequences=4)
    split = StepCounts(valid=14, real=19, sequences=4, micro_batches=2, accumulate=2)

    def weights(policy, rows, step):
        return token_weights(policy, batch_masks({k: v[rows] for k, v in BATCH.items()}), step)

    for policy in ("valid_tokens", "all_tokens", "sequence_mean"):
        big = token_weights(policy, batch_masks(BATCH), whole)
        a, b = weights(policy, [0, 3], split), weights(policy, [1, 2], split)
        torch.testing.assert_close(torch.stack([a[0], b[0], b[1], a[1]]), big, rtol=1e-6,
                                   atol=0, msg=policy)
    a = weights("micro_batch_valid_tokens", [0, 3], split)
    b = weights("micro_batch_valid_tokens", [1, 2], split)
    torch.testing.assert_close(a[0], table([1 / 24, 1 / 24, _, _, 1 / 24, 1 / 24, 1 / 24]),
                               rtol=1e-6, atol=0)
    torch.testing.assert_close(b[0], table([_, _, 1 / 4, 1 / 4, _, _, _]), rtol=1e-6, atol=0)
