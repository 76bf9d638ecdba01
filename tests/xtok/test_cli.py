"""A cross-tokenizer run through the command line's own path: `train(cfg)` with
`loss.cross_tokenizer=...`, a ChatML (Qwen2-style) teacher and a Llama-3-header student
(and back), tiny models saved with save_pretrained: the data are paired before any model
loads, the student trains on its own tokens, the loss goes down, the export reloads."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from distill.train import train
from tests.xtok.families import make_family_tokenizer
from tests.xtok.test_teachers import CHATS, SMALL

FAMILY_MODELS = {"qwen": (Qwen2Config, Qwen2ForCausalLM), "llama3": (LlamaConfig, LlamaForCausalLM)}


def _folder(root, family: str, seed: int):
    tok = make_family_tokenizer(family, root / family)
    cfg_cls, cls = FAMILY_MODELS[family]
    torch.manual_seed(seed)
    model = cls(cfg_cls(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                        eos_token_id=tok.eos_token_id, **SMALL))
    model.save_pretrained(root / family)
    return root / family, tok


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("xtok_cli")
    data = root / "data"
    data.mkdir()
    rows = [{"messages": chat} for chat in CHATS] * 6
    for split in ("train", "val"):
        (data / f"sft_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    qwen, _ = _folder(root, "qwen", 1)
    llama, _ = _folder(root, "llama3", 2)
    return {"qwen": qwen, "llama3": llama, "data": data}


@pytest.mark.parametrize("mode", ["hybrid", "uld"])
@pytest.mark.parametrize("student,teacher", [("llama3", "qwen"), ("qwen", "llama3")])
def test_cross_tokenizer_run_trains_and_exports(folders, student, teacher, mode, compose_cfg,
                                                tmp_path):
    out = tmp_path / "run"
    cfg = compose_cfg("+experiment=hf_sft", "trainer=cpu", f"loss.cross_tokenizer={mode}",
                      f"student.name_or_path={folders[student]}",
                      f"teacher.name_or_path={folders[teacher]}", "teacher.dtype=float32",
                      f"paths.data={folders['data']}", "data.max_length=96",
                      "data.batch_size=4", "trainer.max_steps=12", "optimizer.lr=3e-3",
                      "scheduler=none", "trainer.val_check_interval=12",
                      "callbacks.checkpoint=null", out=out)
    summary = train(cfg)
    assert summary["global_step"] == 12
    import pandas as pd

    df = pd.read_csv(next(out.glob("logs/version_*/metrics.csv")))
    losses = df["train/loss"].dropna().tolist()
    assert len(losses) == 12 and all(map(lambda v: v == v, losses))  # finite, logged
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3  # it learns the teacher's spans
    again = AutoModelForCausalLM.from_pretrained(summary["student_dir"])
    assert again.config.vocab_size == AutoModelForCausalLM.from_pretrained(
        folders[student]).config.vocab_size
    # the export carries the student's own tokenizer, not the teacher's
    exported = json.loads((out / "student" / "tokenizer_config.json").read_text())
    own = json.loads((folders[student] / "tokenizer_config.json").read_text())
    assert exported.get("eos_token") == own.get("eos_token")


def test_the_readme_cross_tokenizer_command_runs_as_written(folders, compose_cfg, tmp_path):
    """The README's command, its placeholder folders swapped for the tiny Qwen / Llama-3 pair."""
    from tests.readme import cpu_overrides, readme_commands

    (command,) = [c for c in readme_commands() if "loss.cross_tokenizer=" in c]
    swap = {"/models/Qwen2.5-0.5B": str(folders["qwen"]),
            "/models/Llama-3.2-3B-Instruct": str(folders["llama3"]),
            "/data/chat": str(folders["data"])}
    overrides = cpu_overrides(command, swap)
    cfg = compose_cfg("+experiment=hf_sft", *overrides, "trainer.max_steps=2",
                      "trainer.val_check_interval=2", "data.max_length=96",
                      out=tmp_path / "run")
    summary = train(cfg)
    assert summary["global_step"] == 2 and "val/loss" in summary["metrics"]


def test_without_cross_tokenizer_the_pair_is_refused(folders, compose_cfg):
    with pytest.raises(ValueError, match="differ in the vocabularies .*cross-tokenizer "
                       r"distillation \(loss.cross_tokenizer=hybrid\)"):
        train(compose_cfg("+experiment=hf_sft", "trainer=cpu",
                          f"student.name_or_path={folders['llama3']}",
                          f"teacher.name_or_path={folders['qwen']}",
                          f"paths.data={folders['data']}"))


def test_packing_is_refused_before_anything_loads(folders, compose_cfg):
    from distill.run.config import ConfigError

    with pytest.raises(ConfigError, match="loss.cross_tokenizer=hybrid with data.packing=true"):
        train(compose_cfg("+experiment=hf_sft", "trainer=cpu", "loss.cross_tokenizer=hybrid",
                          "data.packing=true", "student.name_or_path=/nonexistent/s",
                          "teacher.name_or_path=/nonexistent/t",
                          f"paths.data={folders['data']}"))


def test_on_policy_across_tokenizers_trains_on_retokenized_samples(folders, compose_cfg,
                                                                    tmp_path):
    """The student answers the prompts in its own tokens, the teacher writes half the rows in
    its own; each sample is re-tokenized for the other model and the run trains on both."""
    out = tmp_path / "onpolicy"
    cfg = compose_cfg("+experiment=hf_sft", "trainer=cpu", "loss.cross_tokenizer=hybrid",
                      f"student.name_or_path={folders['llama3']}",
                      f"teacher.name_or_path={folders['qwen']}", "teacher.dtype=float32",
                      f"paths.data={folders['data']}", "data.max_length=96",
                      "data.batch_size=4", "trainer.max_steps=4", "scheduler=none",
                      "trainer.accumulate_grad_batches=2", "trainer.val_check_interval=4",
                      "loss.on_policy.fraction=1.0", "loss.on_policy.teacher_fraction=0.5",
                      "loss.on_policy.max_new_tokens=6", "loss.ce_weight=0.5",
                      "callbacks.checkpoint=null", out=out)
    summary = train(cfg)
    assert summary["global_step"] == 4
    import pandas as pd

    df = pd.read_csv(next(out.glob("logs/version_*/metrics.csv")))
    assert df["rollout/mean_length"].dropna().between(1, 6).all()
    assert len(df["train/loss"].dropna()) == 4 and (df["train/loss"].dropna() > 0).all()


def test_a_cached_cross_tokenizer_teacher_is_written_once_and_trains(folders, compose_cfg,
                                                                      tmp_path):
    """distill-cache with loss.cross_tokenizer writes the teacher's side of every example;
    the training run with the same overrides reads it, and one with another teacher
    tokenizer is refused naming the field."""
    from distill.cache.format import CacheMismatch
    from distill.run.cache import cache_teacher_logits

    common = ["+experiment=hf_sft", "trainer=cpu", "loss.cross_tokenizer=hybrid",
              f"student.name_or_path={folders['llama3']}",
              f"teacher.name_or_path={folders['qwen']}", "teacher.dtype=float32",
              f"paths.data={folders['data']}", "data.max_length=96", "data.batch_size=4",
              "teacher=cached", "teacher.kind=cached", f"cache.dir={tmp_path / 'cache'}",
              "cache.top_k=8"]
    summary = cache_teacher_logits(compose_cfg(*common, out=tmp_path / "c"))
    assert summary["examples"] == {"train": 18, "val": 18}
    run = train(compose_cfg(*common, "trainer.max_steps=3", "scheduler=none",
                            "callbacks.checkpoint=null", out=tmp_path / "t"))
    assert run["global_step"] == 3
    with pytest.raises(CacheMismatch, match="teacher_tokenizer differs"):
        train(compose_cfg(*common, f"teacher.tokenizer={folders['llama3']}",
                          out=tmp_path / "u"))


def test_the_demo_distils_into_a_student_with_a_tokenizer_of_its_own(tmp_path):
    """`scripts/make_cross_student.py`'s BPE student under `+experiment=onpolicy_demo
    loss.cross_tokenizer=hybrid`: the teacher is scored with its own (character) tokenizer,
    as it scores alone; the rollout log decodes the student's samples with the student's
    tokenizer and gives no teacher log-prob (the sample's tokens are not the teacher's)."""
    from pathlib import Path

    import distill
    from distill.demo.evaluation import load_examples, task_accuracy
    from distill.models.causal_lm import load_tokenizer
    from tests.fixtures import load_script

    root = Path(__file__).resolve().parents[2]
    script = load_script("scripts/make_cross_student.py")
    student = tmp_path / "student"
    script.main(["--out", str(student)])
    bpe = load_tokenizer(str(student))
    assets = Path(distill.__file__).parent / "demo" / "assets"
    chars = load_tokenizer(str(assets / "teacher"))
    assert bpe.tokenize("permute abcdefg") != chars.tokenize("permute abcdefg")

    from hydra import compose, initialize_config_dir

    out = tmp_path / "run"
    with initialize_config_dir(config_dir=str(root / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[
            "+experiment=onpolicy_demo", "trainer=cpu", "loss.cross_tokenizer=hybrid",
            f"student.name_or_path={student}", f"paths.output_dir={out}",
            "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.log_every_n_steps=1",
            "evaluate.max_examples=16", "callbacks.samples.every_n_steps=1",
            "callbacks.checkpoint=null", "callbacks.progress.refresh_rate=0"])
    summary = train(cfg)
    teacher = AutoModelForCausalLM.from_pretrained(assets / "teacher")
    alone = task_accuracy(teacher, chars, load_examples(assets / "data" / "tasks_test.jsonl",
                                                         16), max_new_tokens=14)
    assert summary["accuracy"]["teacher"]["overall"] == alone["overall"] >= 0.9
    rows = [json.loads(line) for line in next(out.glob("logs/version_*/samples.jsonl")).open()]
    assert rows and all(r["teacher_logprob"] is None for r in rows)
    for row in rows:  # decoded by the student's BPE (the teacher's would misread its ids)
        assert "permute " in row["prompt"] and row["prompt"].endswith("<|assistant|>")
