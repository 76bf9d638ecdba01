"""The Lightning versions distill is tested with, checked when a run starts.

The step-token pre-count (distill.callbacks.step_tokens) reaches into Lightning's fit loop
(`fit_loop._combined_loader`, `_data_fetcher`, the epoch loop's batch progress): private
attributes that may change in any minor release without notice. A run on a Lightning
outside the tested range therefore stops at start rather than risk mis-normalized steps;
DISTILL_ALLOW_UNTESTED_LIGHTNING=1 turns the stop into a warning (at your own risk).
"""

from __future__ import annotations

import os
import warnings

import lightning
from packaging.version import Version

TESTED = (Version("2.6"), Version("2.7"))  # [lower, upper): keep in step with pyproject.toml
ESCAPE = "DISTILL_ALLOW_UNTESTED_LIGHTNING"


def check_lightning_version(version: str | None = None) -> None:
    found = Version(version or lightning.__version__)
    lower, upper = TESTED
    if lower <= found < upper:
        return
    msg = (f"lightning {found} is outside the range distill is tested with (>={lower}, "
           f"<{upper}): the StepTokenCounter reads Lightning internals that change between "
           f"releases. Install a tested one (pip install 'lightning>={lower},<{upper}'), or "
           f"set {ESCAPE}=1 to run anyway and check the step token counts yourself")
    if os.environ.get(ESCAPE, "") in ("1", "true", "yes"):
        warnings.warn(msg, UserWarning, stacklevel=2)
        return
    raise RuntimeError(msg)
