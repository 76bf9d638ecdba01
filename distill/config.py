"""The config schema: each key a run reads, its type and allowed range, checked first.

`validate(cfg)` runs at the very start of `train(cfg)` and of the caching job, before any
model, tokenizer or dataset loads. It reads every key of `RULES` that the config holds and
raises one `ConfigError` listing each bad key with its value and what is allowed.

Types are strict: a boolean is `true` or `false`, never the string "no" or "off" (Hydra's
command-line grammar reads `data.packing=no` as the string 'no', which Python calls true);
a number is an int or a float, never a bool or a string. Keys this table does not name pass
untouched, so a new option works before it has a rule; give it one here (one line) when it
lands. Rules with a condition over several keys live in `CROSS_CHECKS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from distill.data.sources import KINDS as SOURCE_KINDS
from distill.losses.spec import KINDS, SPARSE_MODES
from distill.models import DTYPES as MODEL_DTYPE_TABLE
from distill.normalization import POLICIES

MODEL_DTYPES = tuple(MODEL_DTYPE_TABLE)  # the names load_causal_lm accepts
CACHE_DTYPES = ("float16", "bfloat16")  # of the stored log-probs
PRECISIONS = ("32-true", "32", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true",
              "bf16", "16", "64", 32, 16, 64, "transformer-engine",
              "transformer-engine-float16")


class ConfigError(ValueError):
    """One or more config values are of the wrong type or out of range."""


@dataclass(frozen=True)
class Rule:
    check: Callable[[object], bool]
    allowed: str  # completes "KEY=VALUE: must be ..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def integer(lo: int, *, null: bool = False, also: tuple = (), what: str = "") -> Rule:
    extra = "".join(f" or {a}" for a in also) + (" or null" if null else "")
    return Rule(lambda v: (v is None and null) or (_is_int(v) and (v >= lo or v in also)),
                f"an integer >= {lo}{extra}{what}")


def number(lo: float, *, strict: bool, hi: float | None = None, what: str = "") -> Rule:
    """A finite int or float above `lo` (strictly when `strict`), up to `hi` included."""
    def ok(v):
        if not _is_number(v) or not math.isfinite(v):
            return False
        return (v > lo if strict else v >= lo) and (hi is None or v <= hi)
    bound = f"{'>' if strict else '>='} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
    return Rule(ok, f"a finite number {bound}{what}")


def boolean() -> Rule:
    return Rule(lambda v: isinstance(v, bool), "true or false (a string such as 'no' or 'off' "
                "is not a boolean)")


def choice(options: Sequence, *, null: bool = False) -> Rule:
    names = ", ".join(str(o) for o in options) + (", or null" if null else "")
    return Rule(lambda v: (v is None and null) or (not isinstance(v, bool) and v in options),
                f"one of {names}")


def text(*, null: bool = False) -> Rule:
    return Rule(lambda v: (v is None and null) or (isinstance(v, str) and v.strip() != ""),
                "a non-empty string" + (" or null" if null else ""))


def _val_interval(v) -> bool:
    if v is None or (_is_int(v) and v >= 1):
        return True
    return isinstance(v, float) and math.isfinite(v) and 0 < v <= 1


def _ckpt_path(v) -> bool:
    if v is None or v == "last":
        return True  # remote checkpoints (s3://...) are Lightning's to find
    # a file, or a folder (FSDP's sharded checkpoints are folders of per-rank files)
    return isinstance(v, str) and ("://" in v or Path(v).expanduser().exists())


def _devices(v) -> bool:
    if v == "auto" or (_is_int(v) and (v >= 1 or v == -1)):
        return True
    if isinstance(v, str):  # "0,1" or "2": Lightning parses it
        return v.replace(",", "").strip().isdigit() or v.strip() == "-1"
    return isinstance(v, Sequence) and len(v) > 0 and all(_is_int(d) and d >= 0 for d in v)


def _splits(v) -> bool:
    return isinstance(v, Sequence) and not isinstance(v, str) and len(v) > 0 and \
        all(s in ("train", "val") for s in v)


def _sources(v) -> bool:
    return isinstance(v, Sequence) and not isinstance(v, str) and len(v) > 0 and \
        all(isinstance(s, Mapping) for s in v)


RULES: dict[str, Rule] = {
    "seed": integer(0),
    "tokenizer": text(),
    "ckpt_path": Rule(_ckpt_path, "null, 'last' (resume from the checkpoints of "
                      "paths.output_dir if any) or the path of an existing checkpoint"),
    # --- trainer (lightning.Trainer arguments) ---
    "trainer.accumulate_grad_batches": integer(1, what=" (micro-batches per optimizer step)"),
    "trainer.max_steps": integer(1, also=(-1,), what=" (-1: no step limit)"),
    "trainer.max_epochs": integer(1, also=(-1,), null=True, what=" (-1: no epoch limit)"),
    "trainer.precision": choice(PRECISIONS),
    "trainer.gradient_clip_val": Rule(lambda v: v is None or number(0, strict=False).check(v),
                                      "a finite number >= 0 or null"),
    "trainer.gradient_clip_algorithm": choice(("norm", "value"), null=True),
    "trainer.val_check_interval": Rule(_val_interval, "an integer >= 1 (steps), a fraction "
                                       "of an epoch in (0, 1], or null"),
    "trainer.check_val_every_n_epoch": integer(1, null=True),
    "trainer.num_sanity_val_steps": integer(-1),
    "trainer.log_every_n_steps": integer(1),
    "trainer.deterministic": Rule(lambda v: isinstance(v, bool) or v == "warn",
                                  "true, false or 'warn'"),
    "trainer.accelerator": text(),
    "trainer.devices": Rule(_devices, "'auto', an integer >= 1 or -1 (all), a list of device "
                            "ids, or a string of them ('0,1')"),
    "trainer.num_nodes": integer(1),
    # --- data (distill.data.DistillDataModule) ---
    "data.train": Rule(_sources, "a non-empty list of sources ({name, kind, path, ...})"),
    "data.val": Rule(lambda v: v is None or v == [] or _sources(v),
                     "a list of sources or null"),
    "data.batch_size": integer(1),
    "data.val_batch_size": integer(1, null=True),
    "data.max_length": integer(2, what=" (tokens per row: room for a token and its next)"),
    "data.packing": boolean(),
    "data.shuffle": boolean(),
    "data.num_workers": integer(0),
    "data.seed": integer(0),
    "data.pad_to_multiple_of": integer(1),
    "data.chat_template": text(null=True),
    "data.assistant_turns": choice(("all", "last")),
    "data.cpt_stride": integer(1, null=True, what=" (null: max_length - 1)"),
    "data.mix_stopping": choice(("first_exhausted", "all_exhausted")),
    # --- loss (distill.losses.linear_divergence through DistillModule) ---
    "loss.kind": choice(KINDS),
    "loss.beta": number(0, strict=False, hi=1),
    "loss.temperature": number(0, strict=True, what=" (it divides the logits)"),
    "loss.temperature_squared": boolean(),
    "loss.ce_weight": number(0, strict=False),
    "loss.divergence_weight": number(0, strict=False),
    "loss.normalization": choice(POLICIES),
    "loss.sparse_mode": choice(SPARSE_MODES),
    "loss.chunk_size": integer(1, null=True, what=" (null picks it from the shapes)"),
    "loss.fp32_weight_grad": boolean(),
    "loss.backend": choice(("auto", "torch", "triton")),
    "loss.on_policy.fraction": number(0, strict=False, hi=1, what=" (0: teacher-forced only)"),
    "loss.on_policy.teacher_fraction": number(0, strict=False, hi=1),
    "loss.on_policy.temperature": number(0, strict=False, what=" (0: greedy)"),
    "loss.on_policy.top_p": number(0, strict=True, hi=1),
    "loss.on_policy.max_new_tokens": integer(1),
    "loss.on_policy.seed": integer(0),
    # --- models ---
    "student.name_or_path": text(),
    "student.from_scratch": boolean(),
    "student.dtype": choice(MODEL_DTYPES),
    "student.attn_implementation": text(null=True),
    "student.seed": integer(0, null=True),
    "student.lora.r": integer(1, null=True, what=" (the LoRA rank; null: full fine-tuning)"),
    "student.lora.alpha": Rule(lambda v: v is None or number(0, strict=True).check(v),
                               "a finite number > 0 or null (2 * r)"),
    "student.lora.dropout": Rule(lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "student.lora.train_head": boolean(),
    "teacher.name_or_path": text(),
    "teacher.dtype": choice(MODEL_DTYPES),
    "teacher.attn_implementation": text(null=True),
    "teacher.dir": text(),
    "teacher.top_k": integer(1),
    "teacher.temperature": number(0, strict=True),
    "teacher.sparse_mode": choice(SPARSE_MODES),
    # --- performance switches (distill/levers.py) ---
    "speed.gradient_checkpointing": boolean(),
    "speed.compile": boolean(),
    "speed.compile_backend": text(),
    "speed.liger": boolean(),
    "speed.attention": choice(("sdpa", "eager", "flash_attention_2", "flex_attention"),
                              null=True),
    # --- the teacher-logit cache (conf/teacher/cached.yaml, conf/cache.yaml) ---
    "cache.dir": text(),
    "cache.top_k": integer(1, what=" (K, ids kept per position)"),
    "cache.temperature": number(0, strict=True),
    "cache.dtype": choice(CACHE_DTYPES),
    "cache.shard_size": integer(1),
    "cache.batch_size": integer(1),
    "cache.chunk": integer(1, null=True),
    "cache.num_workers": integer(0),
    "cache.splits": Rule(_splits, "a non-empty list of train and/or val"),
    "cache.teacher.name_or_path": text(),
    "cache.teacher.dtype": choice(MODEL_DTYPES),
    # --- optimizer, scheduler, evaluation, callbacks ---
    "optimizer.lr": number(0, strict=True),
    "optimizer.weight_decay": number(0, strict=False),
    "optimizer.momentum": number(0, strict=False),
    "scheduler.num_warmup_steps": integer(0),
    "scheduler.warmup_ratio": number(0, strict=False, hi=1),
    "evaluate.path": text(),
    "evaluate.max_examples": integer(1, null=True),
    "evaluate.max_new_tokens": integer(1),
    "logger.wandb.offline": boolean(),
    "callbacks.checkpoint.every_n_train_steps": integer(0, null=True),
    "callbacks.checkpoint.save_top_k": integer(-1),
    "callbacks.progress.refresh_rate": integer(0),
    "callbacks.export.merge": boolean(),
    "callbacks.throughput.window_size": integer(2, what=" (micro-batches)"),
}

# each key of a data source (an item of data.train / data.val)
SOURCE_RULES: dict[str, Rule] = {
    "name": text(),
    "kind": choice(SOURCE_KINDS),
    "path": text(),
    "split": text(),
    "field": text(),
    "weight": number(0, strict=True, what=" (its share of the mix)"),
    "max_examples": integer(1, null=True),
}


def _get(cfg, key: str):
    """(present, value) of a dotted key, interpolations resolved; '???' counts as present."""
    node, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, node) if node else cfg
    if not isinstance(parent, DictConfig) or leaf not in list(parent):  # `in` skips ???
        return False, None
    if OmegaConf.is_missing(parent, leaf):
        return True, "???"
    try:
        value = parent[leaf]
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
    except OmegaConfBaseException as err:  # an interpolation to a missing or bad value
        return True, Unresolved(str(err).splitlines()[0])
    return True, value


@dataclass(frozen=True)
class Unresolved:
    why: str


def _problem(key: str, value, allowed: str, where: str = "") -> str:
    if value == "???":
        return f"{key} is not set (???): give {allowed}"
    if isinstance(value, Unresolved):
        return f"{key} cannot be resolved ({value.why}): give {allowed}"
    return f"{key}={value!r}{where}: must be {allowed}"


def _cross_checks(get) -> list[str]:
    """Rules over several keys; `get(key)` is the value or None when absent."""
    out = []
    ce, div = get("loss.ce_weight"), get("loss.divergence_weight")
    if _is_number(ce) and _is_number(div) and ce == 0 and div == 0:
        out.append("loss.divergence_weight=0 and loss.ce_weight=0: the loss is zero at every "
                   "step and nothing trains; set loss.divergence_weight > 0 (distillation) "
                   "and/or loss.ce_weight > 0 (hard labels)")
    beta = get("loss.beta")
    if get("loss.kind") == "jsd" and _is_number(beta) and not 0 < beta < 1:
        out.append(f"loss.beta={beta!r}: jsd needs beta strictly inside (0, 1); at 0 or 1 "
                   "use loss.kind=forward_kl or loss.kind=reverse_kl")
    steps, epochs = get("trainer.max_steps"), get("trainer.max_epochs")
    if steps == -1 and epochs == -1:
        out.append("trainer.max_steps=-1 and trainer.max_epochs=-1: the run never stops; "
                   "set trainer.max_steps (or trainer.max_epochs) to a positive number")
    return out


def problems(cfg: DictConfig) -> list[str]:
    """Every rule the config breaks, as 'key=value: must be ...' lines."""
    found, values = [], {}
    for key, rule in RULES.items():
        present, value = _get(cfg, key)
        if not present:
            continue
        values[key] = value
        if value == "???" or isinstance(value, Unresolved) or not rule.check(value):
            found.append(_problem(key, value, rule.allowed))
    for group in ("train", "val"):
        sources = values.get(f"data.{group}")
        if not _sources(sources):
            continue
        for i, source in enumerate(sources):
            for name, rule in SOURCE_RULES.items():
                if name in source and not rule.check(source[name]):
                    where = f" (source {source['name']!r})" if source.get("name") else ""
                    found.append(_problem(f"data.{group}[{i}].{name}", source[name],
                                          rule.allowed, where))
    return found + _cross_checks(values.get)


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError listing every bad value; nothing has been loaded yet."""
    found = problems(cfg)
    if found:
        lines = "\n".join(f"  {p}" for p in found)
        raise ConfigError(f"invalid config ({len(found)} problem{'s' * (len(found) > 1)}); "
                          f"fix these overrides:\n{lines}")
