"""Constants every layer shares: the label that marks an untrained position, dtype names,
the prefixes that wrappers add to parameter names."""

from __future__ import annotations

import torch

# labels[t] == IGNORE_INDEX: token t is not trained (Hugging Face's convention)
IGNORE_INDEX = -100

# the dtype names a config may give for model weights; "auto" keeps the checkpoint's
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "auto": "auto"}

# prefixes that FSDP, activation checkpointing and torch.compile add to parameter names
WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def unwrapped(name: str) -> str:
    """A parameter's or module's name without the wrappers' prefixes."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name
