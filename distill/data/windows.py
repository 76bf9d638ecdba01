"""Step windows: the train loader hands out each optimizer step's micro-batches as a window.

Exact normalization needs, at a step's first micro-batch, the token counts of all K
micro-batches of the step on all W ranks. So the loader works in windows: a batch sampler
yields the indices of one window (K micro-batches), the collate function builds its K
micro-batches and counts them, in the loader's workers, and `StepWindows`, the iterable
Lightning sees as the train loader, hands the micro-batches on one by one, each carrying
a `WindowInfo` (`batch["window"]`) with the window's counts and the window itself. The
`StepTokenCounter` callback sums the counts over the ranks at the window's first
micro-batch; an on-policy module rewrites the window in its training step first.

Windows follow Lightning's accumulation: micro-batch i of an epoch belongs to step i // K,
and an epoch's last window may be shorter. `StepWindows` is stateful through Lightning's
public loader-state interface (`state_dict` / `load_state_dict`): a checkpoint records
the epoch and the micro-batches trained in it, and a resumed run starts the epoch's order
(a function of the seed and the epoch alone) at that position, without loading a skipped
batch. Any iterable of micro-batches can be windowed too (`StepWindows.from_loader`);
its windows are then counted in the main process.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from distill.core.constants import IGNORE_INDEX
from distill.data.masks import StepCounts, count_tensor


@dataclass
class Window:
    """One optimizer step's micro-batches on this rank, and their counts. Shared by the
    window's micro-batches: what the step adds to it (samples, the summed counts) is seen
    by all of them."""

    batches: list[dict]
    counts: torch.Tensor  # (3,) int64 [valid, real, sequences]
    rolled: list[dict] | None = None  # the window rewritten by an on-policy step
    step_counts: StepCounts | None = None  # summed over the ranks


def count_window(batches: list[dict], ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    return sum((count_tensor(b, ignore_index) for b in batches),
               torch.zeros(3, dtype=torch.int64))


class WindowCollate:
    """A micro-batch collate applied to a window's examples, `batch_size` at a time, then
    counted: the loader's workers do both."""

    def __init__(self, collate, batch_size: int):
        self.collate, self.batch_size = collate, batch_size

    def __call__(self, examples: list) -> Window:
        b = self.batch_size
        batches = [self.collate(examples[i:i + b]) for i in range(0, len(examples), b)]
        return Window(batches, count_window(batches))


class WindowSampler:
    """The dataset indices of each window of an epoch, for one rank of W.

    The epoch's order is a function of (seed, epoch) alone: a random permutation when
    shuffling, else dataset order; padded by wrapping around to a multiple of W, rank r
    takes every W-th index from r, as torch's DistributedSampler does. `epoch` and `start`
    (the first micro-batch) are set before each pass.
    """

    def __init__(self, size: int, batch_size: int, accumulate: int, *, shuffle: bool,
                 seed: int, rank: int = 0, world_size: int = 1):
        if size == 0:
            raise ValueError("the training set is empty")
        self.size, self.batch_size, self.accumulate = size, batch_size, accumulate
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.epoch, self.start = 0, 0

    @property
    def per_rank(self) -> int:
        return math.ceil(self.size / self.world_size)

    def micro_batches(self) -> int:
        return math.ceil(self.per_rank / self.batch_size)

    def order(self, epoch: int) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (1 << 62))
            order = torch.randperm(self.size, generator=g).tolist()
        else:
            order = list(range(self.size))
        total = self.per_rank * self.world_size
        order = (order * math.ceil(total / self.size))[:total]
        return order[self.rank::self.world_size]

    def __len__(self) -> int:  # windows in a pass
        k = self.accumulate
        first = self.start // k
        return math.ceil(self.micro_batches() / k) - first

    def __iter__(self):
        order, b, k = self.order(self.epoch), self.batch_size, self.accumulate
        for w in range(self.start // k, math.ceil(self.micro_batches() / k)):
            yield order[w * k * b:(w + 1) * k * b]


class WindowInfo:
    """What a micro-batch knows of its step (not a dataclass: Lightning would move it)."""

    __slots__ = ("epoch", "number", "start", "index", "size", "first", "window", "owner")

    def __init__(self, *, epoch, number, start, index, size, first, window, owner):
        self.epoch, self.number, self.start, self.index = epoch, number, start, index
        self.size, self.first, self.window, self.owner = size, first, window, owner

    @property
    def batches(self) -> list[dict]:
        return self.window.batches

    @property
    def counts(self) -> torch.Tensor:
        return self.window.counts

    @property
    def rolled(self) -> list[dict] | None:
        return self.window.rolled

    @rolled.setter
    def rolled(self, value) -> None:
        self.window.rolled = value

    @property
    def step_counts(self) -> StepCounts | None:
        return self.window.step_counts

    @step_counts.setter
    def step_counts(self, value) -> None:
        self.window.step_counts = value

    @property
    def position(self) -> int:
        """In-epoch index of this micro-batch."""
        return self.start + self.index


def window_of(batch) -> WindowInfo | None:
    return batch.get("window") if isinstance(batch, dict) else None


class StepWindows:
    """The train loader as Lightning sees it: sized, iterable, stateful; see module doc."""

    def __init__(self, loader, sampler: WindowSampler | None, accumulate: int,
                 batch_size: int | None = None, world_size: int = 1):
        self.loader, self.sampler, self.accumulate = loader, sampler, accumulate
        self.batch_size, self.world_size = batch_size, world_size
        self._next_epoch, self._resume = 0, None
        self._trained = (0, 0)  # (epoch, micro-batches of it trained or being trained)

    @classmethod
    def from_loader(cls, loader: Iterable, accumulate: int) -> StepWindows:
        """Windows of K consecutive micro-batches of any sized iterable (a DataLoader of
        ready batches, say), counted in the main process. A resume replays the loader up to
        the saved position; a sampler with `set_epoch` gets the data epoch first."""
        return cls(loader, None, accumulate, getattr(loader, "batch_size", None))

    def __len__(self) -> int:
        return self.sampler.micro_batches() if self.sampler else len(self.loader)

    # --- state (Lightning saves it in checkpoints and restores it before iter()) -------
    def mark(self, info: WindowInfo) -> None:
        """Called as micro-batch `info` starts training (by the StepTokenCounter)."""
        self._trained = (info.epoch, info.position + 1)

    def state_dict(self) -> dict:
        epoch, position = self._trained
        return {"epoch": epoch, "position": position, "accumulate": self.accumulate,
                "batch_size": self.batch_size, "world_size": self.world_size,
                "length": len(self)}

    def load_state_dict(self, state: dict) -> None:
        self._resume = dict(state)

    def _start(self) -> tuple[int, int]:
        resume, self._resume = self._resume, None
        if resume is None:
            return self._next_epoch, 0
        epoch, position = int(resume["epoch"]), int(resume["position"])
        if position >= resume.get("length", len(self)):
            return epoch + 1, 0  # saved as its epoch ended
        if position > 0:
            _check_unchanged(resume, self.accumulate, self.batch_size, self.world_size)
            if position % self.accumulate:
                warnings.warn(
                    f"resuming in the middle of a step window (micro-batch {position} of the "
                    f"epoch, K={self.accumulate}): the micro-batches of that step trained "
                    "before the checkpoint are not in it, so its gradient is partial. "
                    "distill saves at step ends; a checkpoint saved mid-step comes from "
                    "elsewhere", UserWarning, stacklevel=2)
        return epoch, position

    # --- iteration ----------------------------------------------------------------------
    def __iter__(self):
        epoch, position = self._start()
        self._next_epoch = epoch + 1
        self._trained = (epoch, position)
        windows = self._windows(epoch, position)
        k = self.accumulate
        number = position // k
        skip = position - number * k
        for window in windows:
            size = len(window.batches)
            for index in range(skip, size):
                info = WindowInfo(epoch=epoch, number=number, start=number * k, index=index,
                                  size=size, first=index == skip, window=window, owner=self)
                yield {**window.batches[index], "window": info}
            number, skip = number + 1, 0

    def _windows(self, epoch: int, position: int):
        k = self.accumulate
        if self.sampler is not None:
            self.sampler.epoch, self.sampler.start = epoch, (position // k) * k
            yield from self.loader
            return
        sampler = getattr(self.loader, "sampler", None)
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)
        source = iter(self.loader)
        for _ in range((position // k) * k):  # a plain loader can only be replayed
            next(source)
        batches = []
        for batch in source:
            batches.append(batch)
            if len(batches) == k:
                yield Window(batches, count_window(batches))
                batches = []
        if batches:
            yield Window(batches, count_window(batches))


def _check_unchanged(saved: dict, accumulate: int, batch_size, world_size: int) -> None:
    """A mid-epoch resume continues the saved windows: K, the batch size and the number of
    ranks must be the same."""
    for key, was, now in (("trainer.accumulate_grad_batches", saved.get("accumulate"),
                           accumulate),
                          ("data.batch_size", saved.get("batch_size"), batch_size),
                          ("the number of ranks", saved.get("world_size"), world_size)):
        if was is not None and now is not None and was != now:
            raise ValueError(
                f"cannot resume mid-epoch with {key}={now}: the checkpoint was written with "
                f"{key}={was}, so the micro-batches already trained and the step windows "
                f"would not line up (a short or misplaced step). Resume with {key}={was}; "
                "a change is exact from a checkpoint saved at an epoch's end")


def reduce_counts(trainer, info: WindowInfo, counts=None) -> StepCounts:
    """The window's counts summed over the ranks (every rank calls it at the same window);
    `counts` replaces the window's own (an on-policy step recounts its rewritten rows)."""
    local = torch.cat([info.counts if counts is None else counts, torch.tensor([info.size])])
    strategy = trainer.strategy
    total = strategy.reduce(local.to(strategy.root_device), reduce_op="sum")
    valid, real, sequences, sizes = (int(x) for x in total.cpu().tolist())
    world = trainer.world_size
    if sizes != info.size * world:
        raise RuntimeError(f"ranks disagree on the step's micro-batches ({sizes} in all, "
                           f"{info.size} here, {world} ranks): give every rank the same "
                           "number of batches per epoch")
    return StepCounts(valid=valid, real=real, sequences=sequences, micro_batches=info.size,
                      world_size=world, accumulate=trainer.accumulate_grad_batches)
