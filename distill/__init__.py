"""distill: distil large language models into small ones with PyTorch Lightning.

The loss (`distill.losses.linear_divergence`) works from final hidden states and LM-head
weights in chunks, so the (tokens x vocab) logits of student and teacher never exist.
`distill.fit(student, teacher, data, **settings)` runs a whole distillation from Python
(distill/run/api.py); `distill-train` is the same run from the command line.
"""

from distill.losses import FusedLinearDivergence, linear_divergence

__all__ = ["Fitted", "FusedLinearDivergence", "fit", "linear_divergence"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # the Python API imports the data and training stack: only when it is used
    if name in ("fit", "Fitted"):
        from distill.run import api

        return getattr(api, name)
    raise AttributeError(f"module 'distill' has no attribute {name!r}")
