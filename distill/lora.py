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
from pathlib import Path

from transformers import PreTrainedModel

from distill.models import load_causal_lm, resolve_path

log = logging.getLogger(__name__)
KEYS = {"r", "alpha", "dropout", "target_modules", "train_head"}
ADAPTER = "default"  # PEFT's adapter name; one adapter per student


def load_student(name_or_path: str, lora: dict | None = None, from_scratch: bool = False,
                 **kwargs):
    """The student of `load_causal_lm`, with LoRA adapters when `lora.r` is set."""
    settings = check_lora(lora)
    if settings and from_scratch:
        raise ValueError(
            "student.lora needs a pretrained student: with student.from_scratch=true the "
            "frozen base would be random weights that are saved nowhere. Load real weights "
            "(student=hf student.name_or_path=<folder or hub name>) or train every weight "
            "(student.lora.r=null)")
    model = load_causal_lm(name_or_path, from_scratch=from_scratch, **kwargs)
    model.train()  # from_pretrained leaves eval mode: dropout (LoRA's too) would stay off
    if settings:
        path = resolve_path(name_or_path)
        apply_lora(model, settings, base=str(Path(path).resolve()) if Path(path).exists() else path)
    return model


def check_lora(lora) -> dict | None:
    """The LoRA settings with defaults filled in, None for full fine-tuning (`r: null`)."""
    if not lora or lora.get("r") is None:
        return None
    lora = dict(lora)
    unknown = set(lora) - KEYS
    if unknown:
        raise ValueError(f"student.lora has unknown key(s) {sorted(unknown)}: allowed are "
                         f"{sorted(KEYS)}")
    r, alpha = lora["r"], lora.get("alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"student.lora.r={r!r}: the adapter rank must be an integer >= 1 "
                         "(or null for full fine-tuning)")
    alpha = 2 * r if alpha is None else alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"student.lora.alpha={alpha!r}: must be a number > 0 (null: 2 * r)")
    dropout = lora.get("dropout") or 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"student.lora.dropout={dropout!r}: must be in [0, 1)")
    targets = lora.get("target_modules") or "all-linear"
    if not isinstance(targets, str):
        targets = [str(t) for t in targets]
    train_head = lora.get("train_head", False)
    if not isinstance(train_head, bool):
        raise ValueError(f"student.lora.train_head={train_head!r}: must be true or false")
    return {"r": r, "alpha": alpha, "dropout": float(dropout), "target_modules": targets,
            "train_head": train_head}


def apply_lora(model, settings: dict, base: str | None = None):
    """Inject LoRA adapters into `model` in place; everything else is frozen."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as err:
        raise ModuleNotFoundError("student.lora needs the peft package: run `make install` "
                                  "(or `pip install -e '.[lora]'`)") from err
    targets = settings["target_modules"]
    config = LoraConfig(r=settings["r"], lora_alpha=settings["alpha"],
                        lora_dropout=settings["dropout"], target_modules=targets, bias="none")
    config.base_model_name_or_path = base
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as err:
        raise ValueError(f"student.lora.target_modules={targets!r}: {err}") from err
    _check_targets(model, targets)
    model.get_output_embeddings().weight.requires_grad_(settings["train_head"])  # tied: and
    # the input embedding, the same tensor
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # fp32 master weights for what trains, whatever the base
    trainable, total = lora_parameters(model)
    log.info("LoRA student: r=%d alpha=%s on %s, head %s: %d of %d parameters train (%.2f%%)",
             settings["r"], settings["alpha"], targets,
             "trained" if settings["train_head"] else "frozen", trainable, total,
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


_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _lora_modules(model) -> dict:
    """{clean name: LoRA layer}, names without FSDP / checkpointing / compile wrappers."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            for wrapper in _WRAPPERS:
                name = name.replace(wrapper, "")
            out[name] = module
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
        if p is weight:
            for wrapper in _WRAPPERS:
                name = name.replace(wrapper, "")
            if name in state:
                return name
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
