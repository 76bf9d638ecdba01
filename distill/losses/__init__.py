"""The public loss API: `linear_divergence`, `linear_cross_entropy` and the module form
`FusedLinearDivergence`; `DivergenceSpec` holds the options, `HeadTransform` a head's extras."""

from distill.losses.fused import FusedLinearDivergence, linear_cross_entropy, linear_divergence
from distill.ops.spec import DivergenceSpec, HeadTransform

__all__ = ["DivergenceSpec", "FusedLinearDivergence", "HeadTransform", "linear_cross_entropy",
           "linear_divergence"]
