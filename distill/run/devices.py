"""What `trainer=auto` (the preset of the recipes for one's own models) runs on, found when
the run starts: a CUDA GPU with bf16 compute where there is one, else the CPU in fp32.

`precision: ${distill_precision:}` in conf/trainer/auto.yaml; Lightning's own
`accelerator: auto` picks the device. A preset that names a GPU (trainer=gpu) on a machine
without one is refused before anything loads (distill.run.config).
"""

from __future__ import annotations


def auto_precision() -> str:
    """bf16-mixed on a CUDA GPU that computes in bf16 (fp32 master weights, bf16 autocast),
    32-true elsewhere: bf16 autocast on a CPU is slower than fp32 and rounds more."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"
