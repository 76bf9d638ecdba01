"""The trainer=ddp and trainer=fsdp presets, and how DistillFSDP splits a DistillModule.

FSDP needs CUDA (tests/gpu/check_multi_gpu.py runs it on two GPUs with NCCL); on CPU these
tests check what the preset builds and which FSDP units it chooses. DDP's exact
normalization on gloo is proved in tests/callbacks/test_step_tokens.py.
"""

import functools

import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import DDPStrategy

from distill.models.causal_lm import load_causal_lm
from distill.models.strategies import DistillFSDP, fsdp_units, with_state_entry
from distill.training.module import DistillModule
from distill.training.teachers import LiveTeacher


def test_ddp_preset_builds_a_two_process_ddp_trainer(compose_cfg):
    from distill.run.config import validate

    cfg = compose_cfg("trainer=ddp", "trainer.accelerator=cpu")
    validate(cfg)
    trainer = instantiate(cfg.trainer, callbacks=[], logger=False)
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.num_devices == 2 and trainer.num_nodes == 1


def test_fsdp_preset_composes_to_distill_fsdp_in_bf16_mixed(compose_cfg):

    from distill.run.config import problems

    cfg = compose_cfg("trainer=fsdp")
    found = problems(cfg)  # the schema accepts the preset (on a machine with a GPU)
    assert found == ([] if torch.cuda.is_available() else
                     ["trainer.accelerator=gpu: this machine has no CUDA GPU; use trainer=cpu "
                      "(or trainer.accelerator=auto, which picks the GPU where there is one)"])
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

    from distill.export.callback import ExportStudent

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


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_optimizer_state_survives_a_sharded_checkpoint_round_trip(kind, tmp_path):
    """What DistillFSDP._load_optimizers reads back: torch.distributed.checkpoint drops SGD's
    empty "state" mapping (the cause of the FSDP resume failure); with_state_entry puts it
    back and leaves AdamW's saved state as it was."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    make = (functools.partial(torch.optim.SGD, lr=0.1) if kind == "sgd"
            else functools.partial(torch.optim.AdamW, lr=0.1))
    optim = make(lin.parameters())
    lin(torch.randn(4, 3)).sum().backward()
    optim.step()
    names = ["weight", "bias"]  # FSDP keys optimizer state by parameter name
    saved = optim.state_dict()
    by_name = {"state": {names[i]: s for i, s in saved["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                for g in saved["param_groups"]]}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        dcp.save({"model": lin.state_dict(), "optimizer_0": by_name}, checkpoint_id=tmp_path)
        back = load_sharded_optimizer_state_dict(
            lin.state_dict(), "optimizer_0", dcp.FileSystemReader(tmp_path))["optimizer_0"]
    finally:
        dist.destroy_process_group()
    assert ("state" in back) == (kind == "adamw")
    fixed = with_state_entry(back)
    assert fixed["param_groups"] == by_name["param_groups"]
    assert fixed["state"].keys() == by_name["state"].keys()
    # AdamW's moments come back as one-shard ShardedTensors (world size 1: the whole tensor)
    local = {n: {k: v.local_tensor() if hasattr(v, "local_tensor") else v
                 for k, v in state.items()} for n, state in fixed["state"].items()}
    for name, state in by_name["state"].items():
        assert local[name].keys() == state.keys()
        for k, v in state.items():
            torch.testing.assert_close(local[name][k], v, rtol=0, atol=0)
    # the restored dict loads into a fresh optimizer and gives back the same state
    fresh = make(torch.nn.Linear(3, 2).parameters())
    fresh.load_state_dict({"state": {names.index(n): s for n, s in local.items()},
                           "param_groups": saved["param_groups"]})
    assert len(fresh.state) == len(saved["state"])


def test_a_ddp_run_through_the_cli_ends_with_exit_0_on_both_ranks(tiny_assets, tmp_path):
    """torchrun, two CPU ranks (gloo), the real CLI to its end (export included): exit 0 on
    both ranks, no abort at shutdown, the student exported once."""
    from tests.fixtures import torchrun_train

    run = torchrun_train(tiny_assets, tmp_path / "ddp", "trainer.max_steps=2")
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-4000:]
    assert "terminate called" not in text and "exitcode" not in text
    assert (tmp_path / "ddp" / "student" / "config.json").exists()
