"""Every command of the README, run as written on CPU: its placeholder folders swapped for
tiny saved models and data, a couple of steps instead of hundreds (the README's hf_sft and
LoRA commands run in tests/test_families.py and tests/test_lora.py, the cross-tokenizer one
in tests/xtok/test_cli.py)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.fixtures import child_env
from tests.readme import bash_commands, python_blocks, swapped

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["trainer.max_steps=2", "trainer.val_check_interval=2"]
# run by the tests named above, and tests/xtok/test_cli.py (another tokenizer)
COVERED = ("data.train='[{name: mine", "student.lora.r=16", "loss.cross_tokenizer=")
COMMANDS = [c for c in bash_commands() if not any(part in c for part in COVERED)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Where relative paths of the README (outputs/...) land: one folder for the module."""
    return tmp_path_factory.mktemp("readme")


@pytest.fixture(scope="module")
def swap(tiny_assets, workdir):
    data = tiny_assets["sft_train"].parent
    return {"/models/Qwen2.5-0.5B": str(tiny_assets["student"]),
            "/models/Qwen2.5-1.5B": str(tiny_assets["student"]),
            "/models/Qwen2.5-7B-Instruct": str(tiny_assets["teacher"]),
            "/data/chat.jsonl": str(tiny_assets["sft_train"]),
            "/data/chat": str(data), "/data/cache": str(workdir / "cache")}


def _tiny(tiny_assets) -> list[str]:
    """Before the command's own overrides: the demo's models and data swapped for tiny ones
    (a command that names its own, swapped too, overrides these)."""
    return [f"student.name_or_path={tiny_assets['student']}",
            f"teacher.name_or_path={tiny_assets['teacher']}",
            f"paths.data={tiny_assets['sft_train'].parent}", "evaluate=null",
            "data.batch_size=4", "callbacks.progress.refresh_rate=0",
            "loss.on_policy.max_new_tokens=8"]


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_module

    import distill.train  # noqa: F401  (the resolvers)

    with initialize_config_module("distill.conf", version_base="1.3"):
        return compose("train", overrides=overrides)


def _run(tiny_assets, out: Path, *overrides: str) -> Path:
    """A finished tiny run with its checkpoint and the config Hydra saves beside it."""
    from distill.train import train

    cfg = _compose([*_tiny(tiny_assets), f"paths.output_dir={out}", *overrides, *SHORT])
    train(cfg)
    (out / ".hydra").mkdir(exist_ok=True)
    OmegaConf.save(cfg, out / ".hydra/config.yaml")
    return out


def _split(command: str) -> tuple[dict, list[str]]:
    """(environment assignments, the command's words)."""
    words = shlex.split(command, comments=True)
    env = {}
    while "=" in words[0] and words[0].split("=")[0].isupper():
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def test_the_readme_has_every_kind_of_command():
    names = [_split(c)[1][0] for c in COMMANDS]
    assert {"distill-train", "distill-cache", "distill-export"} <= set(names)
    assert any("-m" in _split(c)[1] for c in COMMANDS)  # a sweep
    assert len(COMMANDS) >= 15


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(shlex.split(
    c, comments=True))[:80])
def test_readme_command_runs_as_written(command, tiny_assets, swap, workdir, monkeypatch,
                                        tmp_path):
    env, words = _split(swapped(command, swap))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(workdir)
    name, args = words[0], words[1:]
    if name == "distill-export":
        _export(args, tiny_assets, workdir)
    elif "-m" in args:
        _sweep(args, tiny_assets, tmp_path)
    elif name == "distill-cache":
        from distill.run.cache import cache_teacher_logits

        cfg = _compose([*_tiny(tiny_assets), *args])
        cache_teacher_logits(cfg)
        assert (Path(cfg.cache.dir) / "metadata.json").is_file()
    else:
        _train(args, tiny_assets, workdir, tmp_path)


def _train(args, tiny_assets, workdir, tmp_path):
    from distill.run.cache import cache_teacher_logits
    from distill.train import train

    if "WANDB_MODE" in os.environ:
        os.environ.setdefault("WANDB_SILENT", "true")
    out = [] if any(a.startswith("paths.output_dir=") for a in args) else \
        [f"paths.output_dir={tmp_path / 'run'}"]
    cfg = _compose([*_tiny(tiny_assets), *out, *args, *SHORT])
    if cfg.teacher.kind == "cached" and not (Path(cfg.cache.dir) / "metadata.json").exists():
        # the README writes the cache with the command before this one; rerun, it is the same
        cache_teacher_logits(cfg)
    summary = train(cfg)
    assert summary["global_step"] == 2
    assert torch.isfinite(torch.tensor(summary["metrics"]["train/loss"]))
    if any(a.startswith("ckpt_path=") for a in args):  # and again: it resumes and extends
        again = train(_compose([*_tiny(tiny_assets), *out, *args, "trainer.max_steps=3",
                                "trainer.val_check_interval=3"]))
        assert again["global_step"] == 3


def _sweep(args, tiny_assets, tmp_path):
    sweep = tmp_path / "sweep"
    env = child_env()
    cmd = [sys.executable, "-m", "distill.train", *args, *_tiny(tiny_assets), *SHORT,
           f"hydra.sweep.dir={sweep}"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = len(next(a for a in args if "," in a).split("=", 1)[1].split(","))
    table = (sweep / "summary.md").read_text()
    assert table.count("\n| ") == jobs + 1  # the header and a row per job
    assert "val/loss" in table and table in done.stdout


def _export(args, tiny_assets, workdir):
    from distill.run.export import main

    lora = "--merge" in args
    run = workdir / ("lora_run" if lora else "full_run")
    if not run.exists():
        _run(tiny_assets, run, "+experiment=sft_fkl",
             *(["student=hf", "student.lora.r=4"] if lora else []))
    args = [a.replace("outputs/<run>", str(run)) for a in args]
    main(args)
    out = run / "student-last"
    assert (out / "README.md").is_file() and (out / "tokenizer_config.json").is_file()
    assert (out / "config.json").is_file()  # a whole model: full, or LoRA merged


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_runs_as_written(index, tiny_assets, swap, tmp_path, monkeypatch):
    code = swapped(python_blocks()[index], {**swap, '"max_steps": 500': '"max_steps": 2'})
    monkeypatch.chdir(tmp_path)
    n, hs, ht, v = 13, 8, 12, 31  # the loss snippet's tensors
    scope = {"student_hidden": torch.randn(n, hs, requires_grad=True),
             "student_weight": torch.randn(v, hs, requires_grad=True),
             "teacher_hidden": torch.randn(n, ht), "teacher_weight": torch.randn(v, ht),
             "labels": torch.randint(0, v, (n,))}
    exec(compile(code, f"README.md python block {index}", "exec"), scope)
    if "result" in scope:
        assert scope["result"].summary["global_step"] == 2
        assert (Path(scope["result"].output_dir) / "student/README.md").is_file()
    else:
        assert scope["student_hidden"].grad is not None
