"""student.disable_dropout (on by default, as TRL's distillation trainers): in train mode the
student computes the same function twice, whether its family keeps dropout in nn.Dropout
modules (GPT-2) or as a rate its attention layers pass to the attention kernel (Llama,
Qwen2); off, dropout is kept as configured."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from distill.models.lora import load_student

CONFIGS = {
    "llama": lambda v: tf.LlamaConfig(vocab_size=v, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, attention_dropout=0.5),
    "qwen2": lambda v: tf.Qwen2Config(vocab_size=v, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, attention_dropout=0.5),
    "gpt2": lambda v: tf.GPT2Config(vocab_size=v, n_embd=32, n_layer=2, n_head=2,
                                    resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = tf.AutoModelForCausalLM.from_config(CONFIGS[request.param](64),
                                                attn_implementation="eager")
    model.save_pretrained(path)
    return path


def _twice(model):
    ids = torch.randint(0, 64, (2, 12))
    assert model.training  # load_student leaves the student in train mode, as fit runs it
    return model(ids).logits, model(ids).logits


def test_dropout_is_off_by_default(folder):
    model = load_student(str(folder), attn_implementation="eager")
    a, b = _twice(model)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the export too: the saved config has no dropout left
    assert all(getattr(model.config, k, 0.0) == 0.0 for k in
               ("attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"))


def test_dropout_stays_when_asked(folder):
    model = load_student(str(folder), attn_implementation="eager", disable_dropout=False)
    a, b = _twice(model)
    assert (a - b).abs().max() > 1e-3
