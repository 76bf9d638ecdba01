"""Step windows (distill/data/windows.py) in one process, against counts and positions
written out by hand: a window's counts are its micro-batches' sums, the step's are summed
over the ranks, and a checkpoint's position resumes at the next micro-batch to train."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from distill.data.windows import (
    StepWindows,
    WindowCollate,
    WindowSampler,
    count_window,
    reduce_counts,
    window_of,
)


def _batch(labels: list[list[int]], attn: list[list[int]]) -> dict:
    return {"labels": torch.tensor(labels), "attention_mask": torch.tensor(attn),
            "input_ids": torch.ones(len(labels), len(labels[0]), dtype=torch.long)}


# positions t = 0..3 of each row predict token t + 1: valid where labels[t + 1] is set and
# both tokens are real; real where both are
A = _batch([[-100, 5, 6, -100, -100], [-100, -100, 7, 8, 9]],
           [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])  # valid 2 + 3, real 3 + 4, sequences 2
B = _batch([[-100, -100, -100]], [[1, 1, 1]])  # valid 0, real 2, sequences 0
C = _batch([[4, 4, 4, -100]], [[1, 1, 0, 0]])  # valid 1, real 1, sequences 1


def test_a_windows_counts_are_the_sums_of_its_micro_batches():
    assert count_window([A]).tolist() == [5, 7, 2]
    assert count_window([B]).tolist() == [0, 2, 0]
    assert count_window([C]).tolist() == [1, 1, 1]
    assert count_window([A, B, C]).tolist() == [6, 10, 3]


class _Ranks:
    """A strategy whose reduce sums this rank's tensor with the other ranks' (given)."""

    def __init__(self, others):
        self.others, self.root_device = others, torch.device("cpu")

    def reduce(self, t, reduce_op):
        assert reduce_op == "sum"
        return t + sum(self.others)


class _Trainer:
    def __init__(self, others, k):
        self.strategy, self.world_size, self.accumulate_grad_batches = _Ranks(others), 2, k


def test_the_steps_counts_are_summed_over_the_ranks():
    """Rank 0 holds [A, B] of a K = 3 window (its last, short), rank 1 [C, C]."""
    windows = list(StepWindows.from_loader([A, B], 3))
    info = window_of(windows[0])
    other = torch.cat([count_window([C, C]), torch.tensor([2])])
    step = reduce_counts(_Trainer([other], k=3), info)
    assert (step.valid, step.real, step.sequences) == (5 + 2, 9 + 2, 2 + 2)
    assert (step.micro_batches, step.world_size, step.accumulate) == (2, 2, 3)


def _loader(n_examples: int, batch_size: int, k: int) -> StepWindows:
    sampler = WindowSampler(n_examples, batch_size, k, shuffle=False, seed=0)
    data = [{"id": i} for i in range(n_examples)]

    def collate(examples):  # one trained position per example
        n = len(examples)
        return {"ids": [e["id"] for e in examples], **_batch([[-100, 1]] * n, [[1, 1]] * n)}

    loader = DataLoader(data, batch_sampler=sampler, collate_fn=WindowCollate(collate, batch_size))
    return StepWindows(loader, sampler, k, batch_size)


def _train(windows: StepWindows, n: int | None = None) -> list[list[int]]:
    """The examples of each micro-batch trained, marking each as the counter does."""
    out = []
    for batch in windows:
        if n is not None and len(out) == n:
            break
        windows.mark(window_of(batch))
        out.append(batch["ids"])
    return out


def test_a_checkpoint_resumes_at_the_next_micro_batch():
    """14 examples in micro-batches of 2, K = 3: windows of micro-batches 0-2, 3-5, 6. A
    state saved after two windows resumes at micro-batch 6 (examples 12 and 13), and one
    saved after the first at micro-batch 3, in both kinds of step window."""
    whole = _train(_loader(14, 2, 3))
    assert whole == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13]]
    for trained in (3, 6):
        for make in (lambda: _loader(14, 2, 3),
                     lambda: StepWindows.from_loader([{"ids": b, **B} for b in whole], 3)):
            first = make()
            assert _train(first, trained) == whole[:trained]
            state = first.state_dict()
            assert (state["epoch"], state["position"]) == (0, trained)
            resumed = make()
            resumed.load_state_dict(state)
            assert _train(resumed) == whole[trained:]
