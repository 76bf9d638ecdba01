"""Normalization policies: the masks of one micro-batch + the counts of its optimizer step
-> per-token weights w, so that the step's gradient is grad(sum_i w_i * loss_i).

An optimizer step spans K micro-batches on W data-parallel ranks. `step_*` counts are sums
over all of them (the StepTokenCounter callback computes them before the step starts).
| policy                    | weight of a valid position                      |
| valid_tokens (default)    | 1 / step_valid                                  |
| all_tokens                | 1 / step_real                                   |
| micro_batch_valid_tokens  | 1 / (local_valid * K * W)   (biased; comparison) |
| sequence_mean             | 1 / (valid_in_its_sequence * step_sequences)    |
K counts the micro-batches of the step's window (an epoch's last window may be shorter).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

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


@dataclass
class TokenMasks:
    """Shifted masks of one micro-batch: position t predicts token t + 1."""

    valid: torch.Tensor  # (B, T-1) bool: has a label
    real: torch.Tensor  # (B, T-1) bool: predicts a real (non-padding) token of its sequence
    sequence: torch.Tensor  # (B, T-1) int64: sequence id per position, unique in the batch


@dataclass
class StepCounts:
    valid: int
    real: int
    sequences: int
    micro_batches: int = 1  # K in the window (the last window of an epoch may be shorter)
    world_size: int = 1  # W
    accumulate: int = 1  # the configured K, which Lightning divides the loss by


def batch_masks(batch: dict, ignore_index: int = -100) -> TokenMasks:
    labels, attn = batch["labels"], batch.get("attention_mask")
    if attn is None:
        attn = torch.ones_like(labels)
    attn = attn.bool()
    valid = labels[:, 1:] != ignore_index
    real = attn[:, 1:] & attn[:, :-1]
    b, t = labels.shape
    row = torch.arange(b, device=labels.device)[:, None].expand(b, t - 1)
    pos = batch.get("position_ids")
    if pos is None:
        sequence = row
    else:
        # packed rows: a document starts where position_ids resets to 0; its first token
        # is predicted by no one, so the boundary position is not real.
        starts = pos[:, 1:] == 0
        real = real & ~starts
        sequence = row * t + torch.cumsum(starts, dim=1)
    return TokenMasks(valid=valid & real, real=real, sequence=sequence.long())


def count(masks: TokenMasks) -> dict[str, int]:
    """Counts of one micro-batch: valid, real, and sequences with >= 1 valid position."""
    seqs = torch.unique(masks.sequence[masks.valid])
    return {"valid": int(masks.valid.sum()), "real": int(masks.real.sum()),
            "sequences": int(seqs.numel())}


def count_tensor(batch: dict, ignore_index: int = -100) -> torch.Tensor:
    """(3,) int64 [valid, real, sequences] of one micro-batch, ready to be summed."""
    c = count(batch_masks(batch, ignore_index))
    return torch.tensor([c["valid"], c["real"], c["sequences"]], dtype=torch.int64)


def local_step_counts(masks: TokenMasks) -> StepCounts:
    """Counts when the step is this micro-batch alone (no accumulation, one rank)."""
    return StepCounts(**count(masks))


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
