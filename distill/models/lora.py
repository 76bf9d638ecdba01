"""LoRA students: low-rank adapters (PEFT) on a frozen pretrained student.

The student configs' `_target_` is `load_student`: `load_causal_lm`, plus LoRA adapters
injected in place when `lora.r` is set (`student.lora.r=16`). The model stays a plain
transformers model (PEFT's `inject_adapter_in_model`, not a `PeftModel` wrapper), so its
final hidden states, LM head, generation and checkpoints work as for full fine-tuning.
Only the adapters train, plus the LM head with `lora.train_head=true`; a frozen head gets
no gradient, so the fused loss skips its weight-gradient GEMM. ExportStudent saves the
adapter in PEFT's format (`PeftModel.from_pretrained(base, folder)`), or the merged model
(`callbacks.export.merge=true`, `AutoModelForCausalLM.from_pretrained(folder)`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from distill.core.constants import MODEL_DTYPES, unwrapped
from distill.core.rules import (
    Rule,
    boolean,
    choice,
    integer,
    is_number,
    number,
    parse,
    setting,
    strings,
    text,
)
from distill.models.causal_lm import load_causal_lm, resolve_path

log = logging.getLogger(__name__)
ADAPTER = "default"  # PEFT's adapter name; one adapter per student


@dataclass(frozen=True)
class LoraConfig:
    """`student.lora:` r=null trains every weight; r=16 trains rank-16 adapters."""

    r: int | None = setting(None, integer(1, null=True, what=" (the LoRA rank; null: full "
                                                         "fine-tuning)"))
    alpha: float | None = setting(None, number(0, strict=True, null=True, what=" (null: 2 * r)"))
    dropout: float = setting(0.0, Rule(lambda v: is_number(v) and 0 <= v < 1,
                                       "a number in [0, 1)"))
    target_modules: str | list[str] = setting("all-linear", strings(also_text=True))
    train_head: bool = setting(False, boolean())

    @property
    def enabled(self) -> bool:
        return self.r is not None

    @property
    def scale_alpha(self) -> float:
        return 2 * self.r if self.alpha is None else self.alpha


@dataclass(frozen=True)
class StudentConfig:
    """`student:` the model that trains (a Hugging Face folder or hub name)."""

    name_or_path: str = setting(rule=text())
    from_scratch: bool = setting(False, boolean())  # only the config: random weights
    dtype: str = setting("float32", choice(tuple(MODEL_DTYPES)))
    attn_implementation: str | None = setting(None, text(null=True))
    seed: int | None = setting(None, integer(0, null=True))
    tokenizer: str | None = setting(None, text(null=True))  # null: its folder's, or the teacher's
    disable_dropout: bool = setting(True, boolean())  # TRL's default for distillation
    lora: LoraConfig = setting(factory=LoraConfig)

    def problems(self, prefix: str = "") -> list[str]:
        if self.lora.enabled and self.from_scratch:
            return [f"{prefix}lora.r={self.lora.r}: LoRA needs a pretrained student: with "
                    f"{prefix}from_scratch=true the frozen base would be random weights that "
                    "are saved nowhere. Load real weights (student=hf student.name_or_path="
                    f"<folder or hub name>) or train every weight ({prefix}lora.r=null)"]
        return []


def load_student(cfg: StudentConfig | str, **settings):
    """The student model, with LoRA adapters when `cfg.lora.r` is set. `cfg` may be a
    folder or hub name, with the other settings as keywords (`lora={"r": 8}`)."""
    if not isinstance(cfg, StudentConfig):
        cfg = parse(StudentConfig, {"name_or_path": str(cfg), **settings}, "student.")
    model = load_causal_lm(cfg.name_or_path, dtype=cfg.dtype, from_scratch=cfg.from_scratch,
                           attn_implementation=cfg.attn_implementation, seed=cfg.seed)
    path = resolve_path(cfg.name_or_path)
    return prepare_for_training(model, cfg, base=str(Path(path).resolve())
                                if Path(path).exists() else path)


def prepare_for_training(model, cfg: StudentConfig, base: str):
    """What a student gets once built: train mode (from_pretrained leaves eval mode, where
    dropout, LoRA's too, would stay off), dropout off (`student.disable_dropout`), LoRA
    adapters (`student.lora.r`, recorded against `base`)."""
    model.train()
    if cfg.disable_dropout:
        disable_dropout(model)
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora, base=base)
    return model


def card_facts(student, merged: bool) -> dict:
    """A LoRA student's adapter as the model card states it."""
    peft = student.peft_config[ADAPTER]
    targets = peft.target_modules
    return {"r": peft.r, "alpha": peft.lora_alpha, "merged": merged,
            "target_modules": sorted(targets) if isinstance(targets, set) else targets}


def disable_dropout(model) -> None:
    """Dropout off in every layer (and p = 0 in the config, for the export): the student
    and teacher should see the same function of the same tokens."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        # Llama, Qwen, Mistral, ...: the attention layer keeps its rate as a float, read from
        # the config when it was built, and hands it to the attention kernel in train mode
        for key in ("attention_dropout", "attn_dropout", "dropout"):
            if isinstance(getattr(m, key, None), float):
                setattr(m, key, 0.0)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop",
                "attn_pdrop", "summary_first_dropout"):
        if isinstance(getattr(model.config, key, None), float):
            setattr(model.config, key, 0.0)


def apply_lora(model, settings: LoraConfig, base: str | None = None):
    """Inject LoRA adapters into `model` in place; everything else is frozen."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import inject_adapter_in_model
    except ImportError as err:
        raise ModuleNotFoundError("student.lora needs the peft package: run `make install` "
                                  "(or `pip install -e '.[lora]'`)") from err
    targets = settings.target_modules
    targets = targets if isinstance(targets, str) else list(targets)
    config = PeftLoraConfig(r=settings.r, lora_alpha=settings.scale_alpha,
                            lora_dropout=settings.dropout, target_modules=targets, bias="none")
    config.base_model_name_or_path = base
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as err:
        raise ValueError(f"student.lora.target_modules={targets!r}: {err}") from err
    _check_targets(model, targets)
    model.get_output_embeddings().weight.requires_grad_(settings.train_head)  # tied: and
    # the input embedding, the same tensor
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # fp32 master weights for what trains, whatever the base
    trainable, total = lora_parameters(model)
    log.info("LoRA student: r=%d alpha=%s on %s, head %s: %d of %d parameters train (%.2f%%)",
             settings.r, settings.scale_alpha, targets,
             "trained" if settings.train_head else "frozen", trainable, total,
             100 * trainable / total)
    return model


def _check_targets(model, targets) -> None:
    from peft.tuners.lora import Linear, LoraLayer

    if isinstance(model.get_output_embeddings(), LoraLayer):
        raise ValueError(f"student.lora.target_modules={targets!r} reaches the LM head: the "
                         "fused loss reads its weight, so it takes no adapter. Leave it out "
                         "and train it whole with student.lora.train_head=true")
    other = [n for n, m in model.named_modules() if isinstance(m, LoraLayer)
             and not isinstance(m, Linear)]
    if other:
        raise ValueError(f"student.lora.target_modules reaches non-Linear layers ({other[:3]}): "
                         "distill supports LoRA on Linear layers only; name those (the "
                         "default, all-linear, takes every Linear but the LM head)")


def is_lora(model) -> bool:
    return bool(getattr(model, "peft_config", None))


def _lora_modules(model) -> dict:
    """{clean name: LoRA layer}, names without FSDP / checkpointing / compile wrappers."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            out[unwrapped(name)] = module
    return out


def save_adapter(model, state: dict, dirpath: Path, head_key: str | None = None) -> None:
    """The adapter (and the head when it trained) in PEFT's format, from `state` (the
    student's full, gathered state dict): PeftModel.from_pretrained(base, dirpath) loads it."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    adapter = get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER)
    if head_key is not None:
        adapter[head_key] = state[head_key]
    dirpath.mkdir(parents=True, exist_ok=True)
    # PEFT's own files: keys under base_model.model., the config beside them
    save_file({f"base_model.model.{k}": v.detach().cpu().contiguous()
               for k, v in adapter.items()}, dirpath / "adapter_model.safetensors",
              metadata={"format": "pt"})
    model.peft_config[ADAPTER].save_pretrained(str(dirpath))


def merged_state_dict(model, state: dict) -> dict:
    """`state` with each adapter folded into its base weight: W + scaling * B @ A (fp32
    math, stored in the base weight's dtype), under the plain model's key names."""
    merged = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
    for name, module in _lora_modules(model).items():
        w = state[f"{name}.base_layer.weight"]
        a = state[f"{name}.lora_A.{ADAPTER}.weight"].float()  # (r, in)
        b = state[f"{name}.lora_B.{ADAPTER}.weight"].float()  # (out, r)
        merged[f"{name}.weight"] = (w.float() + module.scaling[ADAPTER] * (b @ a)).to(w.dtype)
    return merged


def trained_head_key(model, state: dict) -> str | None:
    """The state-dict key of the LM-head weight when it trained (tied: the embedding's)."""
    weight = model.get_output_embeddings().weight
    if not weight.requires_grad:
        return None
    for name, p in model.named_parameters():
        if p is weight and (key := unwrapped(name)) in state:
            return key
    raise KeyError("the trained LM head is not in the gathered state dict")


def load_exported(path) -> PreTrainedModel:
    """An exported student as a plain model: a full folder as it is, an adapter folder
    merged onto its base (the report scores it so after an FSDP fit)."""
    path = Path(path)
    if not (path / "adapter_config.json").exists():
        return load_causal_lm(str(path), dtype="auto")
    from peft import PeftConfig, PeftModel

    base = PeftConfig.from_pretrained(str(path)).base_model_name_or_path
    model = PeftModel.from_pretrained(load_causal_lm(base, dtype="auto"), str(path))
    return model.merge_and_unload()


def lora_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts, for the log line."""
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total
