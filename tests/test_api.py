"""distill.fit: in-memory models and data through the same schema, callbacks and
normalization as the command line; the trained student and the run's folder come back."""

from __future__ import annotations

import json

import datasets
import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

import distill
from distill.data import memory, sources
from distill.run.config import ConfigError
from distill.train import train

SMALL = {"trainer": {"max_steps": 3, "val_check_interval": 3, "log_every_n_steps": 1},
         "data": {"batch_size": 4}, "callbacks": {"progress": {"refresh_rate": 0}}}


def _rows(path):
    return [json.loads(line) for line in open(path)]


def _losses(out):
    (path,) = out.glob("logs/version_*/metrics.csv")
    return pd.read_csv(path)["train/loss"].dropna().tolist()


def test_fit_trains_in_memory_objects_and_returns_the_student_and_its_folder(tiny_assets,
                                                                            tmp_path):
    student = AutoModelForCausalLM.from_pretrained(tiny_assets["student"])
    teacher = AutoModelForCausalLM.from_pretrained(tiny_assets["teacher"])
    before = {k: v.clone() for k, v in student.state_dict().items()}
    val = datasets.Dataset.from_list(_rows(tiny_assets["sft_val"]))
    result = distill.fit(student, teacher, _rows(tiny_assets["sft_train"]), val_dataset=val,
                         output_dir=tmp_path / "run", loss="reverse_kl", **SMALL)
    student_out, folder, summary = result  # a NamedTuple
    assert student_out is student and folder == tmp_path / "run"
    assert any(not torch.equal(before[k], v) for k, v in student.state_dict().items())
    assert summary["global_step"] == 3 and summary["metrics"]["val/loss"] > 0
    assert summary["accuracy"] == {}  # no demo-task scoring of one's own models
    # the run's folder as the command line writes it: logs, checkpoints, the export, a card
    saved = AutoModelForCausalLM.from_pretrained(folder / "student")
    for k, v in student.state_dict().items():
        torch.testing.assert_close(saved.state_dict()[k], v, rtol=0, atol=0)
    assert (folder / "checkpoints/last.ckpt").is_file() and len(_losses(folder)) == 3
    card = (folder / "student/README.md").read_text()
    assert "kind=reverse_kl" in card and "`train` (sft: `memory://train-" in card
    assert not memory._HELD  # the in-memory data sets are let go after the run


def test_fit_is_the_command_lines_run(tiny_assets, tmp_path, compose_cfg):
    """The same data from memory and from its file, the same settings: the same losses."""
    overrides = ["+experiment=hf_sft", "trainer.max_steps=3", "data.val=null",
                 f"data.train=[{{name: train, kind: sft, path: {tiny_assets['sft_train']}}}]"]
    train(compose_cfg(*overrides, out=tmp_path / "cli"))
    distill.fit(str(tiny_assets["student"]), str(tiny_assets["teacher"]),
                _rows(tiny_assets["sft_train"]), output_dir=tmp_path / "api",
                trainer={"max_steps": 3, "log_every_n_steps": 1}, data={"batch_size": 4})
    assert _losses(tmp_path / "api") == pytest.approx(_losses(tmp_path / "cli"), rel=1e-6)


def test_settings_go_through_the_schema(tiny_assets, tmp_path):
    student, teacher = str(tiny_assets["student"]), str(tiny_assets["teacher"])
    rows = _rows(tiny_assets["sft_train"])
    with pytest.raises(ConfigError, match=r"loss\.temprature: unknown key \(did you mean "
                                          r"loss\.temperature\?\)"):
        distill.fit(student, teacher, rows, loss={"temprature": 2.0})
    with pytest.raises(ConfigError, match=r"loss\.on_policy\.fraction=1\.5"):
        distill.fit(student, teacher, rows, loss={"on_policy": {"fraction": 1.5}})
    assert not memory._HELD


def test_a_lora_student_in_memory_gets_its_adapters(tiny_assets, tmp_path):
    from peft.tuners.lora import LoraLayer

    student = AutoModelForCausalLM.from_pretrained(tiny_assets["student"])
    result = distill.fit(student, str(tiny_assets["teacher"]), _rows(tiny_assets["sft_train"]),
                         output_dir=tmp_path / "run", student={"lora": {"r": 4}}, **SMALL)
    assert any(isinstance(m, LoraLayer) for m in result.student.modules())
    assert (tmp_path / "run/student/adapter_model.safetensors").is_file()


def test_onpolicy_from_python_with_prompt_rows(tiny_assets, tmp_path):
    prompts = [{"prompt": r["messages"][0]["content"]} for r in _rows(tiny_assets["sft_train"])]
    result = distill.fit(str(tiny_assets["student"]), str(tiny_assets["teacher"]), prompts,
                         experiment="hf_onpolicy", output_dir=tmp_path / "run",
                         loss={"on_policy": {"max_new_tokens": 6}}, **SMALL)
    assert result.summary["metrics"]["rollout/mean_length"] > 0  # every prompt row sampled


def test_a_model_built_in_memory_needs_a_folder(tiny_assets):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match=r"student was built in memory.*save_pretrained"):
        distill.fit(model, str(tiny_assets["teacher"]), [{"text": "a b"}])


@pytest.mark.parametrize("row, kind", [({"messages": []}, "sft"), ({"prompt": "x",
                                       "completion": "y"}, "sft"), ({"prompt": "x"}, "prompts"),
                                       ({"text": "x"}, "cpt")])
def test_the_kind_of_in_memory_rows_is_read_from_their_columns(row, kind):
    assert memory.infer_kind(list(row)) == kind


def test_in_memory_sources_and_their_errors():
    path = memory.register([{"text": "a"}, {"text": "b"}], "mine")
    try:
        assert len(sources.load_source({"name": "mine", "kind": "cpt", "path": path})) == 2
        with pytest.raises(ValueError, match=r"'mine' \(sft\) has no column 'messages'"):
            sources.load_source({"name": "mine", "kind": "sft", "path": path})
    finally:
        memory.release(path)
    with pytest.raises(ValueError, match="no longer held"):
        sources.load_source({"name": "mine", "kind": "cpt", "path": path})
    with pytest.raises(TypeError, match="a datasets.Dataset or a list of dicts"):
        memory.register("not rows")
    with pytest.raises(ValueError, match="cannot tell the kind"):
        memory.infer_kind(["question"])
