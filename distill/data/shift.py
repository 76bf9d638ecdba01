"""Position t of a row predicts token t + 1: the shift from (B, T) rows to trained positions."""

from __future__ import annotations

import torch


def shift_flat(x: torch.Tensor) -> torch.Tensor:
    """(B, T, ...) -> (B * (T - 1), ...): drop the last position, which predicts nothing."""
    return x[:, :-1].reshape(-1, *x.shape[2:])


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B * (T - 1),): position t is trained on token t + 1 (HF-aligned labels)."""
    return labels[:, 1:].reshape(-1)
