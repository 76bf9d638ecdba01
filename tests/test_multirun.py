"""Output folders: Hydra's run or sweep-job dir per run, an in-process fallback, and a reused
folder that never loses an earlier export."""

import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from distill.export.callback import ExportStudent
from distill.models.causal_lm import load_causal_lm
from distill.run.paths import hydra_output_dir
from tests.fixtures import child_env

ROOT = Path(__file__).resolve().parents[1]


def _tiny_overrides(tiny_assets) -> list[str]:
    return [f"student.name_or_path={tiny_assets['student']}",
            f"teacher.name_or_path={tiny_assets['teacher']}",
            f"paths.data={tiny_assets['sft_train'].parent}", "evaluate=null",
            "data.batch_size=4", "trainer.max_steps=2", "trainer.val_check_interval=2",
            "callbacks.progress.refresh_rate=0"]


@pytest.mark.slow  # >10 s on a 2-core CPU (make test runs it)
def test_multirun_gives_each_job_its_folder_and_student(tiny_assets, tmp_path):
    sweep = tmp_path / "sweep"
    env = child_env()
    cmd = [sys.executable, "-m", "distill.train", "-m", "+experiment=sft_rkl",
           "loss.kind=forward_kl,reverse_kl", f"hydra.sweep.dir={sweep}",
           *_tiny_overrides(tiny_assets)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    kinds = {}
    for job in ("0", "1"):
        d = sweep / job
        # everything of the job in its own folder: Hydra's config and log, Lightning's files
        for part in (".hydra/config.yaml", "train.log", "checkpoints/last.ckpt",
                     "student/config.json", "student/tokenizer_config.json"):
            assert (d / part).exists(), f"{d / part} missing; job folder: {sorted(d.rglob('*'))}"
        assert next(d.glob("logs/version_*/metrics.csv"), None) is not None
        saved = yaml.safe_load((d / ".hydra/config.yaml").read_text())
        kinds[job] = saved["loss"]["kind"]
        AutoModelForCausalLM.from_pretrained(d / "student")
    assert sorted(kinds.values()) == ["forward_kl", "reverse_kl"]
    a = AutoModelForCausalLM.from_pretrained(sweep / "0/student").state_dict()
    b = AutoModelForCausalLM.from_pretrained(sweep / "1/student").state_dict()
    # two losses trained two different students, not one folder written twice
    assert any(not torch.equal(a[k], b[k]) for k in a)


def _compose(*overrides):
    import distill.train  # noqa: F401  (registers the resolvers)

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_in_process_without_hydra_job_falls_back_to_one_timestamped_folder(monkeypatch):
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)
    cfg = _compose()
    out = cfg.paths.output_dir
    assert Path(out).parent.parent == Path("outputs"), out
    # one folder for the whole config, however late it is read
    assert cfg.callbacks.export.dirpath == f"{out}/student"
    assert cfg.callbacks.checkpoint.dirpath == f"{out}/checkpoints"
    assert cfg.logger.csv.save_dir == out
    assert _compose("paths.output_dir=/tmp/mine").callbacks.export.dirpath == "/tmp/mine/student"


def test_inside_a_hydra_job_the_output_dir_is_hydras(monkeypatch, tmp_path):
    job = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(tmp_path / "multirun/3")}}})
    monkeypatch.setattr(HydraConfig.instance(), "cfg", job)
    assert hydra_output_dir() == str(tmp_path / "multirun/3")
    job.hydra.runtime.output_dir = None  # Hydra still choosing the folder: the fallback
    assert hydra_output_dir().startswith("outputs/")


def _export(student, dirpath):
    state = {f"student.{k}": v for k, v in student.state_dict().items()}
    trainer = SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(
        lightning_module_state_dict=lambda: state, barrier=lambda name: None))
    ExportStudent(dirpath).on_train_end(trainer, SimpleNamespace(student=student))


def _perturbed(path):
    model = load_causal_lm(str(path))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model


@pytest.mark.parametrize("earlier_exports", [1, 2])
def test_reused_output_dir_moves_the_earlier_export_aside(tiny_assets, tmp_path, caplog,
                                                          earlier_exports):
    out = tmp_path / "student"
    models = [_perturbed(tiny_assets["student"]) for _ in range(earlier_exports + 1)]
    with caplog.at_level(logging.WARNING, logger="distill.export.callback"):
        for m in models:
            _export(m, out)
    moved = sorted(tmp_path.glob("student.*"))
    assert len(moved) == earlier_exports, moved
    assert caplog.text.count("already held an export") == earlier_exports
    assert str(moved[0]) in caplog.text
    # each export is still there, with its own weights: the newest in student/
    for folder, model in [*zip(moved, models), (out, models[-1])]:
        again = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        for k, v in model.state_dict().items():
            if k in again:
                torch.testing.assert_close(again[k], v, rtol=0, atol=0)


def test_an_empty_student_folder_is_simply_used(tiny_assets, tmp_path, caplog):
    (tmp_path / "student").mkdir()
    with caplog.at_level(logging.WARNING, logger="distill.export.callback"):
        _export(load_causal_lm(str(tiny_assets["student"])), tmp_path / "student")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student"]
    assert "already held" not in caplog.text
