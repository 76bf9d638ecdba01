"""The README's commands, as tests run them on CPU with tiny saved folders."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
COMMANDS = ("distill-train", "distill-cache", "distill-export")


def readme_commands(prefix: str = r"distill-train \+experiment=hf_sft") -> list[str]:
    """Every README command starting with `prefix`: its line and the continuation lines
    (ending in a backslash) after it, with the prefix itself cut off."""
    return re.findall(prefix + r"((?:[^\n]*\\\n)*[^\n]*)", README.read_text())


def bash_commands() -> list[str]:
    """Every command line of the README's bash blocks (continuations joined, comments cut)
    that runs one of distill's commands, possibly after environment assignments."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    out = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            if words and words[0] in COMMANDS:
                out.append(line)
    return out


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def swapped(text: str, swap: dict[str, str]) -> str:
    """`text` with its placeholder paths replaced, the longest first (/data/chat.jsonl
    before /data/chat)."""
    for old in sorted(swap, key=len, reverse=True):
        text = text.replace(old, swap[old])
    return text


def cpu_overrides(command: str, swap: dict[str, str]) -> list[str]:
    """The command's overrides with its placeholder paths swapped for real ones, exactly
    as written otherwise (the recipes find the CPU themselves: trainer=auto)."""
    words = shlex.split(command.replace("\\\n", " "), comments=True)
    overrides = [swapped(word, swap) for word in words]
    assert not any("/models/" in w for w in overrides), overrides
    return overrides
