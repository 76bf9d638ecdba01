"""What a divergence is (kind, beta, temperature, ...) and how an LM head maps hidden to logits.

`DivergenceSpec` holds the loss options and their rules, once: the functional API, the
kernels, the chunked CPU path and the config (`loss.*`, whose schema extends this class)
all read the same, already-checked numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distill.core.rules import boolean, check, choice, number, setting

KINDS = ("forward_kl", "reverse_kl", "jsd")
SPARSE_MODES = ("tail", "renormalize")

# Reverse KL on cached targets: the teacher's tail mass is floored here. With fp16
# log-probs the top-k can sum to >= 1, and KL(q || p) with p_tail = 0 would be infinite.
TAIL_FLOOR = 1e-8


@dataclass(frozen=True)
class DivergenceSpec:
    kind: str = setting("reverse_kl", choice(KINDS))
    beta: float = setting(0.5, number(0, strict=False, hi=1, what=" (jsd only)"))
    temperature: float = setting(1.0, number(0, strict=True, what=" (it divides the logits)"))
    # multiply the divergence by T**2 (Hinton et al.): gradients keep their scale across T
    temperature_squared: bool = setting(False, boolean())
    ce_weight: float = setting(0.0, number(0, strict=False))
    divergence_weight: float = setting(1.0, number(0, strict=False,
                                                   what=" (0 trains the CE term alone)"))
    # cached targets: 'tail' (K + 1 buckets) or 'renormalize' (the top-k alone)
    sparse_mode: str = setting("tail", choice(SPARSE_MODES))

    def __post_init__(self):
        check(self)

    def problems(self, prefix: str = "") -> list[str]:
        """Rules over several fields (the single-field rules live in each `setting`)."""
        out = []
        if self.kind == "jsd" and not 0 < self.beta < 1:
            out.append(f"{prefix}beta={self.beta!r}: jsd needs beta strictly inside (0, 1); "
                       f"at 0 or 1 the mixture equals one of the two distributions and the "
                       f"loss vanishes: use {prefix or 'loss.'}kind=forward_kl or "
                       f"{prefix or 'loss.'}kind=reverse_kl")
        return out

    @property
    def divergence_factor(self) -> float:
        """What the divergence is multiplied by (T**2 when temperature_squared)."""
        t2 = self.temperature**2 if self.temperature_squared else 1.0
        return t2 * self.divergence_weight

    def spec(self) -> DivergenceSpec:
        """The divergence options alone (a subclass, e.g. the loss config, carries more)."""
        if type(self) is DivergenceSpec:
            return self
        return DivergenceSpec(kind=self.kind, beta=self.beta, temperature=self.temperature,
                              temperature_squared=self.temperature_squared,
                              ce_weight=self.ce_weight,
                              divergence_weight=self.divergence_weight,
                              sparse_mode=self.sparse_mode)


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

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The full logits of this head (small inputs only: checks and references)."""
        z = hidden @ weight.T
        if self.bias is not None:
            z = z + self.bias.to(z.dtype)
        z = z * self.scale
        if self.softcap is not None:
            z = self.softcap * torch.tanh(z / self.softcap)
        return z

    def rows(self, vocab: int) -> HeadTransform:
        """The same head cut to its first `vocab` rows (heads padded past the tokenizer)."""
        if self.bias is None or self.bias.shape[0] == vocab:
            return self
        return HeadTransform(self.bias[:vocab], self.scale, self.softcap)

    @property
    def identity(self) -> bool:
        """Adds nothing to hidden @ weight.T (most families' heads)."""
        return self.bias is None and self.scale == 1.0 and self.softcap is None


def op_head(head: HeadTransform | None, vocab: int) -> HeadTransform | None:
    """The head as the ops take it: cut to `vocab` rows, None when it adds nothing.

    `models.lm_head` gives every family a HeadTransform, an identity one for most. The ops
    read None as "plain hidden @ weight.T" and only then take their fast path (the row
    kernel applies the token weights and writes the gradient in the GEMMs' dtype; a live
    teacher's logits come from the stats GEMM); an identity head would cost (C, V) fp32
    temporaries per chunk for nothing (docs/notes/step_profile_2026-12-01.md).
    """
    return None if head is None or head.identity else head.rows(vocab)


# How the Triton row kernels find the largest logit, whose gradient they write last as
# minus the others' sum (distill.ops.divergence_triton; docs/notes/kernels.md has both)
ROW_FIXUPS = ("lane", "block")


def check_row_fixup(name: str) -> None:
    if name not in ROW_FIXUPS:
        raise ValueError(f"row_fixup={name!r}: use " + " or ".join(map(repr, ROW_FIXUPS)))
