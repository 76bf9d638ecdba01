"""The model families people distill: the fused loss sees each one's real logits.

Tiny random models built from transformers' own config classes, saved and loaded back
through `from_pretrained`. For each family: (a) the loss from hidden states and
`lm_head()` equals a float64 divergence on the model's own `forward().logits`, loss and
gradients; the head check accepts it, and refuses it when the loss misreads its head (its
quirk removed, or a quirk it does not have added); (b) the real-model recipe
(`+experiment=hf_sft`, student=hf teacher=hf) trains on saved folders, its first step's
loss equal to the one recomputed from the models' own logits (tests/step_check.py).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import transformers as tf

from distill.data.shift import shift_flat, shift_labels
from distill.losses import linear_divergence
from distill.models.causal_lm import final_hidden_states, lm_head, load_causal_lm
from distill.ops.spec import HeadTransform
from distill.train import train
from distill.training.callbacks.head_check import head_mismatch
from tests.conftest import TOLERANCES
from tests.fixtures import make_tokenizer
from tests.oracle import assert_rows_close, divergence
from tests.step_check import assert_first_step_loss, record_first_step

LLAMA_LIKE = dict(hidden_size=32, intermediate_size=48, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=128)
# name -> (config class, its quirk, head rows past the tokenizer): soft-caps and scales
# are chosen to bend logits of a few units, so a missed quirk changes the loss
FAMILIES = {
    "llama": (tf.LlamaConfig, {}, 0),
    "qwen2": (tf.Qwen2Config, {}, 5),  # Qwen pads its head past the tokenizer
    "qwen3": (tf.Qwen3Config, {"head_dim": 16}, 0),
    "mistral": (tf.MistralConfig, {}, 0),
    "gemma2": (tf.Gemma2Config, {"head_dim": 16, "final_logit_softcapping": 4.0}, 0),
    "gemma3": (tf.Gemma3TextConfig, {"head_dim": 16, "final_logit_softcapping": 4.0}, 3),
    "phi3": (tf.Phi3Config, {}, 0),
    "granite": (tf.GraniteConfig, {"logits_scaling": 4.0, "embedding_multiplier": 2.0,
                                   "residual_multiplier": 0.5}, 0),
    "cohere": (tf.CohereConfig, {"logit_scale": 0.25}, 0),
    "olmo2": (tf.Olmo2Config, {}, 0),
    "gpt2": (tf.GPT2Config, {}, 0),
}
QUIRKY = {"gemma2", "gemma3", "granite", "cohere"}
KINDS = ("forward_kl", "reverse_kl", "jsd")


def family_config(name: str, vocab: int, layers: int):
    cls, quirk, pad_rows = FAMILIES[name]
    ids = dict(pad_token_id=0, bos_token_id=2, eos_token_id=3)
    if name == "gpt2":
        return cls(vocab_size=vocab, n_embd=32, n_layer=layers, n_head=2, n_positions=128,
                   **ids)
    return cls(vocab_size=vocab + pad_rows, num_hidden_layers=layers, **LLAMA_LIKE, **quirk,
               **ids)


def save_family_model(name: str, path, vocab: int, layers: int, seed: int) -> None:
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(family_config(name, vocab, layers))
    with torch.no_grad():  # logits of a few units (tiny random heads give ~0.01)
        model.get_output_embeddings().weight.normal_(0.0, 0.5)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """{family: (student folder, teacher folder)}, one shared tokenizer in every folder."""
    root = tmp_path_factory.mktemp("families")
    tok = make_tokenizer(root / "tokenizer")
    dirs = {}
    for i, name in enumerate(FAMILIES):
        pair = (root / name / "student", root / name / "teacher")
        for j, (path, layers) in enumerate(zip(pair, (1, 2))):
            save_family_model(name, path, len(tok), layers, seed=10 * i + j)
            tok.save_pretrained(path)
        dirs[name] = pair
    return dirs, len(tok)


def reference_loss(student, teacher, ids, labels, kind, temperature, vocab):
    """Float64 divergence on the models' own forward().logits, with the student's final
    hidden states as a leaf (cut where they enter the LM head), and its gradients."""
    student, teacher = copy.deepcopy(student).double(), copy.deepcopy(teacher).double()
    leaf = {}

    def cut(module, args):
        leaf["h"] = args[0].detach().requires_grad_()
        return (leaf["h"],)

    student.get_output_embeddings().register_forward_pre_hook(cut)
    # the tokenizer's rows: padding rows of a head are no token (distill's vocab_size)
    logq = torch.log_softmax(student(ids).logits[:, :-1, :vocab] / temperature, -1)
    with torch.no_grad():
        logp = torch.log_softmax(teacher(ids).logits[:, :-1, :vocab] / temperature, -1)
    per = divergence(logp, logq, kind)  # (B, T - 1)
    keep = labels[:, 1:] != -100
    loss = per[keep].mean()
    loss.backward()
    return loss, leaf["h"], student.get_output_embeddings().weight.grad


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fused_loss_equals_float64_kl_on_the_model_logits(name, family_dirs):
    dirs, vocab = family_dirs
    student, teacher = (load_causal_lm(str(p)) for p in dirs[name])
    kind = KINDS[list(FAMILIES).index(name) % 3]
    ids = torch.randint(4, vocab, (2, 13))
    labels = ids.clone()
    labels[0, :5] = -100
    labels[1, :2] = -100

    hidden = final_hidden_states(student, ids).detach().requires_grad_()  # (2, 13, H)
    with torch.no_grad():
        t_hidden = final_hidden_states(teacher, ids)
    weight, head = lm_head(student)
    t_weight, t_head = lm_head(teacher)
    loss = linear_divergence(shift_flat(hidden), weight, teacher_hidden=shift_flat(t_hidden),
                             teacher_weight=t_weight, student_head=head, teacher_head=t_head,
                             labels=shift_labels(labels), kind=kind, temperature=1.5,
                             vocab_size=vocab)
    loss.backward()

    ref, ref_hidden, ref_weight_grad = reference_loss(student, teacher, ids, labels, kind, 1.5,
                                                      vocab)
    rtol, atol = TOLERANCES[torch.float32]
    torch.testing.assert_close(hidden.double(), ref_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss.double(), ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(hidden.grad.double(), ref_hidden.grad, rtol=1e-4, atol=1e-7)
    assert float(hidden.grad[:, -1].abs().max()) == 0  # the last position predicts nothing
    # the head's gradient, on the tokenizer's rows (padding rows are outside the loss)
    torch.testing.assert_close(weight.grad[:vocab].double(), ref_weight_grad[:vocab],
                               rtol=1e-4, atol=1e-7)
    # row by row: each position's d hidden, each vocab entry's d weight
    assert_rows_close(hidden.grad.flatten(0, 1), ref_hidden.grad.flatten(0, 1), 1e-4, 1e-9,
                      "d hidden")
    assert_rows_close(weight.grad[:vocab], ref_weight_grad[:vocab], 1e-4, 1e-9, "d weight")
    assert ref > 1e-3  # two different models: a loss that a dropped quirk would change


@pytest.mark.parametrize("name", list(FAMILIES))
def test_head_check_accepts_each_family_and_catches_a_misread_head(name, family_dirs,
                                                                  monkeypatch):
    dirs, vocab = family_dirs
    model = load_causal_lm(str(dirs[name][1]))
    ids = torch.randint(4, vocab, (1, 16))
    assert head_mismatch(model, ids, vocab) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as under trainer precision bf16-mixed
        assert head_mismatch(model, ids, vocab) is None
    assert head_mismatch(model.to(torch.bfloat16), ids, vocab) is None  # a bf16 teacher
    model.float()
    import distill.training.callbacks.head_check as hc

    if name in QUIRKY:  # as if distill did not know this family's quirk
        misread = lambda m: (lm_head(m)[0], HeadTransform())  # noqa: E731
        ratio = {"granite": 0.25, "cohere": 0.25}.get(name)  # pure scales: the message says
    else:  # as if distill gave this family a logit scale it does not have
        misread = lambda m: (lm_head(m)[0], dataclasses.replace(lm_head(m)[1], scale=2.0))  # noqa: E731
        ratio = 0.5
    monkeypatch.setattr(hc, "lm_head", misread)
    problem = head_mismatch(model, ids, vocab)
    assert problem is not None and problem.startswith(type(model).__name__)
    assert "differ from the model's own forward().logits" in problem
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert head_mismatch(model, ids, vocab) is not None
    if ratio is not None:
        assert f"about {ratio:.4g} x the loss's" in problem, problem


@pytest.mark.parametrize("name", list(FAMILIES))
def test_real_model_recipe_trains_each_family(name, family_dirs, compose_cfg, tmp_path,
                                              monkeypatch):
    dirs, _ = family_dirs
    student, teacher = dirs[name]
    cfg = compose_cfg("+experiment=hf_sft", f"student.name_or_path={student}",
                      f"teacher.name_or_path={teacher}", "trainer.max_steps=2", "data.val=null",
                      "teacher.dtype=float32",  # the recomputation below is float64
                      "callbacks.checkpoint=null", "callbacks.export=null",
                      "data.packing=" + ("true" if name in QUIRKY else "false"))
    first = record_first_step(monkeypatch)
    summary = train(cfg)
    assert summary["global_step"] == 2
    loss = summary["metrics"]["train/loss"]
    assert torch.isfinite(torch.tensor(loss)) and loss > 0
    # the first step's logged loss is the one of the models' own logits, each document
    # alone (packed for the quirky families), in float64
    assert_first_step_loss(first, cfg.loss)


def test_head_check_refuses_training_when_the_loss_misreads_a_head(family_dirs, compose_cfg,
                                                                  monkeypatch):
    import distill.training.callbacks.head_check as hc

    dirs, _ = family_dirs
    student, teacher = dirs["granite"]
    stripped = lambda m: (lm_head(m)[0], dataclasses.replace(lm_head(m)[1], scale=1.0))  # noqa: E731
    monkeypatch.setattr(hc, "lm_head", stripped)
    cfg = compose_cfg("+experiment=hf_sft", f"student.name_or_path={student}",
                      f"teacher.name_or_path={teacher}", "trainer.max_steps=1")
    with pytest.raises(RuntimeError, match=r"(?s)student GraniteForCausalLM: the loss's logits"
                                           r".*teacher GraniteForCausalLM.*logits_scaling"):
        train(cfg)


def test_readme_real_model_command_runs_as_written(family_dirs, compose_cfg, tmp_path,
                                                   tiny_assets):
    """The README's hf_sft command, its placeholder folders swapped for saved tiny ones."""
    from tests.readme import cpu_overrides, readme_commands

    (command,) = [c for c in readme_commands()
                  if "student.lora" not in c and "cross_tokenizer" not in c]
    dirs, _ = family_dirs
    swap = {"/models/Qwen2.5-0.5B": str(dirs["qwen2"][0]),
            "/models/Qwen2.5-7B-Instruct": str(dirs["qwen2"][1]),
            "/data/chat.jsonl": str(tiny_assets["sft_train"]),
            "/data/chat_val.jsonl": str(tiny_assets["sft_val"])}
    overrides = cpu_overrides(command, swap)
    cfg = compose_cfg("+experiment=hf_sft", *overrides, "trainer.max_steps=2",
                      "trainer.val_check_interval=2", "paths.data=???")
    summary = train(cfg)
    assert summary["global_step"] == 2 and "val/loss" in summary["metrics"]


def test_real_model_recipe_never_falls_back_to_the_demo_data(family_dirs, compose_cfg,
                                                             tiny_assets):
    from distill.run.config import ConfigError

    student, teacher = family_dirs[0]["llama"]
    models = [f"student.name_or_path={student}", f"teacher.name_or_path={teacher}"]
    train_only = f"data.train=[{{name: a, kind: sft, path: {tiny_assets['sft_train']}}}]"
    for data in ([], [train_only]):  # no data at all; a train set but no val set
        cfg = compose_cfg("+experiment=hf_sft", *models, "paths.data=???", *data)
        with pytest.raises(ConfigError, match=r"data\.(train|val)\[0\]\.path cannot be resolved .*"
                                              r"Missing mandatory value: paths\.data"):
            train(cfg)
