"""The public loss API: `linear_divergence` and its module form `FusedLinearDivergence`."""

from distill.losses.fused import FusedLinearDivergence, linear_divergence
from distill.losses.spec import DivergenceSpec, HeadTransform

__all__ = ["DivergenceSpec", "FusedLinearDivergence", "HeadTransform", "linear_divergence"]
