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
    cfg = compose_cfg("trainer=ddp", "trainer.accelerator=cpu")
    trainer = instantiate(cfg.trainer, callbacks=[], logger=False)
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.num_devices == 2 and trainer.num_nodes == 1


def test_fsdp_preset_composes_to_distill_fsdp_in_bf16_mixed(compose_cfg):
    cfg = compose_cfg("trainer=fsdp")
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
