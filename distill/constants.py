"""Constants every layer shares: the label that marks an untrained position, dtype names."""

from __future__ import annotations

import torch

# labels[t] == IGNORE_INDEX: token t is not trained (Hugging Face's convention)
IGNORE_INDEX = -100

# the dtype names a config may give for model weights; "auto" keeps the checkpoint's
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "auto": "auto"}
