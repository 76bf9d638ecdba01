"""Normalization policies: the masks of one micro-batch + the counts of its optimizer step
-> per-token weights w, so that the step's gradient is grad(sum_i w_i * loss_i).

An optimizer step spans K micro-batches on W data-parallel ranks. `step_*` counts are sums
over all of them (summed before the step starts: distill.data.masks, distill.data.windows).
| policy                    | weight of a valid position                      |
| valid_tokens (default)    | 1 / step_valid                                  |
| all_tokens                | 1 / step_real                                   |
| micro_batch_valid_tokens  | 1 / (local_valid * K * W)   (biased; comparison) |
| sequence_mean             | 1 / (valid_in_its_sequence * step_sequences)    |
K counts the micro-batches of the step's window (an epoch's last window may be shorter).
"""

from __future__ import annotations

import warnings

import torch

from distill.data.masks import StepCounts, TokenMasks

POLICIES = ("valid_tokens", "all_tokens", "sequence_mean", "micro_batch_valid_tokens")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown loss.normalization={policy!r}: choose one of "
                         f"{', '.join(POLICIES)}")
    return policy


_warned: set[str] = set()


def warn_if_biased(policy: str, accumulate: int, world_size: int) -> None:
    """Warn once per process that the per-micro-batch mean is biased when a step spans
    several micro-batches: a token's weight then depends on how full its micro-batch is."""
    if policy != "micro_batch_valid_tokens" or accumulate * world_size == 1:
        return
    if policy in _warned:
        return
    _warned.add(policy)
    warnings.warn(
        f"loss.normalization=micro_batch_valid_tokens averages the per-micro-batch means of "
        f"the step's {accumulate} x {world_size} micro-batches: a token in a micro-batch with "
        "few valid tokens weighs more than one in a full micro-batch, so the gradient is "
        "biased and depends on the split. Use it for comparison only; valid_tokens is exact.",
        UserWarning, stacklevel=2,
    )


def token_weights(policy: str, masks: TokenMasks, step: StepCounts) -> torch.Tensor:
    """(B, T-1) fp32 weights; zero where not valid, and everywhere in an empty step."""
    valid = masks.valid.float()
    if policy == "valid_tokens":
        return valid / max(step.valid, 1)
    if policy == "all_tokens":
        return valid / max(step.real, 1)
    if policy == "micro_batch_valid_tokens":
        # K here is the micro-batches of this step's window, not the configured K: in an
        # epoch's short last window the step stays a mean of micro-batch means, rather than
        # shrinking by window/K the way a naive mean under Lightning's 1/K would.
        local = int(masks.valid.sum())
        return valid / max(local * step.micro_batches * step.world_size, 1)
    if policy == "sequence_mean":
        ids = masks.sequence[masks.valid]
        _, inverse, per_seq = torch.unique(ids, return_inverse=True, return_counts=True)
        w = torch.zeros_like(valid)
        w[masks.valid] = 1.0 / (per_seq[inverse].float() * max(step.sequences, 1))
        return w
    raise ValueError(check_policy(policy))
