"""What every reader of a data source shares: its name, the columns its kind reads, the
format of its file by suffix, the file opened (compressed or not), and where a row is, for
error messages: `where(source, idx)` gives its 1-based line in a local jsonl file.
"""

from __future__ import annotations

from pathlib import Path

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text",
           ".text": "text", ".arrow": "arrow", ".csv": "csv"}
KINDS = ("sft", "cpt", "prompts")
# the columns a kind reads when the source sets no `field`, in order of preference
COLUMNS = {"sft": (("messages",), ("prompt", "completion")),
           "prompts": (("prompt",), ("messages",)),
           "cpt": (("text",),)}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")  # datasets reads them by their suffix


def source_name(source: dict) -> str:
    return str(source.get("name") or source.get("path"))


def file_format(path: Path) -> str | None:
    """The datasets builder of a data file by its suffix (`x.jsonl.gz` is json)."""
    suffix = path.suffix
    if suffix in COMPRESSED:
        suffix = Path(path.stem).suffix
    return FORMATS.get(suffix)


def readable(path: Path) -> bool:
    """Whether `open_data_file` reads the file itself (zstd and lz4 are left to datasets)."""
    return path.suffix not in (".zst", ".lz4")


def open_data_file(path: Path, text: bool = False):
    """A data file, compressed or not, as bytes (or utf-8 text); see `readable`."""
    import bz2
    import gzip
    import lzma

    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(path.suffix, open)
    return opener(path, "rt", encoding="utf-8") if text else opener(path, "rb")


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
    if ".jsonl" in local.suffixes[-2:] and readable(local) and local.is_file():
        with open_data_file(local, text=True) as f:  # the json loader skips blank lines
            nonblank = (n for n, line in enumerate(f, 1) if line.strip())
            line = next((n for k, n in enumerate(nonblank) if k == idx), None)
        if line is not None:
            text += f" (line {line} of {local})"
    return text
