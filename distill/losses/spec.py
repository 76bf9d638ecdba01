"""What a divergence is (kind, beta, temperature, ...) and how an LM head maps hidden to logits.

Both are small frozen dataclasses validated once, so the kernels, the chunked CPU path and
the reference all read the same, already-checked numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("forward_kl", "reverse_kl", "jsd")
SPARSE_MODES = ("tail", "renormalize")


@dataclass(frozen=True)
class DivergenceSpec:
    kind: str = "reverse_kl"
    beta: float = 0.5
    temperature: float = 1.0
    ce_weight: float = 0.0
    ignore_index: int = -100
    temperature_squared: bool = False  # multiply the divergence by T**2 (Hinton et al.)
    sparse_mode: str = "tail"  # cached targets: 'tail' (K+1 buckets) or 'renormalize'
    divergence_weight: float = 1.0  # 0 with ce_weight > 0 trains on hard labels alone

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(
                f"unknown loss kind {self.kind!r}: choose one of {', '.join(KINDS)} "
                "(e.g. loss.kind=forward_kl)"
            )
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0, got {self.temperature}: logits are divided by it "
                "(use 1.0 for the plain softmax)"
            )
        if self.kind == "jsd" and not 0 < self.beta < 1:
            raise ValueError(
                f"jsd needs beta strictly inside (0, 1), got {self.beta}: at 0 or 1 the "
                "mixture equals one of the two distributions and the loss vanishes; use "
                "loss.kind=forward_kl or loss.kind=reverse_kl for a one-sided divergence"
            )
        if self.ce_weight < 0 or self.divergence_weight < 0:
            raise ValueError(f"ce_weight and divergence_weight must be >= 0, got "
                             f"{self.ce_weight} and {self.divergence_weight}")
        if self.sparse_mode not in SPARSE_MODES:
            raise ValueError(
                f"unknown sparse_mode {self.sparse_mode!r}: choose 'tail' or 'renormalize'"
            )

    @property
    def divergence_factor(self) -> float:
        """What the divergence is multiplied by (T**2 when temperature_squared)."""
        t2 = self.temperature**2 if self.temperature_squared else 1.0
        return t2 * self.divergence_weight


@dataclass(frozen=True)
class HeadTransform:
    """The extras some LM heads add on top of hidden @ weight.T.

    logits = softcap * tanh(((hidden @ weight.T) + bias) * scale / softcap)
    `scale` is Cohere's logit_scale, `softcap` Gemma's final_logit_softcapping.
    """

    bias: torch.Tensor | None = None  # (V,)
    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self):
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")

# Reverse KL on cached targets: the teacher's tail mass is floored here. With fp16
# log-probs the top-k can sum to >= 1, and KL(q || p) with p_tail = 0 would be infinite.
TAIL_FLOOR = 1e-8
