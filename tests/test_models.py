"""Hidden states + LM head from real HF models reproduce the models' own logits."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from distill.data.shift import shift_flat, shift_labels
from distill.losses import linear_divergence
from distill.models.causal_lm import final_hidden_states, lm_head
from distill.training.teachers import LiveTeacher


def test_hidden_and_head_give_the_model_logits(tiny_assets):
    for path in (tiny_assets["teacher"], tiny_assets["student"]):  # untied and tied heads
        model = AutoModelForCausalLM.from_pretrained(path)
        ids = torch.randint(0, model.config.vocab_size, (2, 7))
        with torch.no_grad():
            hidden = final_hidden_states(model, ids)
            weight, head = lm_head(model)
            torch.testing.assert_close(hidden @ weight.T, model(ids).logits)
        assert head.bias is None and head.scale == 1.0 and head.softcap is None


def test_loss_from_live_teacher_matches_full_logits(tiny_assets):
    teacher = LiveTeacher(str(tiny_assets["teacher"]))
    student = AutoModelForCausalLM.from_pretrained(tiny_assets["student"])
    ids = torch.randint(0, student.config.vocab_size, (3, 8))
    labels = ids.clone()
    labels[:, :3] = -100
    batch = {"input_ids": ids, "labels": labels}
    t = teacher.targets(batch)
    hs = shift_flat(final_hidden_states(student, ids))
    loss = linear_divergence(hs, lm_head(student)[0], labels=shift_labels(labels), kind="jsd",
                             **t)
    with torch.no_grad():
        p = torch.log_softmax(teacher.model(ids).logits[:, :-1].double(), -1)
    q = torch.log_softmax(student(ids).logits[:, :-1].double(), -1)
    m = torch.logaddexp(p, q) - torch.log(torch.tensor(2.0))
    per = 0.5 * (p.exp() * (p - m)).sum(-1) + 0.5 * (q.exp() * (q - m)).sum(-1)
    keep = labels[:, 1:] != -100
    torch.testing.assert_close(loss.double(), per[keep].mean(), rtol=1e-5, atol=1e-7)
    assert not teacher.training and teacher.train().training is False


def test_vocab_mismatch_hint_names_the_real_key(tmp_path, tiny_assets, compose_cfg):
    from distill.models.causal_lm import load_tokenizer
    from distill.models.tokenizers import check_same_tokenizer
    from distill.train import train
    from tests.fixtures import make_tokenizer

    other = make_tokenizer(tmp_path / "other", extra_chars="#@")
    with pytest.raises(ValueError, match=r"differ in the vocabularies .*a student of the "
                       r"teacher's family\), or use cross-tokenizer distillation") as e:
        check_same_tokenizer(load_tokenizer(str(tiny_assets["teacher"])), other)
    assert "tokenizer=<teacher path>" not in str(e.value)  # the hint that led to the same
    # the key the message names is the CLI's: student.tokenizer= is how a run meets it
    with pytest.raises(ValueError, match="student.tokenizer's tokenizer and the teacher's differ"):
        train(compose_cfg(f"student.tokenizer={tmp_path / 'other'}"))


@pytest.mark.parametrize("content", ["empty", "config_only", "tokenizer_only"])
def test_folder_without_model_says_what_it_lacks(tmp_path, tiny_assets, content):
    from distill.models.causal_lm import load_causal_lm, load_tokenizer

    folder = tmp_path / content
    folder.mkdir()
    if content == "config_only":
        shutil.copy(tiny_assets["teacher"] / "config.json", folder)
    if content == "tokenizer_only":
        load_tokenizer(str(tiny_assets["teacher"])).save_pretrained(folder)
    if content != "tokenizer_only":
        kind = "tokenizer" if content == "config_only" else "model or tokenizer"
        with pytest.raises(FileNotFoundError, match=f"has no {kind} files .*tokenizer.json") as e:
            load_tokenizer(str(folder))
        assert "sentencepiece" not in str(e.value)
    expect = {"empty": "has no model files .*config.json and its weights",
              "tokenizer_only": "has no model files .*tokenizer_config.json",
              "config_only": "has config.json but no weights .*model.safetensors"}[content]
    with pytest.raises(FileNotFoundError, match=expect):
        load_causal_lm(str(folder))
    if content == "config_only":  # from scratch needs the config alone
        assert load_causal_lm(str(folder), from_scratch=True).config.hidden_size == 32


def test_cli_with_an_empty_model_folder(tmp_path, compose_cfg):
    from distill.train import train

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no model files .it holds nothing.") as e:
        train(compose_cfg("student=hf", f"student.name_or_path={tmp_path / 'empty'}"))
    assert "sentencepiece" not in str(e.value)


def test_head_extras_of_the_families():
    import transformers as tf

    common = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)
    cases = [(tf.GraniteConfig(logits_scaling=8.0, **common), 1 / 8.0, None),
             (tf.CohereConfig(logit_scale=0.0625, **common), 0.0625, None),
             (tf.Gemma2Config(final_logit_softcapping=30.0, head_dim=8, **common), 1.0, 30.0),
             (tf.LlamaConfig(**common), 1.0, None)]
    for cfg, scale, softcap in cases:
        _, head = lm_head(AutoModelForCausalLM.from_config(cfg))
        assert head.scale == pytest.approx(scale, rel=1e-12) and head.softcap == softcap


def test_live_teacher_around_a_model_in_memory(tiny_assets):
    """LiveTeacher.from_model (the benchmarks' random-weight teachers) serves the same
    targets as the teacher loaded from the folder, frozen and in eval mode."""
    from transformers import AutoModelForCausalLM

    from distill.training.teachers import LiveTeacher

    loaded = LiveTeacher(str(tiny_assets["teacher"]))
    wrapped = LiveTeacher.from_model(AutoModelForCausalLM.from_pretrained(tiny_assets["teacher"]))
    wrapped.train()  # Lightning's call: the teacher stays in eval
    assert not wrapped.training and wrapped.name == "LlamaForCausalLM"
    assert not any(p.requires_grad for p in wrapped.parameters())
    batch = {"input_ids": torch.randint(0, 40, (2, 7)), "attention_mask": torch.ones(2, 7)}
    a, b = loaded.targets(batch), wrapped.targets(batch)
    torch.testing.assert_close(a["teacher_hidden"], b["teacher_hidden"])
    torch.testing.assert_close(a["teacher_weight"], b["teacher_weight"])


def test_hub_names_and_local_paths_are_told_apart_one_way():
    from distill.export.card import _is_hub_name
    from distill.models.causal_lm import looks_like_hub_name

    for name in ("gpt2", "Qwen/Qwen2.5-0.5B"):
        assert looks_like_hub_name(name) and _is_hub_name(name)
    for name in ("./student", "/models/student", "~/student", "runs/a/student"):
        assert not looks_like_hub_name(name) and not _is_hub_name(name)
    assert not _is_hub_name(None) and not _is_hub_name("")
