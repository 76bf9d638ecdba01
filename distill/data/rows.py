"""Raw rows -> chat conversations (lists of {role, content, ...} messages), checked.

Every error names the source, the row (its line in a jsonl file) and the field, because a
bad row in a million-row file is otherwise a needle in a haystack. Content is text: a string,
or a list of text parts (the OpenAI form, joined); a number, an image part or a role written
another way (ShareGPT's human / gpt, `User`) is refused, since a template would render it
into something no one meant, or train nothing. `open_sources` opens every source and checks
its first rows before any model loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets

from distill.data.files import columns, open_data_file, where

CHECKED_ROWS = 200  # rows per source checked before the models load (all are, when tokenized)
ROLES = ("system", "user", "assistant", "tool", "developer", "ipython", "function")
# roles other formats write, and what they are here
ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant",
           "chatgpt": "assistant", "prompter": "user"}


class DataError(ValueError):
    """A row the data pipeline cannot read; the message says where and why."""


def sft_conversation(row: dict, cols: tuple[str, ...], source: dict, idx: int) -> list[dict]:
    """The conversation of an SFT row: `messages`, or `prompt` + `completion`."""
    if len(cols) == 2:  # prompt + completion: strings, or message lists
        return (as_messages(row[cols[0]], "user", cols[0], source, idx)
                + as_messages(row[cols[1]], "assistant", cols[1], source, idx))
    return as_messages(row[cols[0]], None, cols[0], source, idx)


def prompt_conversation(row: dict, cols: tuple[str, ...], source: dict, idx: int) -> list[dict]:
    """The prompt of a `prompts` row. A conversation that ends with an assistant turn loses
    that turn (an SFT file used for on-policy: the student writes the answer itself)."""
    messages = as_messages(row[cols[0]], "user", cols[0], source, idx)
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise DataError(f"{where(source, idx)}: field {cols[0]!r} holds no prompt (only an "
                        "assistant turn)")
    return messages


def as_messages(value, role: str | None, field: str, source: dict, idx: int) -> list[dict]:
    """A string (one message of `role`) or a list of messages, checked field by field.
    Keys whose value is None are dropped: Arrow gives every message every key that any
    message of the file has, and templates test `message.x is defined`."""
    if value is None:
        raise DataError(f"{where(source, idx)}: field {field!r} is missing or null")
    if isinstance(value, str):
        if role is None:
            raise DataError(f"{where(source, idx)}: field {field!r} is a string; it must be a "
                            "list of {role, content} messages")
        return [{"role": role, "content": value}]
    if not isinstance(value, list):
        raise DataError(f"{where(source, idx)}: field {field!r} must be a list of "
                        f"{{role, content}} messages, got {type(value).__name__}")
    if not value:
        raise DataError(f"{where(source, idx)}: field {field!r} is an empty conversation")
    return [_message(m, f"{field}[{k}]", source, idx) for k, m in enumerate(value)]


def _message(m, field: str, source: dict, idx: int) -> dict:
    if not isinstance(m, dict):
        raise DataError(f"{where(source, idx)}: {field} must be a {{role, content}} mapping, "
                        f"got {type(m).__name__}")
    m = {k: v for k, v in m.items() if v is not None}
    role = m.get("role")
    if not isinstance(role, str) or not role:
        hint = ("; it has `from`/`value`, the ShareGPT format: convert it to role/content "
                "(human -> user, gpt -> assistant)" if "from" in m and "value" in m else "")
        raise DataError(f"{where(source, idx)}: {field} has no `role` (system, user, "
                        f"assistant, ...){hint}")
    if role not in ROLES and (role.lower() in ROLES or role.lower() in ALIASES):
        meant = ALIASES.get(role.lower(), role.lower())
        raise DataError(f"{where(source, idx)}: {field}.role is {role!r}; the roles are "
                        f"{', '.join(ROLES[:3])} (and tool, ...), lower case: write {meant!r} "
                        "(SFT trains the 'assistant' turns, and a chat template renders only "
                        "the roles it knows)")
    if "content" not in m:
        if not m.get("tool_calls"):
            raise DataError(f"{where(source, idx)}: {field}.content is missing or null (role "
                            f"{role!r}); give it a string (it may be empty)")
        return m
    return {**m, "content": _text(m["content"], f"{field}.content", source, idx)}


def _text(content, field: str, source: dict, idx: int) -> str:
    """A message's content as text: a string, or the OpenAI form's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        for k, part in enumerate(content):
            kind = part.get("type", "text")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise DataError(f"{where(source, idx)}: {field}[{k}] is a {kind!r} part "
                                f"({sorted(part)}); distill trains on text: give text parts "
                                "{type: text, text: ...} or a string")
        return "".join(part["text"] for part in content)  # as the multimodal templates do
    raise DataError(f"{where(source, idx)}: {field} must be a string (or a list of "
                    f"{{type: text, text}} parts), got {type(content).__name__} "
                    f"{content!r:.40}; write it as a string (\"{content!s:.20}\")")


def check_rows(ds, source: dict, rows: int = CHECKED_ROWS) -> None:
    """The first `rows` rows of a raw source read as this kind's conversations or texts."""
    kind = source.get("kind", "sft")
    cols = columns(source, ds.column_names)
    for idx in range(min(rows, len(ds))):
        row = ds[idx]
        if kind == "cpt":
            if not isinstance(row[cols[0]], str):
                raise DataError(f"{where(source, idx)}: field {cols[0]!r} must be a string, "
                                f"got {type(row[cols[0]]).__name__}")
        elif kind == "prompts":
            prompt_conversation(row, cols, source, idx)
        else:
            sft_conversation(row, cols, source, idx)


def read_json_exactly(path: Path, source: dict) -> datasets.Dataset:
    """A json / jsonl file read line by line, with each message's content made text (parts
    joined) or refused naming its line: what datasets reads as a `Json` column cannot tell
    the string "4" from the number 4 (sources.has_mixed_column), and older datasets refuse
    a column that mixes strings and lists."""
    first = next(_exact_rows(str(path), source, [], None), {})
    cols = columns(source, list(first)) if source.get("kind", "sft") != "cpt" else ()
    stat = os.stat(path)  # in the cache key: a changed file is read again
    try:
        return datasets.Dataset.from_generator(
            _exact_rows, gen_kwargs={"path": str(path), "source": source, "cols": list(cols),
                                     "stamp": (stat.st_size, stat.st_mtime_ns)})
    except Exception as err:  # datasets wraps what the generator raised
        cause = err
        while cause is not None and not isinstance(cause, DataError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise cause from None


def _exact_rows(path: str, source: dict, cols: list[str], stamp):
    with open_data_file(Path(path), text=True) as f:
        if Path(path).suffix == ".json" and f.read(1) == "[":
            f.seek(0)
            rows = json.load(f)
        else:
            f.seek(0)
            rows = (json.loads(line) for line in f if line.strip())
        for idx, row in enumerate(rows):
            for col in cols:
                if isinstance(row.get(col), list):
                    row[col] = [_texted(m, f"{col}[{k}]", source, idx)
                                for k, m in enumerate(row[col])]
            yield row


def _texted(m, field: str, source: dict, idx: int):
    if isinstance(m, dict) and m.get("content") is not None:
        return {**m, "content": _text(m["content"], f"{field}.content", source, idx)}
    return m
