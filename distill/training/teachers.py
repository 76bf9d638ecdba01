"""Teachers give the loss its targets for a batch: live hidden states or cached top-k.

Both implement `Teacher`: `targets(batch)` returns the keyword arguments of
`linear_divergence` for the batch's flattened, shifted positions (position t of a row
predicts token t + 1), and `prepare(datamodule, tokenizer)` runs once before training.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from distill.core.constants import MODEL_DTYPES
from distill.core.rules import choice, setting, text
from distill.data.shift import shift_flat
from distill.models.causal_lm import final_hidden_states, lm_head, load_causal_lm
from distill.ops.spec import SPARSE_MODES

KINDS = ("live", "cached")


@dataclass(frozen=True)
class TeacherConfig:
    """`teacher:` a model run beside the student (live), or the cache it wrote (cached)."""

    name_or_path: str = setting(rule=text())  # cached: the model the cache was written with
    kind: str = setting("live", choice(KINDS))
    dtype: str = setting("float32", choice(tuple(MODEL_DTYPES)))
    attn_implementation: str | None = setting(None, text(null=True))
    tokenizer: str | None = setting(None, text(null=True))  # null: the teacher's folder

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.name_or_path


class Teacher(Protocol):
    model: torch.nn.Module | None  # the live model; None for a cached teacher

    def targets(self, batch: dict) -> dict: ...

    def prepare(self, datamodule, tokenizer) -> None: ...


class LiveTeacher(torch.nn.Module):
    """A frozen causal LM run beside the student on the same input_ids, under no_grad.

    Only its base model runs; the loss receives its last hidden state and LM-head weight,
    so the teacher's logits are never built either.
    """

    def __init__(self, model: torch.nn.Module | str, dtype: str = "float32",
                 attn_implementation: str | None = None):
        """`model`: a causal LM in memory, or a folder / hub name to load it from."""
        super().__init__()
        if isinstance(model, (str, os.PathLike)):
            self.name = str(model)
            model = load_causal_lm(self.name, dtype=dtype,
                                   attn_implementation=attn_implementation)
        else:
            self.name = type(model).__name__
        self.model = model.requires_grad_(False)
        self.eval()

    @classmethod
    def load(cls, cfg: TeacherConfig) -> LiveTeacher:
        return cls(cfg.name_or_path, cfg.dtype, cfg.attn_implementation)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> LiveTeacher:
        """A teacher around a model already in memory (benchmarks, the Python API)."""
        return cls(model)

    def train(self, mode: bool = True):
        # Lightning puts the whole LightningModule in train mode; the teacher stays in eval.
        return super().train(False)

    def prepare(self, datamodule, tokenizer) -> None:
        """Nothing to check: the tokenizers were compared when the run was set up."""

    @torch.no_grad()
    def targets(self, batch: dict) -> dict:
        hidden = final_hidden_states(self.model, batch["input_ids"],
                                     batch.get("attention_mask"), batch.get("position_ids"))
        weight, head = lm_head(self.model)
        return {"teacher_hidden": shift_flat(hidden), "teacher_weight": weight,
                "teacher_head": head}


class CachedTeacher(torch.nn.Module):
    """Top-k teacher log-probs read from the offline cache: no teacher model is loaded.

    The cache must have been written for this run: its teacher, K and temperature are
    checked here, its tokenizer, max length and data fingerprints by `prepare`, and every
    example's tokens when its batch is served. The loss applies `sparse_mode` (tail bucket
    or renormalize) to the returned (N, K) targets.
    """

    model = None  # nothing to run, evaluate or checkpoint

    def __init__(self, dir: str, teacher: str, top_k: int, temperature: float = 1.0,
                 sparse_mode: str = "tail"):
        super().__init__()
        from distill.cache.reader import TeacherCache

        if sparse_mode not in SPARSE_MODES:
            raise ValueError(f"sparse_mode must be one of {SPARSE_MODES}, got {sparse_mode!r}")
        self.cache = TeacherCache(dir)
        self.cache.expect("teacher", str(teacher))
        self.cache.expect("top_k", int(top_k))
        self.cache.expect("temperature", float(temperature))
        self.sparse_mode, self.name = sparse_mode, str(teacher)

    def prepare(self, datamodule, tokenizer) -> None:
        self.check_data(datamodule, tokenizer)
        self.prefetch_in(datamodule)

    def check_data(self, datamodule, tokenizer) -> None:
        """Refuse a cache written for another tokenizer, max length or data."""
        from distill.cache.plan import describe

        self.cache.check_tokenizer(tokenizer)
        self.cache.expect("max_length", int(datamodule.max_length))
        datamodule.setup("fit")
        # the cache is per example: packed rows are checked by the examples they hold
        train = getattr(datamodule, "train_examples", None) or datamodule.train_set
        for split, ds in (("train", train), ("val", datamodule.val_set)):
            if ds is not None:
                self.cache.check_split(split, describe(ds).fingerprint)

    def prefetch_in(self, datamodule) -> None:
        """Read each batch's targets in the DataLoader's collate: in its workers when
        data.num_workers > 0, so the cache is read ahead of training, and on CPU tensors
        either way, so the step needs no host sync."""
        datamodule.collate = TargetsCollate(datamodule.collate, self.cache)

    @torch.no_grad()
    def targets(self, batch: dict) -> dict:
        if "target_ids" in batch:  # read by the loader (prepare)
            ids, logprobs = batch["target_ids"], batch["target_logprobs"]
        else:
            ids, logprobs = self.cache.batch_targets(batch)
        device = batch["input_ids"].device
        return {"target_ids": ids.to(device, non_blocking=True),
                "target_logprobs": logprobs.to(device, non_blocking=True)}


class TargetsCollate:
    """A collate function followed by the batch's cached targets (picklable, for workers)."""

    def __init__(self, collate, cache):
        self.collate, self.cache = collate, cache

    def __call__(self, examples):
        batch = self.collate(examples)
        batch["target_ids"], batch["target_logprobs"] = self.cache.batch_targets(batch)
        return batch


def build_teacher(cfg: TeacherConfig, cache_dir: str | None, top_k: int | None,
                  temperature: float, sparse_mode: str) -> LiveTeacher | CachedTeacher:
    """The run's teacher (one with its own tokenizer: distill.xtok.setup.CrossSetup.teacher)."""
    if cfg.kind == "live":
        return LiveTeacher.load(cfg)
    return CachedTeacher(cache_dir, cfg.name_or_path, top_k, temperature, sparse_mode)

