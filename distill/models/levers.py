"""Performance switches (`speed:` in conf/train.yaml), applied once the models are built.

Each lever changes how the student and the live teacher run, never what they compute:
gradient checkpointing of the student's decoder layers, `torch.compile` of each decoder
layer (regional compilation: one layer's code is compiled once and reused by every layer,
which keeps the compile time to seconds at 8B), Liger-Kernel's fused RMSNorm / SwiGLU /
RoPE patched into the model instances, and the attention implementation (sdpa by default;
flash-attention 2 when the package is installed). docs/benchmarks.md measures each.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from distill.core.rules import boolean, choice, setting, text

ATTENTION = ("sdpa", "eager", "flash_attention_2", "flex_attention")


@dataclass(frozen=True)
class Speed:
    """`speed:` what each lever gives is measured in docs/benchmarks.md."""

    # student only: the teacher keeps no activations
    gradient_checkpointing: bool = setting(False, boolean())
    compile: bool = setting(False, boolean())  # torch.compile each decoder layer
    compile_backend: str = setting("inductor", text())
    liger: bool = setting(False, boolean())  # Liger-Kernel RMSNorm / SwiGLU / RoPE
    attention: str | None = setting(None, choice(ATTENTION, null=True))  # null: the models'

    def active(self) -> list[str]:
        on = [n for n in ("gradient_checkpointing", "compile", "liger") if getattr(self, n)]
        return on + ([f"attention={self.attention}"] if self.attention else [])


def packed_attention(speed: Speed, packing: bool) -> str | None:
    """The attention a run uses: `speed.attention` as set, or for packed rows on CUDA the
    one that masks documents apart without a dense (B, 1, T, T) mask: flash-attention 2
    where it is installed, else flex_attention (sdpa and eager build the dense mask, and
    lose sdpa's flash kernel: docs/benchmarks.md measures both)."""
    if speed.attention is not None or not packing or not torch.cuda.is_available():
        return speed.attention
    from transformers.utils import is_flash_attn_2_available

    return "flash_attention_2" if is_flash_attn_2_available() else "flex_attention"


def apply_levers(speed: Speed, student, teacher_model=None, packing: bool = False) -> list[str]:
    """Switch the levers on for `student` and, where they apply, `teacher_model` (a live
    teacher's HF model; None for a cached teacher). Returns what was applied."""
    models = [m for m in (student, teacher_model) if m is not None]
    attention = packed_attention(speed, packing)
    if attention:
        for model in models:
            set_attention(model, attention)
    if speed.liger:
        for model in models:
            apply_liger(model)
    if speed.gradient_checkpointing:
        # non-reentrant: works with frozen inputs, FSDP units and torch.compile
        student.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    if speed.compile:
        for model in models:
            compile_layers(model, speed.compile_backend)
    applied = speed.active()
    if attention != speed.attention:
        applied.append(f"attention={attention} (packed rows on CUDA)")
    return applied


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of an HF causal LM (the modules HF checkpoints one by one)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise TypeError(f"{type(model).__name__} has no decoder layers that distill "
                        "recognizes (transformers' GradientCheckpointingLayer subclasses)")
    return layers


def compile_layers(model, backend: str = "inductor") -> None:
    """torch.compile each decoder layer in place (parameter names are unchanged, so
    checkpoints and the HF export are the same as without it)."""
    for layer in decoder_layers(model):
        # dynamic=None: a second sequence length (batches padded per batch, generation)
        # compiles one shape-generic graph instead of one graph per length
        layer.compile(backend=backend, dynamic=None)


def apply_liger(model) -> None:
    """Patch Liger-Kernel's fused RMSNorm, SwiGLU MLP and RoPE into this model instance,
    through the family's public `apply_liger_kernel_to_<family>(..., model=model)`."""
    import inspect

    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as err:
        raise ImportError("speed.liger=true needs liger-kernel: pip install liger-kernel "
                          "(it runs Triton kernels on CUDA GPUs)") from err
    if not torch.cuda.is_available():
        raise RuntimeError("speed.liger=true needs a CUDA GPU (Liger's kernels are Triton GPU "
                           "kernels): set speed.liger=false on CPU")
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model.config.model_type)
    if apply is None:
        raise ValueError(f"liger-kernel has no kernels for model_type="
                         f"{model.config.model_type!r}: set speed.liger=false")
    # the loss never calls the model's head: the cross-entropy patches stay off
    wanted = dict(rope=True, rms_norm=True, swiglu=True, geglu=True, cross_entropy=False,
                  fused_linear_cross_entropy=False)
    accepted = inspect.signature(apply).parameters
    apply(model=model, **{k: v for k, v in wanted.items() if k in accepted})


def compiler_stance(stance: str):
    """`torch.compiler.set_stance(stance)` as a context (torch >= 2.6); a no-op context on
    older torch, which has no stances (its callers say what happens there)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance(stance) if set_stance is not None else contextlib.nullcontext()


def compiled_graphs() -> int | None:
    """Graphs torch.compile (dynamo) has built in this process so far; None where torch does
    not count them. distill.training.callbacks.CompileWatch reads it."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return int(counters["stats"]["unique_graphs"])


def set_attention(model, implementation: str) -> None:
    if implementation.startswith("flash"):
        from transformers.utils import is_flash_attn_2_available

        if not is_flash_attn_2_available():
            raise ImportError(f"speed.attention={implementation} needs the flash-attn package "
                              "(pip install flash-attn, CUDA GPUs only); sdpa is the default")
    model.set_attn_implementation(implementation)
