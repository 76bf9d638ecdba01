"""Raw examples from Hugging Face `datasets`: local json/jsonl/parquet/text files or hub names.

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

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text",
           ".text": "text", ".arrow": "arrow", ".csv": "csv"}
KINDS = ("sft", "cpt", "prompts")
# the columns a kind reads when the source sets no `field`, in order of preference
COLUMNS = {"sft": (("messages",), ("prompt", "completion")),
           "prompts": (("prompt",), ("messages",)),
           "cpt": (("text",),)}


def source_name(source: dict) -> str:
    return str(source.get("name") or source.get("path"))


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
    local = Path(path).expanduser()
    if local.suffix in FORMATS:
        ds = _load_file(local, name)
    elif local.is_dir():
        ds = datasets.load_dataset(str(local), split=split)
    else:
        ds = datasets.load_dataset(path, source.get("config"), split=split)
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
    with open(local, "rb") as f:
        empty = not f.read(1 << 16).strip()
    if empty:
        raise ValueError(f"data source {name!r} ({local}) is empty: check the "
                         "path, or rebuild the demo data with scripts/make_demo_assets.py")
    try:
        return datasets.load_dataset(FORMATS[local.suffix], data_files=str(local),
                                     split="train")
    except Exception as err:
        if FORMATS[local.suffix] == "json":
            _raise_json_error(local, name, err)
        raise


def _raise_json_error(path: Path, name: str, err: Exception) -> None:
    """datasets' json loader names neither the line nor the problem: find them."""
    with open(path, encoding="utf-8") as f:
        if path.suffix == ".json" and f.read(1).lstrip() in "[{":
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


def columns(source: dict, names: list[str]) -> tuple[str, ...]:
    """The raw column(s) this source reads; a clear error when they are missing."""
    kind = source.get("kind", "sft")
    options = ((source["field"],),) if source.get("field") else COLUMNS[kind]
    for cols in options:
        if all(c in names for c in cols):
            return cols
    wanted = " or ".join(" + ".join(repr(c) for c in cols) for cols in options)
    raise ValueError(f"data source {source_name(source)!r} ({kind}) has no column {wanted} "
                     f"(columns: {names}); set its `field`")


def where(source: dict, idx: int) -> str:
    """'data source 'x', row 3 (line 4 of f.jsonl)': idx is the 0-based dataset row."""
    text = f"data source {source_name(source)!r}, row {idx + 1}"
    local = Path(str(source.get("path", ""))).expanduser()
    if local.suffix == ".jsonl" and local.is_file():
        with open(local, encoding="utf-8") as f:  # the json loader skips blank lines
            nonblank = (n for n, line in enumerate(f, 1) if line.strip())
            line = next((n for k, n in enumerate(nonblank) if k == idx), None)
        if line is not None:
            text += f" (line {line} of {local})"
    return text
