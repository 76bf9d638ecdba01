"""Raw examples from Hugging Face `datasets`: local json/jsonl/parquet/text/csv/arrow files
(optionally compressed: `x.jsonl.gz`), folders of them or written by `save_to_disk`, or hub
names. A problem names the source and the file, and the line where there is one (a byte
that is not UTF-8, malformed JSON).

A source is a small dict from the config: {name, kind, path, split, weight, field,
max_examples}. Kinds (docs/data.md):

- `sft`: chat rows (`messages`, or `prompt` + `completion`); assistant turns are trained.
- `cpt`: plain `text`; every token is trained, long documents are cut into windows.
- `prompts`: prompts only (`prompt`, or `messages` ending with a user turn), tokenized with
  the generation prompt and nothing trained: the student writes the completion (on-policy).

`where(source, idx)` names a row for error messages: its 1-based line in a local jsonl file.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets

from distill.data.files import (
    COMPRESSED,
    FORMATS,
    KINDS,
    columns,
    file_format,
    open_data_file,
    readable,
    source_name,
)
from distill.data.memory import load_held
from distill.data.rows import check_rows, read_json_exactly


def load_source(source: dict) -> datasets.Dataset:
    """One source as a `datasets.Dataset` with its raw columns (see `columns`)."""
    kind = source.get("kind", "sft")
    name = source_name(source)
    if kind not in KINDS:
        raise ValueError(f"data source {name!r}: kind must be 'sft' (chat messages), 'cpt' "
                         f"(plain text) or 'prompts' (prompts only, on-policy), got {kind!r}")
    if "path" not in source:
        raise ValueError(f"data source {name!r} has no `path` (a file, folder or hub name)")
    path, split = str(source["path"]), source.get("split", "train")
    if path.startswith("memory://"):  # a data set distill.fit holds in memory
        return load_held(source)
    local = Path(path).expanduser()
    if file_format(local) is not None:
        try:
            ds = _load_file(local, name)
            exact = file_format(local) == "json" and has_mixed_column(ds.features)
        except MixedTypes:
            ds, exact = None, True
        if exact:
            ds = read_json_exactly(local, source)
    elif local.is_dir():
        ds = _load_folder(local, name, split)
    elif local.exists():
        what = "".join(local.suffixes) or "suffix-less"
        raise ValueError(f"data source {name!r}: {local} is a {what} file; distill reads "
                         f"{', '.join(sorted(FORMATS))} files, optionally compressed "
                         f"({', '.join(COMPRESSED)})")
    elif path.startswith((".", "/", "~")) or path.count("/") > 1:  # meant as a local path
        raise FileNotFoundError(f"data source {name!r}: no file or folder {local}")
    else:
        ds = _load_hub(path, source.get("config"), split, name)
    columns(source, ds.column_names)
    if source.get("max_examples"):
        ds = ds.select(range(min(len(ds), int(source["max_examples"]))))
    if len(ds) == 0:
        raise ValueError(f"data source {name!r} ({path}) is empty: check the "
                         "path, split and filters")
    return ds


def _load_file(local: Path, name: str) -> datasets.Dataset:
    if not local.exists():
        raise FileNotFoundError(f"data source {name!r}: no file {local}")
    with open_data_file(local) as f:
        empty = not f.read(1 << 16).strip()
    if empty:
        raise ValueError(f"data source {name!r} ({local}) is empty: check the "
                         "path, or rebuild the demo data with scripts/make_demo_assets.py")
    builder = file_format(local)
    try:
        ds = datasets.load_dataset(builder, data_files=str(local), split="train")
        if builder in ("json", "text", "csv"):
            ds.data.table.validate(full=True)  # pyarrow keeps bytes that are not UTF-8
    except Exception as err:
        if builder in ("json", "text", "csv"):
            _raise_encoding_error(local, name, err)
        if builder == "json" and readable(local):  # zstd, lz4: datasets' own error below
            _raise_json_error(local, name, err)
            raise MixedTypes(f"data source {name!r}: {local}: {err}") from err
        raise ValueError(f"data source {name!r}: {local} could not be read as {builder} "
                         f"({type(err).__name__}: {err})") from err
    return ds


class MixedTypes(ValueError):
    """Valid JSON whose columns mix types (strings and lists), which older datasets refuse."""


def has_mixed_column(features) -> bool:
    """Whether datasets read a column of mixed types (strings and lists or numbers) as its
    `Json` feature, which stores the string "4" and the number 4 alike: they both come back
    as 4, and "[1]" as a list. Such a file must be read exactly (distill.data.rows)."""
    json_feature = getattr(datasets, "Json", None)  # datasets >= 5; older ones refuse them
    if json_feature is not None and isinstance(features, json_feature):
        return True
    if isinstance(features, dict):
        return any(has_mixed_column(f) for f in features.values())
    inner = getattr(features, "feature", None)  # List, LargeList, Sequence
    return inner is not None and has_mixed_column(inner)


def _raise_encoding_error(path: Path, name: str, err: Exception) -> None:
    """datasets names neither the file nor the line of a byte that is not UTF-8: find them."""
    if not readable(path):
        return
    with open_data_file(path) as f:
        for lineno, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as bad:
                raise ValueError(f"data source {name!r}: line {lineno} of {path} is not valid "
                                 f"UTF-8 (byte {line[bad.start:bad.start + 1]!r} at column "
                                 f"{bad.start + 1}): save the file as UTF-8 (e.g. iconv -f "
                                 "latin1 -t utf-8)") from err


def _load_folder(local: Path, name: str, split: str) -> datasets.Dataset:
    """A folder of data files, or one written by `save_to_disk` (which `load_dataset`
    refuses, telling one to call load_from_disk: done here)."""
    if (local / "dataset_dict.json").exists():
        found = datasets.load_from_disk(str(local))
        if split not in found:
            raise ValueError(f"data source {name!r}: the saved DatasetDict {local} has no "
                             f"split {split!r} (it has {sorted(found)}); set the source's "
                             "`split`")
        return found[split]
    if (local / "dataset_info.json").exists() and (local / "state.json").exists():
        return datasets.load_from_disk(str(local))  # one saved Dataset: its only split
    try:
        return datasets.load_dataset(str(local), split=split)
    except ValueError as err:  # an unknown split: datasets lists the ones there are
        raise ValueError(f"data source {name!r} ({local}): {err}") from err


def _load_hub(path: str, config: str | None, split: str, name: str) -> datasets.Dataset:
    try:
        return datasets.load_dataset(path, config, split=split)
    except FileNotFoundError as err:  # DatasetNotFoundError: not on the hub, or offline
        raise FileNotFoundError(f"data source {name!r}: {path!r} is neither a local file or "
                                f"folder nor a data set this machine can reach on the Hugging "
                                f"Face hub ({err})") from err


def _raise_json_error(path: Path, name: str, err: Exception) -> None:
    """datasets' json loader names neither the line nor the problem: find them."""
    with open_data_file(path, text=True) as f:
        inner = Path(path.stem).suffix if path.suffix in COMPRESSED else path.suffix
        if inner == ".json" and f.read(1).lstrip() in "[{":
            f.seek(0)
            try:
                json.load(f)
            except json.JSONDecodeError as bad:
                raise ValueError(f"data source {name!r}: {path} is not valid JSON at line "
                                 f"{bad.lineno}, column {bad.colno}: {bad.msg}") from err
            return
        f.seek(0)
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as bad:
                raise ValueError(f"data source {name!r}: line {lineno} of {path} is not valid "
                                 f"JSON (column {bad.colno}: {bad.msg}); a jsonl file holds "
                                 "one JSON object per line") from err


def open_sources(data) -> None:
    """Every source of `data` (a DataConfig) opened and its first rows checked: a missing
    file, malformed JSON, a wrong column or a bad row stops the run before any model loads."""
    for source in [*data.train, *(data.val or [])]:
        source = source.as_dict()
        check_rows(load_source(source), source)
