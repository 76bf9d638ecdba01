"""distill: distil large language models into small ones with PyTorch Lightning.

The loss (`distill.losses.linear_divergence`) works from final hidden states and LM-head
weights in chunks, so the (tokens x vocab) logits of student and teacher never exist.
"""

from distill.losses import FusedLinearDivergence, linear_divergence

__all__ = ["FusedLinearDivergence", "linear_divergence"]
__version__ = "0.1.0"
