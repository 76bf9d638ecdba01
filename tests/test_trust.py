"""Issue 18 through `train(cfg)`: every bad input is refused before the models load when it can
be known then (data, folders, lengths, the resume checkpoint), with a message naming where
and the key that fixes it; one run per output folder and one caching job per cache; the
student's own tokenizer is compared with the teacher's."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import distill.models.causal_lm
from distill.core.checkpoint_io import check_finite
from distill.core.rules import ConfigError
from distill.data.rows import DataError
from distill.models.causal_lm import load_tokenizer
from distill.run.cache import cache_teacher_logits
from distill.run.paths import RunLock
from distill.train import train
from tests.fixtures import make_model, make_tokenizer

Q = {"role": "user", "content": "add 2+2=?"}
A = {"role": "assistant", "content": "4"}


class _NoLoading:
    """Stands for AutoModelForCausalLM: a test that must stop before any model loads."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise AssertionError(f"a model was loaded ({args[0]})")

    from_config = from_pretrained


@pytest.fixture
def no_model_loads(monkeypatch):
    monkeypatch.setattr(distill.models.causal_lm, "AutoModelForCausalLM", _NoLoading)


def _data(folder: Path, train_rows: list, val_rows=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train_rows), ("val", val_rows or [{"messages": [Q, A]}])):
        (folder / f"sft_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _copy(src: Path, dst: Path, keep=lambda name: True) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if keep(p.name):
            shutil.copy(p, dst / p.name)
    return dst


MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")


# --- data before models --------------------------------------------------------------------
def test_a_data_error_comes_before_the_model_folders_are_even_looked_at(compose_cfg, tmp_path,
                                                                      tiny_assets):
    bad = _data(tmp_path / "d", [{"messages": [Q, A]}, {"messages": [Q, {"role": "gpt",
                                                                         "content": "4"}]}])
    with pytest.raises(DataError, match=r"row 2 \(line 2 of .*sft_train.jsonl\): messages\[1\]"
                                        r".role is 'gpt'"):
        train(compose_cfg(f"paths.data={bad}", "student.name_or_path=/nonexistent/student",
                          "teacher.name_or_path=/nonexistent/teacher",
                          f"student.tokenizer={tiny_assets['teacher']}",
                          f"teacher.tokenizer={tiny_assets['teacher']}"))


def _no_template(tmp_path, tiny_assets) -> Path:
    tok = make_tokenizer(tmp_path / "tok")
    tok.chat_template = None
    (tmp_path / "tok/chat_template.jinja").unlink(missing_ok=True)
    tok.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


@pytest.mark.parametrize("case", ["empty", "missing", "wrong column", "no assistant turn",
                                  "max_length too small", "a bad row far down", "no template",
                                  "trainer=gpu on CPU", "+trainer.max_step"])
def test_data_and_setting_errors_come_before_any_model_loads(case, compose_cfg, tmp_path,
                                                              tiny_assets, no_model_loads):
    """The issue's 'errors after loading': each one now stops the run with no model loaded."""
    rows = [{"messages": [Q, A]}] * 300
    extra, error, match = [], ValueError, None
    if case == "empty":
        d = _data(tmp_path / "d", [])
        match = r"data source 'demo_sft' .*sft_train.jsonl\) is empty"
    elif case == "missing":
        d = _data(tmp_path / "d", rows)
        (d / "sft_train.jsonl").unlink()
        error, match = FileNotFoundError, r"data source 'demo_sft': no file .*sft_train.jsonl"
    elif case == "wrong column":
        d = _data(tmp_path / "d", [{"chat": [Q, A]}])
        match = r"has no column 'messages' or 'prompt' \+ 'completion' \(columns: \['chat'\]\)"
    elif case == "no assistant turn":
        d = _data(tmp_path / "d", [{"messages": [Q]}])
        match = r"none of its 1 rows has an assistant turn"
    elif case == "max_length too small":
        d, extra = _data(tmp_path / "d", rows), ["data.max_length=5"]
        match = r"data.max_length=5 is too short for the prompts"
    elif case == "a bad row far down":  # past the rows checked when the sources open
        d = _data(tmp_path / "d", rows + [{"messages": [Q, {"role": "assistant",
                                                            "content": 4}]}])
        error, match = DataError, r"row 301 \(line 301 of .*\): messages\[1\].content must be"
    elif case == "no template":
        d, extra = _data(tmp_path / "d", rows), [
            f"teacher.tokenizer={_no_template(tmp_path, tiny_assets)}",
            f"student.tokenizer={tmp_path / 'tok'}"]
        match = r"the tokenizer has no chat template: set data.chat_template="
    elif case == "trainer=gpu on CPU":
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
        d, extra, error = _data(tmp_path / "d", rows), ["trainer=gpu"], ConfigError
        match = r"trainer.accelerator=gpu: this machine has no CUDA GPU"
    else:
        d, extra, error = _data(tmp_path / "d", rows), ["+trainer.max_step=5"], ConfigError
        match = r"trainer.max_step: unknown key \(did you mean trainer.max_steps\?\)"
    with pytest.raises(error, match=match):
        train(compose_cfg(f"paths.data={d}", *extra))


# --- the student's own tokenizer --------------------------------------------------------------
def test_a_student_with_its_own_different_tokenizer_is_refused_under_hf_sft(
        compose_cfg, tmp_path, tiny_assets, no_model_loads):
    """Issue case 1: hf_sft compared only the teacher's tokenizer; the student's own was
    never read, and the export then carried the teacher's."""
    student = _copy(tiny_assets["student"], tmp_path / "student", lambda n: n in MODEL_FILES)
    make_tokenizer(student, extra_chars="#@")
    with pytest.raises(ValueError, match=r"the student's \(.*student\) tokenizer and the "
                                         r"teacher's differ in the vocabularies \(80 vs 78.*"
                                         r"Distil between models that share a tokenizer .*or "
                                         r"use cross-tokenizer distillation"):
        train(compose_cfg("+experiment=hf_sft", f"student.name_or_path={student}"))


def test_a_student_without_a_tokenizer_uses_the_teachers_and_a_template_difference_is_said(
        compose_cfg, tmp_path, tiny_assets, caplog):
    student = _copy(tiny_assets["student"], tmp_path / "bare", lambda n: n in MODEL_FILES)
    out = tmp_path / "run"
    summary = train(compose_cfg("+experiment=hf_sft", f"student.name_or_path={student}",
                                "trainer.max_steps=1", out=out))
    exported, teacher = (load_tokenizer(str(p)) for p in (summary["student_dir"],
                                                          tiny_assets["teacher"]))
    assert exported.get_vocab() == teacher.get_vocab()
    assert exported.chat_template == teacher.chat_template
    own = _copy(tiny_assets["student"], tmp_path / "own")
    tok = make_tokenizer(own)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(own)
    with caplog.at_level(logging.WARNING, logger="distill.models.tokenizers"):
        train(compose_cfg("+experiment=hf_sft", f"student.name_or_path={own}",
                          "trainer.max_steps=1", out=tmp_path / "run2"))
    assert "share the vocabulary but differ in the chat templates: the run renders the data " \
           "with, and the export saves, the teacher's tokenizer" in caplog.text


@pytest.mark.parametrize("override,message", [
    ("+loss.knd=forward_kl", r"loss.knd: unknown key \(did you mean loss.kind\?\)"),
    ("+loss.temprature=2", r"loss.temprature: unknown key \(did you mean loss.temperature\?\)"),
    ("+student.lora.rank=8", r"student.lora.rank: unknown key"),
])
def test_misspelt_keys_added_with_plus_stop_the_run(override, message, compose_cfg,
                                                     no_model_loads):
    with pytest.raises(ConfigError, match=message):
        train(compose_cfg("+experiment=sft_rkl", override))


# --- one run per folder, one caching job per cache -------------------------------------------
def test_a_second_run_into_a_busy_folder_is_refused_and_the_first_ones_record_kept(
        compose_cfg, tmp_path, no_model_loads):
    out = tmp_path / "busy"
    (out / ".hydra").mkdir(parents=True)
    (out / ".hydra/config.yaml").write_text("the first run's config\n")
    with RunLock(out):  # the first run, still going
        (out / ".hydra/config.yaml").write_text("the second run's config\n")  # its Hydra
        with pytest.raises(RuntimeError, match=rf"{out} is the output folder of a run that is "
                                               r"still going \(pid \d+ on .*\): two runs in one"):
            train(compose_cfg(out=out))
        assert (out / ".hydra/config.yaml").read_text() == "the first run's config\n"


def test_a_killed_runs_lock_is_not_stale(tmp_path):
    out = tmp_path / "killed"
    code = ("import sys, time; from distill.run.paths import RunLock; "
            f"lock = RunLock({str(out)!r}).__enter__(); print('locked', flush=True); "
            "time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[1])
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(RuntimeError, match="still going"):
        RunLock(out).__enter__()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    time.sleep(0.1)
    with RunLock(out):  # the kernel dropped the dead run's lock
        pass


def test_a_second_caching_job_into_one_cache_is_refused_before_the_teacher_loads(
        compose_cfg, tmp_path, no_model_loads):
    cache = tmp_path / "cache"
    cfg = compose_cfg("+experiment=offline_fkl", f"cache.dir={cache}")
    with RunLock(cache), pytest.raises(RuntimeError, match=rf"{cache} is the output folder of "
                                                           r"a run that is still going"):
        cache_teacher_logits(cfg)


# --- model folders and the hints that fix them ------------------------------------------------
def test_a_teacher_folder_without_weights_is_not_told_to_start_from_scratch(
        compose_cfg, tmp_path, tiny_assets, no_model_loads):
    teacher = _copy(tiny_assets["teacher"], tmp_path / "t", lambda n: n != "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"has config.json but no weights .*a teacher "
                                                r"needs its trained weights") as err:
        train(compose_cfg(f"teacher.name_or_path={teacher}"))
    assert "from_scratch" not in str(err.value)


def test_a_teacher_folder_without_a_tokenizer_names_teacher_tokenizer(compose_cfg, tmp_path,
                                                                      tiny_assets):
    teacher = _copy(tiny_assets["teacher"], tmp_path / "t", lambda n: n in MODEL_FILES)
    with pytest.raises(FileNotFoundError, match=r"Point teacher.tokenizer= \(it defaults to "
                                                r"teacher.name_or_path\) at a folder"):
        train(compose_cfg(f"teacher.name_or_path={teacher}"))
    # the key the hint names works as it is written (no `+`)
    summary = train(compose_cfg(f"teacher.name_or_path={teacher}", "trainer.max_steps=1",
                                f"teacher.tokenizer={tiny_assets['teacher']}"))
    assert summary["global_step"] == 1


def test_a_truncated_safetensors_file_is_named_before_anything_loads(compose_cfg, tmp_path,
                                                                     tiny_assets,
                                                                     no_model_loads):
    teacher = _copy(tiny_assets["teacher"], tmp_path / "t")
    weights = teacher / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(OSError, match=rf"the weights file {weights} is damaged: it holds \d+ "
                                      r"bytes but its header describes \d+ \(truncated"):
        train(compose_cfg(f"teacher.name_or_path={teacher}"))
    weights.unlink()
    (teacher / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors",
                        "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"lacks 2 of the 2 weight shards its index "
                                                r"names \(model-00001-of-00002.safetensors"):
        train(compose_cfg(f"teacher.name_or_path={teacher}"))


def test_examples_longer_than_the_models_positions_are_refused(compose_cfg, tmp_path,
                                                               tiny_assets, no_model_loads):
    student = _copy(tiny_assets["student"], tmp_path / "s")
    config = json.loads((student / "config.json").read_text())
    (student / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
    with pytest.raises(ValueError, match=r"the longest example has \d+ tokens but the student "
                                         r"\(.*/s\) has 16 positions \(max_position_embeddings"
                                         r".*lower data.max_length to 16"):
        train(compose_cfg(f"student.name_or_path={student}"))


@pytest.mark.parametrize("content,message", [
    (None, r"evaluate.path='.*tasks.jsonl': no such file"),
    ('{"messages": [], "task": "a"}\n{"messages": [\n',
     r"evaluate.path: line 1 of .*tasks.jsonl is not a task example"),
    (json.dumps({"messages": [Q, A]}) + "\nnot json\n",
     r"evaluate.path: line 2 of .*tasks.jsonl is not valid JSON"),
])
def test_a_missing_or_broken_task_file_stops_the_run_before_loading(content, message,
                                                                     compose_cfg, tmp_path,
                                                                     no_model_loads):
    tasks = tmp_path / "tasks.jsonl"
    if content is not None:
        tasks.write_text(content)
    with pytest.raises(ConfigError, match=message):
        train(compose_cfg(f"+evaluate.path={tasks}"))


# --- the checkpoint to resume --------------------------------------------------------------
def test_a_checkpoint_of_another_student_is_refused_before_the_teacher_loads(
        compose_cfg, tmp_path, tiny_assets, monkeypatch):
    out = tmp_path / "first"
    train(compose_cfg("+experiment=sft_fkl", "trainer.max_steps=2",
                      "callbacks.checkpoint.every_n_train_steps=2", out=out))
    ckpt = out / "checkpoints/last.ckpt"
    other = tmp_path / "other"
    make_tokenizer(other)
    make_model(other, 78, hidden=24, layers=1, seed=3, tie=True)
    import distill.training.teachers

    def no_teacher(cfg):
        raise AssertionError("the teacher loaded")

    monkeypatch.setattr(distill.training.teachers.LiveTeacher, "load", no_teacher)
    with pytest.raises(ValueError, match=rf"ckpt_path={ckpt} is a checkpoint of another student "
                                         rf"than student.name_or_path={other} \(\d+ weights "
                                         r"differ in shape \(e.g. student.model.embed_tokens."
                                         r"weight: \(78, 16\) in the checkpoint, \(78, 24\)"):
        train(compose_cfg(f"student.name_or_path={other}", f"ckpt_path={ckpt}",
                          out=tmp_path / "second"))
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"{cut} is not a whole checkpoint \(\d+ bytes"):
        train(compose_cfg(f"ckpt_path={cut}", out=tmp_path / "third"))


# --- settings under which nothing learns ---------------------------------------------------
@pytest.mark.parametrize("overrides,message", [
    (["loss.temperature=1e6"], r"loss.temperature=1e\+06: at this temperature both softmaxes "
                               r"are uniform .*nothing learns"),
    (["loss=jsd", "loss.beta=1e-9"], r"loss.beta=1e-09: jsd is then 1e-09 x forward_kl to first "
                                     r"order.*use loss.kind=forward_kl"),
    (["loss=jsd", "loss.beta=0.9999999"], r"x reverse_kl to first order.*loss.kind=reverse_kl"),
])
def test_settings_under_which_nothing_learns_are_refused_with_the_reason(
        overrides, message, compose_cfg, no_model_loads):
    with pytest.raises(ConfigError, match=message):
        train(compose_cfg(*overrides))


@pytest.mark.parametrize("overrides,message", [
    (["loss.temperature=50"], r"loss.temperature=50: the divergence's gradient scales as 1 / T"),
    (["loss=jsd", "loss.beta=0.01"], r"loss.beta=0.01: jsd is then close to 0.01 x forward_kl"),
])
def test_settings_that_learn_slowly_are_warned_about(overrides, message, caplog):
    from hydra import compose, initialize_config_dir

    from distill.run.config import parse

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"), \
            caplog.at_level(logging.WARNING, logger="distill.run.config"):
        parse(compose("train", overrides=overrides))
    assert any(__import__("re").search(message, r.message) for r in caplog.records), caplog.text


# --- what may leave a run ------------------------------------------------------------------
def test_check_finite_refuses_a_state_with_a_nan():
    """The function scripts/export_checkpoint.py calls on a checkpoint's student."""
    state = {"a.weight": torch.ones(2), "b.weight": torch.tensor([1.0, float("nan")]),
             "steps": torch.tensor([3])}
    with pytest.raises(ValueError, match=r"the checkpoint x.ckpt has non-finite weights \(1 "
                                         r"tensors, e.g. \['b.weight'\]\): not exported"):
        check_finite(state, "the checkpoint x.ckpt")
    check_finite({"a.weight": torch.ones(2)}, "fine")


def test_a_moved_caches_repair_command_names_where_it_is_now(tmp_path):
    from distill.cache.verify import repair_hint

    meta = {"command": "distill-cache +experiment=offline_fkl 'cache.dir=/old place/c' seed=1"}
    hint = repair_hint(tmp_path / "moved", meta)
    assert hint.startswith(f"distill-cache +experiment=offline_fkl seed=1 cache.dir="
                           f"{tmp_path / 'moved'} ") and "/old place" not in hint
    assert f"cache.dir={tmp_path / 'c'}" in repair_hint(tmp_path / "c", {})
