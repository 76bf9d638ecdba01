"""The sampler's generation weights: a persistent copy of a trainable student in the compute
dtype, refreshed in place before each rollout.

Decoding reads every weight once per token, so it runs on bf16 weights, not on the fp32
masters; a LoRA student's adapters are merged into the copy (W + scaling * B @ A, in fp32),
so decoding costs what the plain model costs. The copy is a plain model of the student's own
class, built on the meta device (no random init) and filled from the student. It is refreshed
with `copy_`, never rebuilt: the CUDA graphs of the decode step hold its addresses.

With `fused`, the copy of a Llama-family model decodes through fused_layers' modules (its
q/k/v and gate/up weights fused, the original names kept as views for the refresh).

A frozen model already in the compute dtype (the live teacher) needs no copy.
"""

from __future__ import annotations

import copy
import logging

import torch

from distill.core.constants import unwrapped

log = logging.getLogger(__name__)


def needs_copy(model, dtype: torch.dtype) -> bool:
    """A copy unless every weight is frozen, already in `dtype`, and carries no adapter."""
    return bool(getattr(model, "peft_config", None)) or any(
        p.requires_grad or p.dtype != dtype for p in model.parameters())


def _lora_layer_type():
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft: no LoRA student either
        return ()
    return LoraLayer


class GenerationCopy:
    """`model` (a transformers causal LM, possibly with PEFT adapters injected in place) as a
    plain model of the same class in `dtype`, on the same device, eval mode, no grad."""

    def __init__(self, model, dtype: torch.dtype, fused: bool | None = False):
        """fused: True: fused decode modules (an error where the model has another layer
        structure); None: where supported; False: the model's own modules."""
        sharded = [n for n, p in model.named_parameters()
                   if type(p).__name__ in ("DTensor", "FlatParameter")
                   or type(p.data).__name__ == "DTensor"]
        if sharded:
            raise ValueError(f"the static sampler copies whole weights, and {sharded[0]} is "
                             "sharded (FSDP): use the HF sampler with FSDP")
        device = next(model.parameters()).device
        config = copy.deepcopy(model.config)
        with torch.device("meta"):  # sdpa to build (the sampler sets its own attention after)
            self.model = type(model)._from_config(config, dtype=dtype, attn_implementation="sdpa")
        self.model.to_empty(device=device)  # new tensors: a tied head is untied here
        if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
            self.model.get_output_embeddings().weight = self.model.get_input_embeddings().weight
        self.model.eval().requires_grad_(False)
        self.dtype = dtype
        sources = {unwrapped(n): b for n, b in model.named_buffers()}
        with torch.no_grad():
            for name, buf in self.model.named_buffers():  # rotary tables: computed, not trained
                if name not in sources:
                    raise ValueError(f"the generation copy has a buffer {name!r} that "
                                     f"{type(model).__name__} lacks")
                buf.copy_(sources[name])
        self.fused, targets = self._fuse(fused)
        self._plan = _plan(model, targets)
        self.nbytes = sum(t.numel() * t.element_size() for t in targets.values())
        self.refresh()

    def _fuse(self, fused: bool | None) -> tuple[bool, dict]:
        from distill.onpolicy.fused_layers import install, supported

        why = supported(self.model) if fused is not False else "fused=False"
        if fused and why:
            raise ValueError(f"the static sampler's fused decode (fused=True): {why}")
        if why:
            log.info("static sampler: the model's own modules decode (%s)", why)
            return False, dict(self.model.named_parameters())
        return True, install(self.model)

    @torch.no_grad()
    def refresh(self) -> None:
        """The student's current weights into the copy, in place (same addresses)."""
        for dst, src, lora in self._plan:
            if lora is None:
                dst.copy_(src)
            else:
                dst.copy_(_merged(src, lora))


def _plan(model, targets: dict) -> list:
    """(destination, source, LoRA layer or None) for every parameter of the copy, from the
    copy's {parameter name: tensor} (tied weights once)."""
    LoraLayer = _lora_layer_type()
    modules = {unwrapped(n): m for n, m in model.named_modules()}
    plan = []
    for name, dst in targets.items():
        owner, _, leaf = name.rpartition(".")
        module = modules.get(owner)
        if module is None:
            raise ValueError(f"{type(model).__name__} has no module {owner!r} for the "
                             f"generation copy's {name!r}")
        if LoraLayer and isinstance(module, LoraLayer):
            _check_mergeable(module, owner)
            base = getattr(module.get_base_layer(), leaf)
            plan.append((dst, base, module if leaf == "weight" else None))
        else:
            plan.append((dst, getattr(module, leaf), None))
        if plan[-1][1].shape != dst.shape:
            raise ValueError(f"{name}: the student's weight is {tuple(plan[-1][1].shape)}, "
                             f"the generation copy's {tuple(dst.shape)}")
    return plan


def _check_mergeable(module, name: str) -> None:
    adapters = [a for a in module.active_adapters if a in module.lora_A]
    if getattr(module, "fan_in_fan_out", False):
        raise ValueError(f"{name}: LoRA with fan_in_fan_out (Conv1D layers) is not supported "
                         "by the static sampler")
    for a in adapters:
        if a in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(a):
            raise ValueError(f"{name}: the adapter {a!r} is a LoRA variant (DoRA, ...); the "
                             "static sampler merges plain LoRA only")
        if getattr(module, "lora_bias", {}).get(a):
            raise ValueError(f"{name}: the adapter {a!r} has lora_bias=True; the static "
                             "sampler merges plain LoRA only")


def _merged(base: torch.Tensor, module) -> torch.Tensor:
    """W + sum over active adapters of scaling * B @ A, in fp32 (one layer at a time)."""
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return base  # already folded into the base weight, or switched off
    out = base.float()
    for a in module.active_adapters:
        if a in module.lora_A:
            b, w = module.lora_B[a].weight.float(), module.lora_A[a].weight.float()
            out = torch.addmm(out, b, w, alpha=module.scaling[a])  # (out, r) @ (r, in)
    return out
