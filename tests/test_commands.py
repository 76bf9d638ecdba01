"""The console commands of pyproject.toml: each entry point resolves, and each runs (the
installed command when `pip install -e .` put it on the PATH, as `make install` does in CI;
else the same function through this interpreter)."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import child_env

ROOT = Path(__file__).resolve().parents[1]
WANT = {"distill-train": "distill.train:main", "distill-cache": "distill.run.cache:main",
        "distill-export": "distill.run.export:main"}


def scripts() -> dict[str, str]:
    """[project.scripts] of pyproject.toml (read as text: tomllib is Python >= 3.11)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[)", text, flags=re.S | re.M)
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([^"]+)"', section.group(1), flags=re.M))


def command(name: str) -> list[str]:
    found = shutil.which(name)
    if found:
        return [found]
    module, func = scripts()[name].split(":")
    return [sys.executable, "-c", f"import sys; sys.argv[0] = {name!r}; "
            f"from {module} import {func}; sys.exit({func}())"]


def run(name: str, *args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    # this checkout first, whichever install the command on the PATH came from
    env = child_env()
    return subprocess.run([*command(name), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_pyproject_declares_the_three_commands():
    assert scripts() == WANT
    for target in WANT.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func))


@pytest.mark.parametrize("name, expect", [("distill-cache", "experiment: "),
                                          ("distill-export", "--merge")])
def test_the_commands_answer_help(name, expect):
    done = run(name, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert expect in done.stdout
    if name == "distill-cache":  # Hydra's help lists the recipes
        assert "hf_offline" in done.stdout and "hf_onpolicy" in done.stdout


def test_distill_train_runs_a_tiny_distillation(tiny_assets, tmp_path):
    out = tmp_path / "run"
    done = run("distill-train", "+experiment=sft_fkl", f"paths.output_dir={out}",
               f"student.name_or_path={tiny_assets['student']}",
               f"teacher.name_or_path={tiny_assets['teacher']}",
               f"paths.data={tiny_assets['sft_train'].parent}", "evaluate=null",
               "data.batch_size=4", "trainer.max_steps=2", "trainer.val_check_interval=2",
               "callbacks.progress.refresh_rate=0", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "distill: run summary" in done.stdout
    # Hydra's job files beside the run's outputs, and the card names the command
    for part in (".hydra/config.yaml", "final_metrics.json", "student/config.json"):
        assert (out / part).is_file(), part
    assert "distill-train +experiment=sft_fkl" in (out / "student/README.md").read_text()
    assert "Tip: For seamless" not in done.stdout + done.stderr  # the known noise: silenced
    assert "eval mode" not in done.stderr and "LeafSpec" not in done.stderr
