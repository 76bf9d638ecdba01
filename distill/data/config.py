"""`data:` settings: the sources, how they are tokenized, batched and packed."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from distill.core.rules import (
    Rule,
    boolean,
    choice,
    integer,
    is_int,
    mapping,
    number,
    setting,
    text,
)
from distill.data.files import KINDS


@dataclass(frozen=True)
class SourceConfig:
    """One item of `data.train` / `data.val` (docs/data.md)."""

    LABEL = "source"  # names the item in messages: data.train[0].kind=... (source 'x')
    path: str = setting(rule=Rule(lambda v: isinstance(v, (str, os.PathLike))
                                  and str(v).strip() != "", "a non-empty path"))
    name: str | None = setting(None, text(null=True))
    kind: str = setting("sft", choice(KINDS))
    split: str = setting("train", text())
    field: str | None = setting(None, text(null=True))
    weight: float = setting(1.0, number(0, strict=True, what=" (its share of the mix)"))
    max_examples: int | None = setting(None, integer(1, null=True))
    config: str | None = setting(None, text(null=True))  # a hub data set's configuration

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if v is not None}
        return {**out, "path": str(self.path)}


def _sources(*, empty: bool) -> Rule:
    def ok(v):
        if v is None or (isinstance(v, Sequence) and not isinstance(v, str) and not v):
            return empty
        return isinstance(v, Sequence) and not isinstance(v, str) and all(
            isinstance(s, Mapping) for s in v)
    what = "a non-empty list of sources ({name, kind, path, ...})"
    return Rule(ok, what + (", [] or null" if empty else ""))


@dataclass(frozen=True)
class DataConfig:
    train: list[SourceConfig] = setting(rule=_sources(empty=False))
    val: list[SourceConfig] | None = setting(None, _sources(empty=True))
    batch_size: int = setting(8, integer(1))
    val_batch_size: int | None = setting(None, integer(1, null=True))
    max_length: int = setting(512, integer(2, what=" (tokens per row: room for a token and "
                                                "its next)"))
    packing: bool = setting(False, boolean())
    shuffle: bool = setting(True, boolean())
    num_workers: int = setting(0, integer(0))
    seed: int = setting(0, integer(0))
    # null: 64 where the batches go to a CUDA device (sdpa's cuDNN kernel builds a graph
    # for each new length), 1 elsewhere; packed rows are padded to max_length
    pad_to_multiple_of: int | None = setting(None, integer(1, null=True))
    chat_template: str | None = setting(None, text(null=True))
    assistant_turns: str = setting("all", choice(("all", "last")))
    cpt_stride: int | None = setting(None, integer(1, null=True, what=" (null: max_length - 1)"))
    chat_template_kwargs: dict | None = setting(None, mapping())
    num_proc: int | None = setting(None, integer(1, null=True))
    mix_stopping: str = setting("first_exhausted", choice(("first_exhausted",
                                                          "all_exhausted")))
    # cross-tokenizer runs (loss.cross_tokenizer): the teacher's side of each example
    teacher_chat_template: str | None = setting(None, text(null=True))  # null: its tokenizer's
    teacher_max_length: int | None = setting(None, integer(2, null=True,
                                                           what=" (null: max_length)"))

    def problems(self, prefix: str = "") -> list[str]:
        out = []
        # examples are known by `name:row` (the teacher cache included): two sources of one
        # split and one name would give two examples one id (a val source named like a train
        # one gets ids of its own: DistillDataModule)
        for split, items in (("train", self.train), ("val", self.val or [])):
            names = [s.name or str(s.path) for s in items]
            for dup in sorted({n for n in names if names.count(n) > 1}):
                where = [f"{prefix}{split}[{i}]" for i, n in enumerate(names) if n == dup]
                out.append(f"{' and '.join(where)} are both named {dup!r}: each source needs "
                           "a name of its own (examples are identified as name:row, in the "
                           "logs and by the teacher cache, where two sources of one name "
                           "collide); give them distinct `name`s")
        if is_int(self.cpt_stride) and self.cpt_stride > self.max_length:
            out.append(f"{prefix}cpt_stride={self.cpt_stride}: must be between 1 and "
                       f"{prefix}max_length ({self.max_length})")
        return out
