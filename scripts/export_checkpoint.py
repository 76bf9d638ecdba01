"""Turn a Lightning checkpoint of a distill run into a Hugging Face folder.

    python scripts/export_checkpoint.py outputs/<run>/checkpoints/last.ckpt
    python scripts/export_checkpoint.py run/checkpoints/step=500.ckpt --out student-500 \
        --model /models/student --tokenizer /models/teacher --dtype bfloat16

Any checkpoint works (last.ckpt, a step checkpoint, one of a killed run), not only the
end-of-run export. A checkpoint holds the student's weights but not its architecture, so
the model config comes from `--model` (a folder with config.json, e.g. the student it
started from), or by default from the run's own `.hydra/config.yaml` next to the
`checkpoints/` folder (student.name_or_path and tokenizer). The folder written loads with
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

# prefixes that activation checkpointing, torch.compile and FSDP add to parameter names
WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def student_state(ckpt: dict, path: Path) -> dict:
    """The student's weights from a Lightning checkpoint's state dict, names unwrapped."""
    state = {}
    for key, value in ckpt.get("state_dict", {}).items():
        if key.startswith("student."):
            name = key.removeprefix("student.")
            for wrapper in WRAPPERS:
                name = name.replace(wrapper, "")
            state[name] = value
    if not state:
        raise ValueError(f"{path} holds no student weights (no 'student.*' keys in its "
                         "state_dict): is it a checkpoint of a distill training run?")
    return state


def run_config(ckpt_path: Path):
    """The run's composed Hydra config (`<run>/.hydra/config.yaml`), or None."""
    from omegaconf import OmegaConf

    import distill.train  # noqa: F401  (registers the resolvers the config may use)

    for folder in (ckpt_path.parent.parent, ckpt_path.parent):
        if (folder / ".hydra" / "config.yaml").is_file():
            return OmegaConf.load(folder / ".hydra" / "config.yaml")
    return None


def sources(ckpt_path: Path, model: str | None, tokenizer: str | None) -> tuple[str, str]:
    """Where the student's config and the tokenizer come from."""
    from omegaconf import OmegaConf

    cfg = run_config(ckpt_path) if model is None or tokenizer is None else None
    if model is None:
        model = cfg and OmegaConf.select(cfg, "student.name_or_path")
    if tokenizer is None:
        tokenizer = (cfg and OmegaConf.select(cfg, "tokenizer")) or model
    if not model:
        raise ValueError(f"no run config next to {ckpt_path} (expected "
                         "<run>/.hydra/config.yaml): pass --model, a folder with the "
                         "student's config.json (e.g. the model it started from)")
    return str(model), str(tokenizer)


def export(ckpt_path: str | Path, out: str | Path | None = None, model: str | None = None,
           tokenizer: str | None = None, dtype: str | None = None) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from distill.models import load_tokenizer, resolve_path

    ckpt_path = Path(ckpt_path)
    if not ckpt_path.is_file():
        raise FileNotFoundError(f"checkpoint {ckpt_path} does not exist")
    # Lightning checkpoints hold optimizer and loop state besides tensors
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    state = student_state(ckpt, ckpt_path)
    model_path, tokenizer_path = sources(ckpt_path, model, tokenizer)
    config = AutoConfig.from_pretrained(resolve_path(model_path))
    student = AutoModelForCausalLM.from_config(config, dtype=next(iter(state.values())).dtype)
    result = student.load_state_dict(state, strict=False)
    missing = sorted(set(result.missing_keys) - _tied(student, result.missing_keys, state))
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{ckpt_path} does not fit the architecture of {model_path}: missing "
            f"{missing[:4]}, unexpected {sorted(result.unexpected_keys)[:4]} (pass --model "
            "with the student's own config; a LoRA run exports its merged student at the "
            "end of training)")
    if dtype:
        student.to(DTYPES[dtype])
    out = Path(out) if out else ckpt_path.parent.parent / f"student-{ckpt_path.stem}"
    student.save_pretrained(out)
    load_tokenizer(tokenizer_path).save_pretrained(out)
    print(f"exported {ckpt_path} (step {ckpt.get('global_step')}) -> {out}  "
          f"[config {model_path}, tokenizer {tokenizer_path}]")
    return out


def _tied(model, missing: list[str], state: dict) -> set[str]:
    """Keys missing from the checkpoint because they share a tensor with a loaded one
    (tied input and output embeddings)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(p) for name, p in params.items() if name in state}
    return {k for k in missing if k in params and id(params[k]) in loaded}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a Lightning .ckpt of a distill run")
    parser.add_argument("--out", help="output folder (default: <run>/student-<ckpt name>)")
    parser.add_argument("--model", help="folder or hub name with the student's config.json "
                        "(default: the run's student.name_or_path)")
    parser.add_argument("--tokenizer", help="tokenizer to save beside the weights "
                        "(default: the run's tokenizer)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="weights dtype (default: "
                        "as in the checkpoint, fp32 master weights under bf16-mixed)")
    args = parser.parse_args(argv)
    export(args.checkpoint, args.out, args.model, args.tokenizer, args.dtype)


if __name__ == "__main__":
    main()
