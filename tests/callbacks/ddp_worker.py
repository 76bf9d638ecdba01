"""Run under torchrun with 2 processes: the normalization proof's fits on DDP (gloo).

Each rank trains on its own micro-batches (`proof.micro_batches(rank)`); rank 0 saves the
gradient of every optimizer step for every policy and K to the path in argv[2].
"""

import os
import sys

import torch

from distill.training.normalization import POLICIES
from tests.callbacks import proof
from tests.fixtures import leave_process_group

if __name__ == "__main__":
    assets, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    student, _ = proof.models(assets)
    batches = proof.micro_batches(rank, student.config.vocab_size)
    results = {}
    for k in (1, 3, 4):
        for policy in POLICIES:
            module = proof.make_module(assets, policy)
            results[(policy, k)] = proof.fit_grads(module, batches, k, devices=2)
    if rank == 0:
        torch.save(results, out)
    leave_process_group()
