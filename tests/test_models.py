"""Hidden states + LM head from real HF models reproduce the models' own logits."""

import torch
from transformers import AutoModelForCausalLM

from distill.losses import linear_divergence
from distill.models import final_hidden_states, lm_head
from distill.teachers import LiveTeacher, shift_flat, shift_labels


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
