"""StepTokenCounter: the token counts of each optimizer step, known before the step starts.

Exact normalization needs, at a step's first micro-batch, the valid tokens (and real tokens,
sequences) of all its K micro-batches on all W ranks. The callback wraps the train loader
in a lookahead that pulls one step's window of micro-batches at once, counts them and hands
them on one by one: each batch is loaded once and at most one step's micro-batches wait in
memory. At the window's first micro-batch the callback sums the counts over the ranks and
sets `pl_module.step_counts`.

The window is also where on-policy distillation samples: before counting, the lookahead
hands the window to the module's `rollout_window` (if it has one), which returns the window
with the student's completions in place of the chosen rows. The counts, and so the
normalization, are those of the rewritten window.

Windows follow Lightning's accumulation: within an epoch, micro-batch i belongs to step
i // K, and the epoch's last window may be shorter. On a mid-epoch resume the lookahead puts
the loader back where the checkpoint left it (from the loader's own state when it has one,
else from its shuffle generators as they were when the epoch began), skips the micro-batches
already trained, and cuts the windows at the same boundaries as the uninterrupted run.
"""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

from distill.lightning_version import check_lightning_version
from distill.normalization import StepCounts, count_tensor

# Strategies under which "return loss * K * W" is not the exact compensation.
REFUSED_STRATEGIES = {
    DeepSpeedStrategy: "it runs gradient accumulation and its scaling itself",
    ModelParallelStrategy: "its ranks are not all data-parallel replicas",
}


def check_strategy(strategy) -> None:
    for cls, why in REFUSED_STRATEGIES.items():
        if isinstance(strategy, cls):
            raise ValueError(
                f"{type(strategy).__name__} cannot keep the token normalization exact: {why}. "
                "Use strategy=ddp or fsdp (trainer=ddp), which distill supports and tests."
            )


@dataclass
class _Window:
    start: int  # in-epoch index of its first micro-batch
    size: int  # micro-batches in it
    counts: torch.Tensor  # (3,) int64 [valid, real, sequences] on this rank
    loader_state: dict | None  # a stateful loader's state just before the window


def _generators(loader) -> list[torch.Generator]:
    """The torch generators that decide a plain DataLoader's shuffle order."""
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates = (getattr(loader, "generator", None), getattr(sampler, "generator", None),
                  getattr(getattr(batch_sampler, "sampler", None), "generator", None))
    found: list[torch.Generator] = []
    for g in candidates:
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def _set_generators(loader, states: list[torch.Tensor]) -> None:
    for g, state in zip(_generators(loader), states):
        g.set_state(state)


def _set_sampler_epoch(loader, epoch: int) -> None:
    """Reorder a DistributedSampler-like sampler (its shuffle is seed + epoch) as `epoch`."""
    for sampler in (getattr(loader, "sampler", None),
                    getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


def _is_stateful(loader) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None))


class StepLookahead:
    """The train loader as Lightning sees it once the counter is installed: same length and
    attributes (sampler, dataset...), but iterated through step windows."""

    _OWN = ("loader", "counter", "state_dict", "load_state_dict")

    def __init__(self, loader, counter: StepTokenCounter):
        self.loader, self.counter = loader, counter

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        # Not state_dict: Lightning would save the inner loader's state, which runs up to one
        # window ahead of training; the counter saves the right one itself.
        if name.startswith("__") or name in self._OWN:
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self):
        return self.counter._open_epoch(self)


class _WindowIterator:
    """Yields `source`'s batches one by one, having pulled and counted their window first."""

    def __init__(self, counter: StepTokenCounter, loader, source, start: int, prefetched=()):
        self.counter, self.loader, self.source = counter, loader, source
        self.pos = start  # in-epoch index of the next batch to pull from `source`
        self.buffer: deque = deque()
        self.prefetched = list(prefetched)  # pulled by Lightning's fetcher before we were in

    def __iter__(self):
        return self

    def __next__(self):
        if not self.buffer:
            self._pull_window()
        return self.buffer.popleft()

    def _pull_window(self) -> None:
        k, last = self.counter.accumulate, self.counter.epoch_batches
        start = self.pos - len(self.prefetched)
        end = min((start // k + 1) * k, last)
        state = self.loader.state_dict() if _is_stateful(self.loader) and not self.prefetched \
            else None
        batches = []
        while self.pos < end:
            try:
                batches.append(next(self.source))
            except StopIteration:
                break
            self.pos += 1
        batches = self.counter._rollout(batches, start, bool(self.prefetched))
        counted = self.prefetched + batches
        self.prefetched = []
        if not counted:
            raise StopIteration
        counts = sum(count_tensor(b, self.counter.ignore_index) for b in counted)
        self.counter._windows.append(_Window(start, len(counted), counts, state))
        self.buffer.extend(batches)
        if not self.buffer:  # the window was all prefetched: hand on the next one's batches
            self._pull_window()


class StepTokenCounter(L.Callback):
    """Counts each optimizer step's tokens on all ranks before its first micro-batch and
    sets `pl_module.step_counts` (a `distill.normalization.StepCounts`)."""

    def __init__(self, ignore_index: int = -100):
        self.ignore_index = ignore_index
        self.accumulate = 1
        self.epoch_batches: float = float("inf")
        self._windows: deque[_Window] = deque()  # counted, not started yet
        self._current: _Window | None = None
        self._epoch, self._consumed = 0, 0
        # Lightning's epoch number minus the data's: +1 each time a run is extended from an
        # end-of-run checkpoint (Lightning counts the unfinished epoch as done)
        self._epoch_offset = 0
        self._epoch_rng: list[torch.Tensor] | None = None  # generators as the epoch began
        self._resume: dict | None = None
        self._trainer = None

    # --- Lightning hooks --------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            check_lightning_version()  # the lookahead reads Lightning internals
            check_strategy(trainer.strategy)

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.step_counts = None
        spec = getattr(getattr(pl_module, "loss_fn", None), "spec", None)
        self.ignore_index = getattr(spec, "ignore_index", self.ignore_index)
        self._install(trainer)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._install(trainer)  # a no-op unless the train loader was reloaded

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._windows and self._windows[0].start == batch_idx:
            self._current = self._windows.popleft()
            pl_module.step_counts = self._all_reduce(trainer, self._current)
        w = self._current
        if w is None or not w.start <= batch_idx < w.start + w.size:
            where = f"[{w.start}, {w.start + w.size})" if w else "none"
            raise RuntimeError(
                f"StepTokenCounter: micro-batch {batch_idx} of the epoch is outside the counted "
                f"window ({where}); the train loader was iterated outside the lookahead, so "
                "the step's token counts are unknown"
            )
        self._consumed = batch_idx + 1

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._windows.clear()
        self._current = None

    def state_dict(self) -> dict:
        w = self._current
        loader = self._loader()
        return {"epoch": self._epoch, "consumed": self._consumed, "rng": self._epoch_rng,
                "rng_now": [g.get_state() for g in _generators(loader)] if loader else None,
                "window_start": w.start if w else 0,
                "loader_state": w.loader_state if w else None,
                "accumulate": self.accumulate,
                "batch_size": getattr(loader, "batch_size", None) if loader else None,
                "epoch_offset": self._epoch_offset}

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume = dict(state_dict)

    def _rollout(self, batches: list, start: int, prefetched: bool) -> list:
        module = self._trainer.lightning_module if self._trainer else None
        if not batches or not getattr(module, "rolls_out", False):
            return batches
        if prefetched:
            raise RuntimeError("on-policy distillation rewrites each step's window before it "
                               "runs, but Lightning prefetched some of it (a train loader "
                               "without a length): give the train loader a length")
        return module.rollout_window(batches, self._data_epoch(), start // self.accumulate)

    # --- the lookahead ------------------------------------------------------------------
    def _loader(self):
        combined = self._trainer.fit_loop._combined_loader if self._trainer else None
        wrapped = combined.flattened[0] if combined is not None else None
        return wrapped.loader if isinstance(wrapped, StepLookahead) else None

    def _install(self, trainer) -> None:
        self._trainer = trainer
        self.accumulate = trainer.accumulate_grad_batches
        self.epoch_batches = trainer.num_training_batches
        loop = trainer.fit_loop
        combined = loop._combined_loader
        if combined is None or all(isinstance(d, StepLookahead) for d in combined.flattened):
            return
        if len(combined.flattened) != 1:
            raise ValueError("StepTokenCounter supports one train dataloader, got "
                             f"{len(combined.flattened)}: combine them into one (e.g. a mix)")
        wrapped = StepLookahead(combined.flattened[0], self)
        combined.flattened = [wrapped]
        live = combined._iterator
        if live is None or not live.iterators:
            return  # the next iter() goes through the lookahead
        # Lightning already opened this epoch's iterator: adopt it rather than reopen it,
        # which would draw the shuffle generator again and change the data order.
        live.iterables = combined.flattened
        prefetched = [item[0] for item in getattr(loop._data_fetcher, "batches", [])]
        live.iterators[0] = self._adopt(wrapped, live.iterators[0], prefetched)

    def _open_epoch(self, wrapped: StepLookahead) -> _WindowIterator:
        """A later epoch, opened through the lookahead: note its generators first."""
        self._reset_epoch()
        if self._epoch_offset:  # Lightning set the sampler's epoch to its own number
            _set_sampler_epoch(wrapped.loader, self._data_epoch())
        self._epoch_rng = [g.get_state() for g in _generators(wrapped.loader)]
        return _WindowIterator(self, wrapped.loader, iter(wrapped.loader), 0)

    def _adopt(self, wrapped: StepLookahead, live, prefetched: list) -> _WindowIterator:
        """The epoch Lightning opened at fit start; on resume, moved to the saved position."""
        self._reset_epoch()
        self._epoch_rng = None
        loader = wrapped.loader
        resume, self._resume = self._resume, None
        self._epoch_offset = (resume or {}).get("epoch_offset", 0)
        if resume and self._mid_epoch(resume):
            self._epoch_offset += self._epoch - resume["epoch"]  # 1 after an end-of-run save
            _set_sampler_epoch(loader, self._data_epoch())
            _check_unchanged(resume, self.accumulate, getattr(loader, "batch_size", None))
            if prefetched:
                raise RuntimeError("StepTokenCounter cannot resume mid-epoch when Lightning "
                                   "prefetches (a train loader without a length)")
            return self._resume_epoch(loader, live, resume)
        if resume and resume["epoch"] + 1 == self._epoch and not prefetched \
                and not _is_stateful(loader):
            # saved as its epoch ended: the next epoch draws its order from the generators
            # as they were then, not from the freshly built loader's
            if resume["rng_now"]:
                self._epoch_rng = resume["rng_now"]
                _set_generators(loader, resume["rng_now"])
            if self._restart_index() >= self.epoch_batches:
                # saved when training ended with its epoch: Lightning runs this epoch empty,
                # and opening the loader would draw the next epoch's shuffle seed too early
                self._epoch_offset += 1
                return iter(())
            if resume["rng_now"] or self._epoch_offset:
                _set_sampler_epoch(loader, self._data_epoch())
                return _WindowIterator(self, loader, iter(loader), 0)
        if self._epoch_offset:
            _set_sampler_epoch(loader, self._data_epoch())
        return _WindowIterator(self, loader, live, len(prefetched), prefetched)

    def _data_epoch(self) -> int:
        """The epoch the data are in (a sampler's shuffle seed, the rollouts' seed)."""
        return self._epoch - self._epoch_offset

    def _mid_epoch(self, resume: dict) -> bool:
        """Whether the checkpoint stopped inside an epoch that this run must finish."""
        if not 0 < resume["consumed"] < self.epoch_batches:
            return False
        if resume["epoch"] == self._epoch:
            return True
        # saved when training ended (max_steps) mid-epoch: Lightning counted that epoch as
        # done, yet restarts at its next micro-batch index; the data continue the saved epoch
        return resume["epoch"] + 1 == self._epoch and self._restart_index() == resume["consumed"]

    def _restart_index(self) -> int:
        """The micro-batch index at which Lightning (re)starts the current epoch."""
        return self._trainer.fit_loop.epoch_loop.batch_progress.current.ready

    def _reset_epoch(self) -> None:
        self._windows.clear()
        self._current, self._consumed = None, 0
        self._epoch = self._trainer.current_epoch

    def _resume_epoch(self, loader, live, resume: dict) -> _WindowIterator:
        """Put the loader back at micro-batch `consumed` of the saved epoch."""
        consumed = resume["consumed"]
        if resume["loader_state"] is not None and _is_stateful(loader):
            loader.load_state_dict(resume["loader_state"])
            source, skip = iter(loader), consumed - resume["window_start"]
        elif resume["rng"] is not None:
            _set_generators(loader, resume["rng"])
            source, skip = iter(loader), consumed
        else:  # the epoch Lightning opened at fit start: the loader rebuilds its order
            source, skip = live, consumed
        self._epoch_rng = resume["rng"]
        for _ in range(skip):  # loads the skipped micro-batches once more, on resume only
            next(source)
        # the lookahead resumes the data; Lightning cannot see that and would warn otherwise
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that "
                                "ended before the epoch ended")
        return _WindowIterator(self, loader, source, consumed)

    def _all_reduce(self, trainer, w: _Window) -> StepCounts:
        local = torch.cat([w.counts, torch.tensor([w.size])])
        total = trainer.strategy.reduce(local.to(trainer.strategy.root_device), reduce_op="sum")
        valid, real, sequences, sizes = (int(x) for x in total.cpu().tolist())
        world = trainer.world_size
        if sizes != w.size * world:
            raise RuntimeError(f"ranks disagree on the step's micro-batches ({sizes} in all, "
                               f"{w.size} here, {world} ranks): give every rank the same "
                               "number of batches per epoch")
        return StepCounts(valid=valid, real=real, sequences=sequences, micro_batches=w.size,
                          world_size=world, accumulate=trainer.accumulate_grad_batches)


def _check_unchanged(resume: dict, accumulate: int, batch_size: int | None) -> None:
    """A mid-epoch resume continues the saved step windows: K and the batch size must match."""
    for key, saved, now in (("trainer.accumulate_grad_batches", resume.get("accumulate"),
                             accumulate),
                            ("data.batch_size", resume.get("batch_size"), batch_size)):
        if saved is not None and now is not None and saved != now:
            raise ValueError(
                f"cannot resume mid-epoch with {key}={now}: the checkpoint was written with "
                f"{key}={saved}, so the micro-batches already trained and the step windows "
                f"would not line up (a short or misplaced step). Resume with {key}={saved}; "
                "a change is exact from a checkpoint saved at an epoch's end")
