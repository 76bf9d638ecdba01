"""The trainer=ddp and trainer=fsdp presets, and how DistillFSDP splits a DistillModule.

FSDP needs CUDA (scripts/check_multi_gpu.py runs it on two GPUs with NCCL); on CPU these
tests check what the preset builds and which FSDP units it chooses. DDP's exact
normalization on gloo is proved in tests/callbacks/test_step_tokens.py.
"""

import functools

import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import DDPStrategy

from distill.models import load_causal_lm
from distill.module import DistillModule
from distill.strategies import DistillFSDP, fsdp_units
from distill.teachers import LiveTeacher


def test_ddp_preset_builds_a_two_process_ddp_trainer(compose_cfg):
    from distill.config import validate

    cfg = compose_cfg("trainer=ddp", "trainer.accelerator=cpu")
    validate(cfg)
    trainer = instantiate(cfg.trainer, callbacks=[], logger=False)
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.num_devices == 2 and trainer.num_nodes == 1


def test_fsdp_preset_composes_to_distill_fsdp_in_bf16_mixed(compose_cfg):
    from distill.config import validate

    cfg = compose_cfg("trainer=fsdp")
    validate(cfg)  # the schema accepts the preset
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.precision == "bf16-mixed"
    strategy = instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, DistillFSDP)
    assert strategy._state_dict_type == "sharded"
    strategy.precision_plugin = FSDPPrecision("bf16-mixed")
    mp = strategy.mixed_precision_config
    # bf16 compute, fp32 gradient reduction, buffers (RoPE frequencies) left as they are
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == \
        (torch.bfloat16, torch.float32, None)
    strategy = DistillFSDP(reduce_fp32=False)
    strategy.precision_plugin = FSDPPrecision("bf16-mixed")
    assert strategy.mixed_precision_config.reduce_dtype == torch.bfloat16  # Lightning's own


def test_fsdp_refuses_a_wrap_policy_it_would_override():
    with pytest.raises(ValueError, match="chooses the FSDP units itself.*auto_wrap_policy"):
        DistillFSDP(auto_wrap_policy={torch.nn.Linear})


def test_units_are_the_decoder_layers_and_the_teacher_head_is_replicated(tiny_assets):
    student = load_causal_lm(str(tiny_assets["student"]))
    teacher = LiveTeacher(str(tiny_assets["teacher"]))
    module = DistillModule(student, teacher, loss={"kind": "forward_kl"},
                           optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    layers, replicated = fsdp_units(module)
    assert {t.__name__ for t in layers} == {"LlamaDecoderLayer"}
    t = teacher.model
    want = {id(t.model.embed_tokens.weight), id(t.model.norm.weight), id(t.lm_head.weight)}
    assert {id(p) for p in replicated} == want
    # the student's head (tied to its embeddings) stays in the root unit, sharded
    assert not {id(p) for p in student.parameters()} & {id(p) for p in replicated}


def test_a_cached_teacher_replicates_nothing(tiny_assets):
    student = load_causal_lm(str(tiny_assets["student"]))

    class Cached(torch.nn.Module):
        model = None

    module = DistillModule(student, Cached(), loss={"kind": "forward_kl"},
                           optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    layers, replicated = fsdp_units(module)
    assert {t.__name__ for t in layers} == {"LlamaDecoderLayer"} and replicated == []


def test_export_gathers_the_full_state_even_with_sharded_checkpoints(tiny_assets, tmp_path):
    """With state_dict_type=sharded, lightning_module_state_dict gives shards: the export
    must use DistillFSDP.full_state_dict instead."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from distill.callbacks.export import ExportStudent

    student = load_causal_lm(str(tiny_assets["student"]))
    trained = {f"student.{k}": v + 1.0 for k, v in student.state_dict().items()}

    class Sharded(DistillFSDP):  # the type only: no process group, no GPU
        def lightning_module_state_dict(self):
            raise AssertionError("the export read the sharded state")

        def full_state_dict(self):
            return trained

        def barrier(self, name=None):
            pass

    trainer = SimpleNamespace(strategy=Sharded(state_dict_type="sharded"), is_global_zero=True)
    ExportStudent(tmp_path / "export").on_train_end(trainer, SimpleNamespace(student=student))
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    for key, value in again.items():
        torch.testing.assert_close(value, trained[f"student.{key}"], rtol=0, atol=0, msg=key)
