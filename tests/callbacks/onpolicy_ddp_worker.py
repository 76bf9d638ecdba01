"""Run under torchrun with 2 processes: on-policy fits on DDP (gloo). Each rank samples its
own windows; rank 0 saves the gradient of every optimizer step to the path in argv[2]."""

import os
import sys

import torch

from tests.callbacks import proof
from tests.callbacks.test_onpolicy_steps import _module
from tests.fixtures import leave_process_group

if __name__ == "__main__":
    assets, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    student, _ = proof.models(assets)
    batches = proof.micro_batches(rank, student.config.vocab_size)
    grads = proof.fit_grads(_module(assets), batches, 3, devices=2)
    if rank == 0:
        torch.save(grads, out)
    leave_process_group()
