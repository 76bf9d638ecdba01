"""Raw rows -> chat conversations (lists of {role, content, ...} messages), checked.

Every error names the source, the row (its line in a jsonl file) and the field, because a
bad row in a million-row file is otherwise a needle in a haystack.
"""

from __future__ import annotations

from distill.data.sources import where


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
    if "content" not in m and not m.get("tool_calls"):
        raise DataError(f"{where(source, idx)}: {field}.content is missing or null (role "
                        f"{role!r}); give it a string (it may be empty)")
    return m
