"""`distill-export`: any checkpoint of a distill run -> a Hugging Face folder with a model card.

    distill-export outputs/<run>/checkpoints/last.ckpt              # -> <run>/student-last
    distill-export outputs/<run>/checkpoints/last.ckpt --merge      # a LoRA run, merged
    distill-export run/checkpoints/step=500.ckpt --out student-500 \\
        --model /models/student --tokenizer /models/teacher --dtype bfloat16

Every kind of checkpoint a run writes, not only the end-of-run export:

- a Lightning `.ckpt` of full fine-tuning: the student's weights;
- a `.ckpt` of a LoRA run (`student.lora.r=...`): the frozen base and the adapters; saved as
  the adapter in PEFT's format (`PeftModel.from_pretrained(base, folder)`), or with `--merge`
  as the plain model with the adapters folded in;
- an FSDP sharded checkpoint (`trainer=fsdp`, `state_dict_type: sharded`): a folder of
  torch.distributed.checkpoint shards plus Lightning's `meta.pt`, read here in one process
  (no GPU, no process group).

A checkpoint holds weights, not the architecture: the model config comes from `--model`,
or by default from the run's `.hydra/config.yaml` next to its `checkpoints/` folder (the
student it started from, its LoRA settings, the run's tokenizer). Weights with a NaN or an
inf are refused. `scripts/export_checkpoint.py` is the same command.
"""

from __future__ import annotations

import argparse
import csv
import warnings
from pathlib import Path

import torch

from distill.core.checkpoint_io import read_checkpoint as read_checkpoint_file
from distill.core.constants import unwrapped
from distill.models.strategies import SHARDED_METADATA

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def student_state(state_dict: dict, path: Path) -> dict:
    """The student's weights from a Lightning state dict, names unwrapped."""
    state = {}
    for key, value in state_dict.items():
        if key.startswith("student."):
            state[unwrapped(key.removeprefix("student."))] = value
    if not state:
        raise ValueError(f"{path} holds no student weights (no 'student.*' keys in its "
                         "state_dict): is it a checkpoint of a distill training run?")
    return state


def read_sharded(folder: Path) -> tuple[dict, dict]:
    """(the `model` entries, the trainer metadata) of a sharded checkpoint folder; the
    optimizer's shards are left on disk."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(folder))
    found = reader.read_metadata().state_dict_metadata
    model = {}
    for key, meta in found.items():
        if key.startswith("model.student.") and hasattr(meta, "size"):
            model[key.removeprefix("model.")] = torch.empty(meta.size,
                                                            dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # "no process group: assuming a single process", as here
        warnings.filterwarnings("ignore", message=".*torch.distributed.*", category=UserWarning)
        dcp.load({"model": model}, storage_reader=reader)
    return model, torch.load(folder / SHARDED_METADATA, map_location="cpu", weights_only=False)


def read_checkpoint(path: Path) -> tuple[dict, int | None]:
    """(the student's state, the checkpoint's optimizer step) of a .ckpt or a sharded folder."""
    if path.is_dir():
        if not (path / SHARDED_METADATA).is_file():
            raise ValueError(f"{path} is a folder without {SHARDED_METADATA}: a sharded "
                             "checkpoint (trainer=fsdp) is a folder of shards and "
                             f"{SHARDED_METADATA}; otherwise pass a .ckpt file")
        state, meta = read_sharded(path)
    elif path.is_file():
        # memory-mapped; a file cut short is named as such
        meta = read_checkpoint_file(path)
        state = meta.get("state_dict", {})
    else:
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    return student_state(state, path), meta.get("global_step")


def run_folder(ckpt_path: Path) -> Path | None:
    """The run's folder (with `.hydra/config.yaml`) a checkpoint belongs to, or None."""
    for folder in (ckpt_path.parent.parent, ckpt_path.parent):
        if (folder / ".hydra" / "config.yaml").is_file():
            return folder
    return None


def run_config(ckpt_path: Path):
    """The run's composed Hydra config (`<run>/.hydra/config.yaml`), or None."""
    from omegaconf import OmegaConf

    from distill.run.paths import register_resolvers

    register_resolvers()  # the config may use ${distill_demo:}
    folder = run_folder(ckpt_path)
    return OmegaConf.load(folder / ".hydra" / "config.yaml") if folder else None


def _select(cfg, key: str):
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key) if cfg is not None else None


def sources(cfg, ckpt_path: Path, model: str | None, tokenizer: str | None) -> tuple[str, str]:
    """Where the student's config and the tokenizer come from: the arguments, else the run's
    student.name_or_path and the tokenizer it trained with (the teacher's)."""
    model = model or _select(cfg, "student.name_or_path")
    if not model:
        raise ValueError(f"no run config next to {ckpt_path} (expected "
                         "<run>/.hydra/config.yaml): pass --model, a folder with the "
                         "student's config.json (e.g. the model it started from)")
    tokenizer = (tokenizer or _select(cfg, "teacher.tokenizer")
                 or _select(cfg, "teacher.name_or_path") or model)
    return str(model), str(tokenizer)


def lora_settings(cfg, ckpt_path: Path):
    """The run's `student.lora` settings (a LoRA checkpoint's adapters need them)."""
    from omegaconf import OmegaConf

    from distill.core.rules import parse
    from distill.models.lora import LoraConfig

    node = _select(cfg, "student.lora")
    if node is None or node.get("r") is None:
        raise ValueError(
            f"{ckpt_path} is a checkpoint of a LoRA student (it holds lora_A / lora_B "
            "weights), and the adapters' settings (student.lora: r, alpha, target modules) "
            "are in the run's .hydra/config.yaml, which is not next to it: export it from "
            "its run folder (<run>/checkpoints/<file>), where the config is")
    return parse(LoraConfig, OmegaConf.to_container(node, resolve=True), "student.lora.")


def build_student(model_path: str, state: dict, cfg, ckpt_path: Path):
    """The student's architecture from its config, with LoRA adapters when the checkpoint
    has them, loaded with the checkpoint's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from distill.models.causal_lm import resolve_path

    config = AutoConfig.from_pretrained(resolve_path(model_path))
    student = AutoModelForCausalLM.from_config(config, dtype=next(iter(state.values())).dtype)
    lora = any(".lora_A." in k for k in state)
    if lora:
        from distill.models.lora import apply_lora

        path = resolve_path(model_path)
        base = str(Path(path).resolve()) if Path(path).exists() else path
        apply_lora(student, lora_settings(cfg, ckpt_path), base=base)
    result = student.load_state_dict(state, strict=False)
    missing = sorted(set(result.missing_keys) - _tied(student, result.missing_keys, state))
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{ckpt_path} does not fit the architecture of {model_path}: missing "
            f"{missing[:4]}, unexpected {sorted(result.unexpected_keys)[:4]}. Pass --model "
            "with the config of the model the run started from (its student.name_or_path)"
            + ("; the LoRA settings come from the run's .hydra/config.yaml" if lora else ""))
    return student, lora


def export(ckpt_path: str | Path, out: str | Path | None = None, model: str | None = None,
           tokenizer: str | None = None, dtype: str | None = None, merge: bool = False,
           push_to_hub: str | None = None) -> Path:
    from distill.core.checkpoint_io import check_finite
    from distill.export.callback import save_student, upload
    from distill.export.card import write_card
    from distill.models.causal_lm import load_tokenizer

    ckpt_path = Path(ckpt_path)
    state, step = read_checkpoint(ckpt_path)
    check_finite(state, str(ckpt_path), hint="Export an earlier checkpoint of the run (one "
                 "written before it diverged)")
    cfg = run_config(ckpt_path)
    model_path, tokenizer_path = sources(cfg, ckpt_path, model, tokenizer)
    student, lora = build_student(model_path, state, cfg, ckpt_path)
    if dtype:  # the adapters of an unmerged LoRA export stay fp32, as they trained
        state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() and not (lora and not merge)
                 else v for k, v in state.items()}
        student.to(DTYPES[dtype])
    out = Path(out) if out else _default_out(ckpt_path)
    if lora:
        save_student(student, state, out, merge)
    else:
        student.save_pretrained(out)
    load_tokenizer(tokenizer_path).save_pretrained(out)
    write_card(out, card_info(cfg, ckpt_path, step, student, lora, merge))
    print(f"exported {ckpt_path} (step {step}) -> {out}  [config {model_path}, tokenizer "
          f"{tokenizer_path}{', LoRA ' + ('merged' if merge else 'adapter') if lora else ''}]")
    if push_to_hub:
        upload(out, push_to_hub)
    return out


def _default_out(ckpt_path: Path) -> Path:
    stem = ckpt_path.name if ckpt_path.is_dir() else ckpt_path.stem
    return ckpt_path.parent.parent / f"student-{stem.removesuffix('.ckpt')}"


def card_info(cfg, ckpt_path: Path, step, student, lora: bool, merge: bool) -> dict:
    """The model card's facts, from the run's config and logs."""
    info = {"steps": step, "exported_from": str(ckpt_path),
            "student": _select(cfg, "student.name_or_path"),
            "teacher": _select(cfg, "teacher.name_or_path"),
            "teacher_kind": _select(cfg, "teacher.kind") or "live"}
    if cfg is not None:
        info["loss"] = _plain(_select(cfg, "loss")) or {}
        info["data"] = {s: _plain(_select(cfg, f"data.{s}")) or [] for s in ("train", "val")}
        folder = run_folder(ckpt_path)
        info["metrics"] = logged_metrics(folder, step)
        info["command"] = _training_command(folder)
    if lora:
        from distill.models.lora import card_facts

        info["lora"] = card_facts(student, merge)
    return info


def _plain(node):
    """A config node as plain values, interpolations resolved where they can be."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if not isinstance(node, (DictConfig, ListConfig)):
        return node
    try:
        return OmegaConf.to_container(node, resolve=True)
    except Exception:  # an interpolation of this run that cannot be resolved here
        return OmegaConf.to_container(node, resolve=False)


def _training_command(folder: Path) -> str | None:
    overrides = folder / ".hydra" / "overrides.yaml"
    if not overrides.is_file():
        return None
    import shlex

    import yaml

    words = yaml.safe_load(overrides.read_text()) or []
    return " ".join(["distill-train", *(shlex.quote(str(w)) for w in words)])


def logged_metrics(folder: Path, step: int | None) -> dict:
    """The last value of each metric a run's CSV logs hold at or before `step`."""
    out: dict[str, float] = {}
    for path in sorted(folder.glob("logs/version_*/metrics.csv")):
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if step is not None and row.get("step") and int(float(row["step"])) > step:
                    continue
                out.update({k: float(v) for k, v in row.items()
                            if v not in ("", None) and k not in ("step", "epoch")})
    return out


def _tied(model, missing: list[str], state: dict) -> set[str]:
    """Keys missing from the checkpoint because they share a tensor with a loaded one
    (tied input and output embeddings)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(p) for name, p in params.items() if name in state}
    return {k for k in missing if k in params and id(params[k]) in loaded}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="distill-export", description="Turn a checkpoint of a distill run (a .ckpt "
        "file, or an FSDP sharded folder) into a Hugging Face folder with a model card.")
    parser.add_argument("checkpoint", help="last.ckpt, a step checkpoint, or a sharded "
                        "checkpoint folder (trainer=fsdp)")
    parser.add_argument("--out", help="output folder (default: <run>/student-<ckpt name>)")
    parser.add_argument("--model", help="folder or hub name with the student's config.json "
                        "(default: the run's student.name_or_path)")
    parser.add_argument("--tokenizer", help="tokenizer to save beside the weights "
                        "(default: the one the run trained with, the teacher's)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="weights dtype (default: "
                        "as in the checkpoint, fp32 master weights under bf16-mixed)")
    parser.add_argument("--merge", action="store_true", help="a LoRA checkpoint: save the "
                        "merged model instead of the adapter")
    parser.add_argument("--push-to-hub", metavar="REPO", help="upload the folder to this "
                        "Hugging Face Hub repo (huggingface-cli login first)")
    args = parser.parse_args(argv)
    export(args.checkpoint, args.out, args.model, args.tokenizer, args.dtype, args.merge,
           args.push_to_hub)


if __name__ == "__main__":
    main()
