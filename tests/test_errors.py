"""Bad input gets a clear error that names the problem and the fix."""

import json

import pytest
import torch

from distill.losses import linear_divergence
from distill.models.causal_lm import load_causal_lm, load_tokenizer
from distill.models.tokenizers import check_same_tokenizer
from distill.train import train
from tests.fixtures import make_tokenizer


def _tiny(n=5, v=11, h=4):
    return dict(student_hidden=torch.randn(n, h), student_weight=torch.randn(v, h),
                teacher_hidden=torch.randn(n, h), teacher_weight=torch.randn(v, h))


@pytest.mark.parametrize("kw,message", [
    (dict(kind="kl"), "kind='kl': must be one of forward_kl, reverse_kl, jsd"),
    (dict(temperature=0.0), "temperature=0.0: must be a finite number > 0 (it divides the "
                            "logits)"),
    (dict(temperature=-1.0), "temperature=-1.0: must be a finite number > 0"),
    (dict(kind="jsd", beta=0.0), "loss.kind=forward_kl or loss.kind=reverse_kl"),
    (dict(kind="jsd", beta=1.0), "strictly inside (0, 1)"),
    (dict(ce_weight=1.0), "ce_weight > 0 needs labels"),
])
def test_loss_options_are_checked(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        linear_divergence(**_tiny(), **kw)


def test_unknown_kind_in_config_fails_before_training(compose_cfg):
    with pytest.raises(ValueError, match="loss.kind='rkl': must be one of forward_kl"):
        train(compose_cfg("+experiment=sft_rkl", "loss.kind=rkl"))


def test_unknown_normalization_is_refused(compose_cfg):
    with pytest.raises(ValueError, match="loss.normalization='tokens': must be one of"):
        train(compose_cfg("+experiment=sft_rkl", "loss.normalization=tokens"))


def test_missing_model_path(compose_cfg, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist: point student.name_or_path"):
        load_causal_lm(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(compose_cfg("+experiment=sft_rkl", f"teacher.name_or_path={tmp_path}/missing"))


def test_different_tokenizers_are_refused(tmp_path, tiny_assets, compose_cfg):
    other = make_tokenizer(tmp_path / "other", extra_chars="#@")
    with pytest.raises(ValueError, match="the student's tokenizer and the teacher's differ in "
                       r"the vocabularies \(78 vs 80 tokens"):
        check_same_tokenizer(load_tokenizer(str(tiny_assets["teacher"])), other)
    with pytest.raises(ValueError, match="student.tokenizer's tokenizer and the teacher's "
                       "differ"):
        train(compose_cfg("+experiment=sft_rkl", f"student.tokenizer={tmp_path / 'other'}"))


def test_dataset_without_trainable_token(tmp_path, tiny_assets, compose_cfg):
    data = tmp_path / "data"
    data.mkdir()
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x"}]}
    for split in ("train", "val", "test"):
        (data / f"sft_{split}.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="no trainable token"):
        train(compose_cfg("+experiment=sft_rkl", f"paths.data={data}"))


def test_empty_dataset(tmp_path, compose_cfg):
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val", "test"):
        (data / f"sft_{split}.jsonl").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        train(compose_cfg("+experiment=sft_rkl", f"paths.data={data}"))


def test_vocab_mismatch_between_heads():
    x = _tiny()
    x["teacher_weight"] = torch.randn(13, 4)
    with pytest.raises(ValueError, match="pass vocab_size=len"):
        linear_divergence(**x)
