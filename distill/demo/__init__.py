"""The demo: its bundled teacher, tokenizer and data (`assets/`), and the task accuracy the
demo's runs report (`evaluation`, `task_eval`)."""

from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
