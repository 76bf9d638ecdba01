"""Data sets held in memory (a `datasets.Dataset`, or a list of dicts) as data sources.

A source's `path` is a file, a folder or a hub name; `register(data)` gives an in-memory
data set a path of its own, `memory://<name>`, so it goes through the same config, schema,
tokenization and error messages as a file (distill.fit uses it). The rows have the columns
`distill/data/sources.py` reads: `messages` or `prompt` + `completion` (sft), `text` (cpt),
`prompt` (prompts).
"""

from __future__ import annotations

import itertools

import datasets

from distill.data.files import columns, source_name

PREFIX = "memory://"
_HELD: dict[str, datasets.Dataset] = {}
_NUMBERS = itertools.count()


def as_dataset(data) -> datasets.Dataset:
    if isinstance(data, datasets.Dataset):
        return data
    if isinstance(data, (list, tuple)) and all(isinstance(r, dict) for r in data):
        return datasets.Dataset.from_list(list(data))
    raise TypeError(f"an in-memory data set is a datasets.Dataset or a list of dicts (rows), "
                    f"got {type(data).__name__}")


def infer_kind(names: list[str]) -> str:
    """The source kind a data set's columns say: sft, cpt or prompts."""
    if "messages" in names or {"prompt", "completion"} <= set(names):
        return "sft"
    if "prompt" in names:
        return "prompts"
    if "text" in names:
        return "cpt"
    raise ValueError(f"cannot tell the kind of a data set with columns {names}: sft rows have "
                     "`messages` (or `prompt` + `completion`), cpt rows `text`, prompt-only "
                     "rows `prompt`; or give the kind")


def register(data, name: str = "data") -> str:
    """Hold `data` in memory under a new path, `memory://<name>-<n>`; `release` drops it."""
    path = f"{PREFIX}{name}-{next(_NUMBERS)}"
    _HELD[path] = as_dataset(data)
    return path


def release(path: str) -> None:
    _HELD.pop(path, None)


def columns_of(path: str) -> list[str]:
    return list(_HELD[path].column_names)


def load_held(source: dict) -> datasets.Dataset:
    """An in-memory source (`path: memory://...`); `sources.load_source` reads these here."""
    path = str(source["path"])
    name = source_name(source)
    if path not in _HELD:
        raise ValueError(f"data source {name!r}: the in-memory data set {path} is no longer "
                         "held (distill.data.memory.register holds one for a run)")
    ds = _HELD[path]
    columns(source, ds.column_names)
    if source.get("max_examples"):
        ds = ds.select(range(min(len(ds), int(source["max_examples"]))))
    if len(ds) == 0:
        raise ValueError(f"data source {name!r} (in memory) is empty")
    return ds
