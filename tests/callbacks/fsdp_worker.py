"""Run under torchrun with 2 processes: DistillFSDP training on CPU (gloo).

Lightning's FSDPStrategy hands torch's FSDP `device_id=root_device.index`, which is None
for a CPU, and FSDP then refuses: "FSDP needs a non-CPU accelerator device, but no
accelerator device is detected" (torch/distributed/fsdp/_init_utils.py). Given
`device_id=cpu` it shards and trains on gloo. `CpuDistillFSDP` changes that argument and
nothing else: the units, the sharded checkpoints and their loading are DistillFSDP's.

Rank 0 saves to argv[2]: "equality", the gradient of one valid_tokens step (K=2 on W=2,
read as (w0 - w1) / lr after one SGD step, the full state gathered by DistillFSDP); and,
per optimizer, the student after 4 steps uninterrupted ("whole"), after 2 ("first") and
after a sharded checkpoint at step 2 resumed to 4 ("resumed"), with the micro-batches
the resumed fit trained.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from distill.data import StepWindows
from distill.models.strategies import DistillFSDP
from distill.training.callbacks import StepTokenCounter
from distill.training.module import DistillModule
from tests.callbacks import proof
from tests.fixtures import leave_process_group

RANK = int(os.environ.get("RANK", 0))
OPTIMIZERS = {"sgd": (torch.optim.SGD, 0.05), "adamw": (torch.optim.AdamW, 1e-3)}


class CpuDistillFSDP(DistillFSDP):
    """DistillFSDP with torch's FSDP told the device (see the module docstring), and its
    full state gathered without `offload_to_cpu` (see full_state_dict)."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                        mixed_precision=self.mixed_precision_config,
                                        sharding_strategy=self.sharding_strategy,
                                        device_id=torch.device("cpu"), **self.kwargs)

    def full_state_dict(self) -> dict:
        """DistillFSDP's gathers with offload_to_cpu=True (right on GPUs); on a CPU, torch
        2.13's FSDP then fails to copy the gathered tensors ("setStorage: ... out of bounds
        for storage of size 0", or a segfault): they are on the CPU already."""
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=True)):
            return self.model.state_dict()


def fresh_module(assets: str, optimizer, lr: float) -> DistillModule:
    """Own copies of both models: FSDP rewraps what it shards in place."""
    student, teacher = proof.models(assets)
    return DistillModule(copy.deepcopy(student), copy.deepcopy(teacher),
                         loss={**proof.LOSS, "normalization": "valid_tokens"},
                         optimizer=functools.partial(optimizer, lr=lr),
                         vocab_size=student.config.vocab_size)


class Count(L.Callback):
    batches = 0

    def on_train_batch_end(self, *args):
        self.batches += 1


def fit(module, batches, k, max_steps, callbacks=(), ckpt_path=None, **kw):
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=max_steps, max_epochs=-1,
                        strategy=CpuDistillFSDP(state_dict_type="sharded"),
                        accumulate_grad_batches=k, precision="32-true", logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False,
                        callbacks=[StepTokenCounter(), *callbacks], **kw)
    loader = DataLoader(proof.CountingBatches(batches), batch_size=None)
    trainer.fit(module, train_dataloaders=StepWindows.from_loader(loader, k),
                ckpt_path=ckpt_path)
    full = trainer.strategy.full_state_dict()  # every rank takes part; rank 0 gets it
    return {k[len("student."):]: v.clone() for k, v in full.items()
            if k.startswith("student.")}, trainer


def equality(assets: str) -> dict:
    lr = 1e3  # w1 = w0 - lr g: a large lr keeps the rounding of w out of g
    module = fresh_module(assets, torch.optim.SGD, lr)
    w0 = {k: v.detach().clone() for k, v in module.student.state_dict().items()}
    vocab = module.student.config.vocab_size
    w1, _ = fit(module, proof.micro_batches(RANK, vocab)[:2], 2, 1, enable_checkpointing=False)
    return {k: (w0[k].double() - w1[k].double()) / lr for k in w1}


def resume(assets: str, folder: Path, name: str) -> dict:
    optimizer, lr = OPTIMIZERS[name]
    vocab = proof.models(assets)[0].config.vocab_size
    batches = proof.micro_batches(RANK, vocab)[:6]  # K=2: 3 steps an epoch
    whole, _ = fit(fresh_module(assets, optimizer, lr), batches, 2, 4, enable_checkpointing=False)
    save = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(folder), save_last=True,
                                               every_n_train_steps=2)
    first, _ = fit(fresh_module(assets, optimizer, lr), batches, 2, 2, [save],
                   enable_checkpointing=True)
    count = Count()
    last = folder / "last.ckpt"
    resumed, _ = fit(fresh_module(assets, optimizer, lr), batches, 2, 4, [count],
                     ckpt_path=str(last), enable_checkpointing=False)
    return {"whole": whole, "first": first, "resumed": resumed, "loaded": count.batches,
            "sharded": last.is_dir() and any(last.glob("*.distcp"))}


if __name__ == "__main__":
    assets, out, folder = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    results = {"equality": equality(assets)}
    for name in OPTIMIZERS:
        results[name] = resume(assets, folder / name, name)
    if RANK == 0:
        torch.save(results, out)
    leave_process_group()
