"""The token masks and counts of a micro-batch, the facts every normalization policy reads.

Position t of a row predicts token t + 1, so the masks are shifted: a position is *valid*
when it has a label, *real* when it and the token it predicts are real (not padding, not a
packed document's first token, which nothing predicts). `count_tensor` is what the train
loader's workers compute for each micro-batch of a step window (distill.data.windows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
