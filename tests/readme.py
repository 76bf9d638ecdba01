"""The README's commands, as tests run them on CPU with tiny saved folders."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_commands(prefix: str = r"python -m distill\.train \+experiment=hf_sft") -> list[str]:
    """Every README command starting with `prefix`: its line and the continuation lines
    (ending in a backslash) after it, with the prefix itself cut off."""
    return re.findall(prefix + r"((?:[^\n]*\\\n)*[^\n]*)", README.read_text())


def cpu_overrides(command: str, swap: dict[str, str]) -> list[str]:
    """The command's overrides with its placeholder paths swapped for real ones, minus
    `trainer=gpu` (the one change on a machine without a GPU)."""
    words = shlex.split(command.replace("\\\n", " "))
    overrides = []
    for word in words:
        for old, new in swap.items():
            word = word.replace(old, new)
        if word != "trainer=gpu":
            overrides.append(word)
    assert len(overrides) == len(words) - 1, "the README command lost its trainer=gpu"
    assert not any("/models/" in w for w in overrides), overrides
    return overrides
