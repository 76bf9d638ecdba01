"""Raw examples from Hugging Face `datasets`: local json/jsonl/parquet/text files or hub names.

A source is a small dict from the config: {name, kind: sft|cpt, path, split, weight,
field, max_examples}. SFT rows carry chat `messages`; CPT rows carry `text`.
"""

from __future__ import annotations

from pathlib import Path

import datasets

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text",
           ".text": "text", ".arrow": "arrow", ".csv": "csv"}
KINDS = ("sft", "cpt")


def load_source(source: dict) -> datasets.Dataset:
    """One source as a `datasets.Dataset` with its raw field (`messages` or `text`)."""
    kind = source.get("kind", "sft")
    if kind not in KINDS:
        raise ValueError(f"data source {source.get('name')!r}: kind must be 'sft' (chat "
                         f"messages) or 'cpt' (plain text), got {kind!r}")
    path, split = str(source["path"]), source.get("split", "train")
    local = Path(path).expanduser()
    if local.suffix in FORMATS:
        if not local.exists():
            raise FileNotFoundError(f"data source {source.get('name')!r}: no file {path}")
        with open(local, "rb") as f:
            empty = not f.read(1 << 16).strip()
        if empty:
            raise ValueError(f"data source {source.get('name')!r} ({path}) is empty: check the "
                             "path, or rebuild the demo data with scripts/make_demo_assets.py")
        ds = datasets.load_dataset(FORMATS[local.suffix], data_files=str(local), split="train")
    elif local.is_dir():
        ds = datasets.load_dataset(str(local), split=split)
    else:
        ds = datasets.load_dataset(path, source.get("config"), split=split)
    field = source.get("field", "messages" if kind == "sft" else "text")
    if field not in ds.column_names:
        raise ValueError(f"data source {source.get('name')!r} has no column {field!r} (columns: "
                         f"{ds.column_names}); set its `field`")
    if source.get("max_examples"):
        ds = ds.select(range(min(len(ds), int(source["max_examples"]))))
    if len(ds) == 0:
        raise ValueError(f"data source {source.get('name')!r} ({path}) is empty: check the "
                         "path, split and filters")
    return ds
