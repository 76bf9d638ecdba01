"""FSDP for a student and a live teacher (the `trainer=fsdp` preset).

Lightning's FSDPStrategy wraps the whole LightningModule in one FSDP unit unless told how
to split it. `DistillFSDP` splits it so that both models are sharded and the fused loss
still sees full LM-head weights:

- every decoder layer of the student and of the teacher is its own unit (one dtype per
  unit: the student's fp32 master weights, the teacher's bf16);
- the student's embeddings, final norm and LM head stay in the root unit, which is
  gathered for the whole training step (Lightning calls `training_step` through the root's
  forward and FSDP keeps the root unsharded until backward), so the loss gets the full
  (V, H) head and FSDP reduce-scatters its gradient like any other;
- the teacher's parameters outside its decoder layers (embeddings, final norm, LM head:
  about 2 GiB at 8B) are left out of FSDP and replicated: the teacher hands its head to the
  loss outside any forward, where a sharded weight would be a flat piece of it.

`full_state_dict()` gathers the full state for the HF export even when checkpoints are
sharded. With `bf16-mixed`, gradients are reduced in fp32 (Lightning's default reduces them in
bf16) and buffers (RoPE frequencies) keep their dtype. Sharded checkpoints leave the frozen
teacher out, as DistillModule's checkpoints do; loading them restores the student and its
optimizer only.
"""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.strategies import FSDPStrategy

from distill.models.levers import decoder_layers

# the file beside the shards of a sharded checkpoint folder (Lightning's layout: its trainer
# state and the loops'; the shards are torch.distributed.checkpoint files)
SHARDED_METADATA = "meta.pt"


def _state_dict_type(module, full: bool):
    """torch's FSDP state-dict context: full (gathered on rank 0, on CPU) or sharded."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.api import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
    )

    if full:
        return FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT,
                                    FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                                    FullOptimStateDictConfig(offload_to_cpu=True,
                                                             rank0_only=True))
    return FSDP.state_dict_type(module, StateDictType.SHARDED_STATE_DICT,
                                ShardedStateDictConfig(offload_to_cpu=True),
                                ShardedOptimStateDictConfig(offload_to_cpu=True))


class DistillFSDP(FSDPStrategy):
    def __init__(self, reduce_fp32: bool = True, **kwargs):
        if "auto_wrap_policy" in kwargs or "ignored_states" in kwargs:
            raise ValueError("DistillFSDP chooses the FSDP units itself (decoder layers; the "
                             "teacher's head replicated): drop auto_wrap_policy / "
                             "ignored_states, or use lightning's FSDPStrategy directly")
        super().__init__(**kwargs)
        self.reduce_fp32 = reduce_fp32

    @property
    def mixed_precision_config(self):
        from torch.distributed.fsdp import MixedPrecision

        config = super().mixed_precision_config
        if config is None or self.mixed_precision is not None or not self.reduce_fp32:
            return config
        if config.param_dtype in (torch.bfloat16, torch.float16):
            return MixedPrecision(param_dtype=config.param_dtype, reduce_dtype=torch.float32)
        return config

    def setup(self, trainer) -> None:
        # the units are chosen from the module Lightning is about to wrap (public: the
        # strategy's constructor kwargs, read when it wraps the model in super().setup)
        module = self.lightning_module
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        layers, ignored = fsdp_units(module)
        self.kwargs["auto_wrap_policy"] = ModuleWrapPolicy(layers)
        for p in ignored:  # FSDP moves only what it manages
            p.data = p.data.to(self.root_device)
        self.kwargs["ignored_states"] = ignored
        super().setup(trainer)

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        path = Path(self.broadcast(checkpoint_path))
        if not (path.is_dir() and (path / SHARDED_METADATA).is_file()):
            return super().load_checkpoint(checkpoint_path, weights_only)
        with _state_dict_type(self.model, full=False):
            full = self.model.state_dict()
            # the checkpoint holds no teacher (DistillModule.on_save_checkpoint): load the
            # rest and keep the teacher as it is
            saved = {"model": {k: v for k, v in full.items() if not k.startswith("teacher.")}}
            torch.distributed.checkpoint.load(saved, checkpoint_id=path)
            self.model.load_state_dict({**full, **saved["model"]})
            if self.lightning_module.trainer.state.fn == "fit":
                self._load_optimizers(path, saved["model"])
        metadata = torch.load(path / SHARDED_METADATA, weights_only=weights_only)
        # the weights are in place already; DistillModule.on_load_checkpoint still expects
        # the key (it adds the teacher's entries, which FSDP's load_model_state_dict ignores)
        metadata.setdefault("state_dict", {})
        return metadata

    def full_state_dict(self) -> dict:
        """The whole module's state gathered on rank 0 (every rank must call it), whatever
        state_dict_type the checkpoints use: what the HF export needs."""
        with _state_dict_type(self.model, full=True):
            return self.model.state_dict()

    def _load_optimizers(self, path: Path, model_state: dict) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel

        for i, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{i}"
            state = load_sharded_optimizer_state_dict(
                model_state_dict=model_state, optimizer_key=key,
                storage_reader=FileSystemReader(path))
            optimizer.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(
                optim_state_dict=with_state_entry(state[key]), model=self.model,
                optim=optimizer))


def with_state_entry(optim_state: dict) -> dict:
    """The optimizer state read back from a sharded checkpoint, with its "state" entry.

    torch.distributed.checkpoint stores only the leaves of the nested dict it saves, so an
    empty mapping leaves no trace: an optimizer that keeps no per-parameter state (SGD without
    momentum: `state == {}`) is saved as its param_groups alone, and
    `load_sharded_optimizer_state_dict` rebuilds the dict from the stored leaves without a
    "state" key, which `FSDP.optim_state_dict_to_load` refuses. An absent entry can only have
    been an empty one, so it is put back as such; a saved state (AdamW) is left untouched."""
    return {"state": {}, **optim_state}


def fsdp_units(module) -> tuple[set[type], list[torch.nn.Parameter]]:
    """(the decoder-layer classes that become FSDP units, the parameters left replicated)
    of a DistillModule."""
    teacher = getattr(getattr(module, "teacher", None), "model", None)
    models = [module.student] + ([teacher] if teacher is not None else [])
    layers = {type(m) for model in models for m in decoder_layers(model)}
    return layers, replicated_teacher_params(module)


def replicated_teacher_params(module) -> list[torch.nn.Parameter]:
    """The live teacher's parameters outside its decoder layers (none for a cached one)."""
    teacher = getattr(getattr(module, "teacher", None), "model", None)
    if teacher is None:
        return []
    in_layers = {id(p) for layer in decoder_layers(teacher) for p in layer.parameters()}
    return [p for p in teacher.parameters() if id(p) not in in_layers]
