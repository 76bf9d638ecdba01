"""ExportStudent: the saved folder is the student, whatever form the gathered state dict has."""

from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from distill.export.callback import ExportStudent
from distill.models.causal_lm import load_causal_lm


def test_gathered_state_dict_with_untied_copies_saves_like_the_model(tiny_assets, tmp_path):
    """FSDP's full state dict holds tied embeddings as two separate tensors: the export keeps
    the keys save_pretrained keeps, and the folder reloads to the same weights."""
    student = load_causal_lm(str(tiny_assets["student"]))  # tied input/output embeddings
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # not the weights already on disk
    gathered = {f"student.{k}": v.clone() for k, v in
                student.state_dict().items()}  # clone: no shared storage left
    gathered["teacher.x"] = torch.zeros(1)
    trainer = SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(
        lightning_module_state_dict=lambda: gathered, barrier=lambda name: None))
    ExportStudent(tmp_path / "fsdp").on_train_end(trainer, SimpleNamespace(student=student))
    student.save_pretrained(tmp_path / "plain")
    a = load_file(tmp_path / "fsdp" / "model.safetensors")
    b = load_file(tmp_path / "plain" / "model.safetensors")
    assert a.keys() == b.keys() and "lm_head.weight" not in a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp")
    for (k, p), q in zip(student.named_parameters(), again.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=k)


def test_fsdp_scores_the_exported_student_other_strategies_the_module(tiny_assets, tmp_path):
    """After an FSDP fit the module holds flat shards; the report reads the export back."""
    from lightning.pytorch.strategies import FSDPStrategy

    from distill.demo.task_eval import trained_student

    class FakeFSDP(FSDPStrategy):  # the type only: no process group, no GPU
        def __init__(self):
            pass

        @property
        def root_device(self):
            return torch.device("cpu")

    student = load_causal_lm(str(tiny_assets["student"]))
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    student.save_pretrained(tmp_path / "student")
    export = SimpleNamespace(saved_to=tmp_path / "student")
    fsdp = SimpleNamespace(strategy=FakeFSDP())
    again = trained_student(student, fsdp, export)
    assert again is not student
    for (k, p), q in zip(student.named_parameters(), again.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=k)
    assert trained_student(student, fsdp, SimpleNamespace(saved_to=None)) is None
    assert trained_student(student, SimpleNamespace(strategy=object()), export) is student
