"""`distill.fit`: distil models and data held in memory (a notebook, a script), through the
same config, schema, callbacks and normalization as `distill-train`.

    import distill
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-0.5B")
    teacher = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-7B-Instruct")
    rows = [{"messages": [{"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4"}]}, ...]
    result = distill.fit(student, teacher, rows, loss={"kind": "reverse_kl"},
                         trainer={"max_steps": 200})
    result.student, result.output_dir   # the trained student (in place), the run's folder

The package's Hydra config is composed with `+experiment=<experiment>` (hf_sft by default:
the fine-tuning defaults for one's own models), the keyword settings are applied on top
(`loss="jsd"` picks a config group's option, `loss={"temperature": 2.0}` sets its keys,
`seed=3` a top-level key), and `distill.train.train` runs it: every setting is checked by
the same schema (an unknown key is refused with the nearest known one), the student gets
the same preparation as a loaded one (dropout off, LoRA adapters with `student={"lora":
{"r": 16}}`), and the run writes its logs, checkpoints and exported student to its folder.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

from distill.data import memory


class Fitted(NamedTuple):
    student: Any  # the trained student: the model passed in, trained in place
    output_dir: Path  # logs/, checkpoints/, student/ (the export), final_metrics.json
    summary: dict  # what `distill.train.train` returns: metrics, steps, the export's folder


def _model_name(model, role: str) -> str:
    """The folder or hub name an in-memory model was loaded from: the run reads its
    tokenizer there, checks it, and records it in the model card."""
    name = getattr(model, "name_or_path", None) or getattr(
        getattr(model, "model", None), "name_or_path", None)
    if not name:
        raise ValueError(f"the {role} was built in memory, so there is no folder for its "
                         f"tokenizer and config: save it first ({role}.save_pretrained(dir)) "
                         "and pass the model loaded back, or the folder itself")
    return str(name)


def _is_group(key: str) -> bool:
    return resources.files("distill.conf").joinpath(key).is_dir()


def _flatten(settings: Mapping, prefix: str = "") -> dict[str, Any]:
    """{"loss": {"temperature": 2}} -> {"loss.temperature": 2}; lists stay values."""
    out = {}
    for key, value in settings.items():
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _source(data, name: str, kind: str | None) -> dict:
    if isinstance(data, (str, Path)):  # a file, folder or hub name, as in the config
        return {"name": name, "kind": kind or "sft", "path": str(data)}
    path = memory.register(data, name)
    return {"name": name, "kind": kind or memory.infer_kind(memory.columns_of(path)),
            "path": path}


def compose(experiment: str | None, overrides=(), **settings):
    """The run's config: the package's train.yaml + the experiment + group choices (a str
    for a group key), then the other settings set on the composed config."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from omegaconf import OmegaConf, open_dict

    from distill.run.paths import register_resolvers

    register_resolvers()
    choices = [f"{k}={v}" for k, v in settings.items() if isinstance(v, str) and _is_group(k)]
    values = {k: v for k, v in settings.items() if f"{k}={v}" not in choices}
    with initialize_config_module("distill.conf", version_base="1.3"):
        cfg = hydra_compose("train", overrides=[*([f"+experiment={experiment}"] if experiment
                                                  else []), *choices, *overrides])
    with open_dict(cfg):  # unknown keys get in, and the schema refuses them by name
        for key, value in _flatten(values).items():
            OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def fit(student, teacher, train_dataset, /, *, val_dataset=None, kind: str | None = None,
        experiment: str | None = "hf_sft", output_dir: str | Path | None = None,
        overrides=(), **settings) -> Fitted:
    """Distil `teacher` into `student` on `train_dataset`; see the module docstring.

    student, teacher: Hugging Face causal LMs in memory, or folders / hub names. The teacher
        may also be a distill Teacher (LiveTeacher, CachedTeacher).
    train_dataset, val_dataset: a `datasets.Dataset`, a list of dicts, or a path; `kind`
        (sft, cpt, prompts) is read from the columns unless given.
    experiment: the conf/experiment recipe to start from (hf_sft, hf_onpolicy, ...).
    output_dir: the run's folder (default: outputs/<date>/<time>).
    overrides: Hydra override strings, e.g. ["+baseline=ce_only"].
    settings: config values, e.g. trainer={"max_steps": 100}, loss="reverse_kl",
        student={"lora": {"r": 16}} (the three models-and-data arguments are positional, so
        `student=` and `teacher=` here are their config groups).
    """
    from distill.models.lora import load_student
    from distill.run.config import parse
    from distill.run.train import train
    from distill.training.teachers import LiveTeacher

    held = []
    try:
        data = {"train": [_source(train_dataset, "train", kind)],
                "val": [_source(val_dataset, "val", kind)] if val_dataset is not None else None}
        held = [s["path"] for split in data.values() for s in split or []]
        given = {"student.name_or_path": student if isinstance(student, (str, Path))
                 else _model_name(student, "student"),
                 "teacher.name_or_path": teacher if isinstance(teacher, (str, Path))
                 else _model_name(teacher, "teacher"),
                 "data.train": data["train"], "data.val": data["val"],
                 "trainer.devices": 1}  # one process: the student trains in this one
        if output_dir is not None:
            given["paths.output_dir"] = str(output_dir)
        given = {k: str(v) if isinstance(v, Path) else v for k, v in given.items()}
        cfg = compose(experiment, overrides, **given, **settings)
        run = parse(cfg)
        model = prepare_student(student, run.student) or load_student(run.student)
        live = None
        if run.teacher.kind == "live" and not isinstance(teacher, (str, Path)):
            live = teacher if hasattr(teacher, "targets") else LiveTeacher.from_model(teacher)
        summary = train(cfg, student=model, teacher=live)
        return Fitted(model, Path(run.paths["output_dir"]), summary)
    finally:
        for path in held:
            memory.release(path)


def prepare_student(student, cfg):
    """What loading a student does after from_pretrained (distill.models.lora.load_student), done
    to a model passed in: train mode, dropout off (student.disable_dropout), LoRA adapters
    (student.lora.r). None for a folder or hub name: the run loads it."""
    if isinstance(student, (str, Path)):
        return None
    from distill.models.lora import prepare_for_training

    return prepare_for_training(student, cfg, base=cfg.name_or_path)
