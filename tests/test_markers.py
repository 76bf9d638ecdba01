"""The `slow` marker labels tests that take over 10 s on a 2-core CPU; `make test` (what CI
runs, .ci/run) still runs them, and `make test-quick` leaves them out."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _recipe(target: str) -> str:
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, re.M)
    assert match, f"no {target} target in the Makefile"
    return match.group(1)


def test_make_test_runs_the_slow_tests_and_test_quick_does_not():
    deselects = re.compile(r"pytest\b.*\s-m\s")  # a marker expression after pytest
    assert "pytest" in _recipe("test") and not deselects.search(_recipe("test"))
    assert '-m "not slow"' in _recipe("test-quick")
    addopts = re.search(r"^addopts\s*=\s*(.*)$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert addopts and " -m " not in f" {addopts.group(1)} "
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_slow_marker_is_used():
    marked = [p for p in (ROOT / "tests").rglob("test_*.py")
              if "@pytest.mark.slow" in p.read_text()]
    assert len(marked) >= 5, marked
