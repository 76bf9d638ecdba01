"""The run's schema: every setting of `python -m distill.train`, checked before anything loads.

`parse(cfg)` turns the composed Hydra config into a `RunConfig` of typed settings (each
group's dataclass lives beside the code that uses it: `LossConfig` in distill.training.objective,
`DataConfig` in distill.data, ...) and raises one `ConfigError` listing every problem: a
wrong type, an out-of-range value, an unknown key (`+` additions included, with the
nearest known key), a rule over several groups. Groups built by Hydra's `instantiate`
(trainer, optimizer, scheduler, callbacks, loggers) are checked against their target's
own signature, plus the rules below for the keys distill relies on.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from distill.cache.job import CacheSettings
from distill.core.rules import (
    ConfigError,
    Missing,
    Rule,
    Unresolved,
    boolean,
    build,
    choice,
    describe,
    integer,
    is_int,
    mapping,
    number,
    raise_problems,
    setting,
    text,
    unknown_key,
)
from distill.data.config import DataConfig
from distill.demo.task_eval import TaskEvalConfig
from distill.models.levers import Speed, packed_attention
from distill.models.lora import StudentConfig
from distill.training.objective import LossConfig
from distill.training.optim import LR
from distill.training.teachers import TeacherConfig

__all__ = ["ConfigError", "RunConfig", "parse", "problems", "validate"]
log = logging.getLogger(__name__)

PRECISIONS = ("32-true", "32", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true",
              "bf16", "16", "64", 32, 16, 64, "transformer-engine",
              "transformer-engine-float16")
HYDRA_KEYS = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_")
# keys a run no longer reads, with where they went
MOVED = {"tokenizer": "student.tokenizer and teacher.tokenizer (each defaults to its model's "
                      "folder; a student without a tokenizer of its own uses the teacher's)"}


def _ckpt_path(v) -> bool:
    if v is None or v == "last":
        return True  # remote checkpoints (s3://...) are Lightning's to find
    # a file, or a folder (FSDP's sharded checkpoints are folders of per-rank files)
    return isinstance(v, str) and ("://" in v or Path(v).expanduser().exists())


def _val_interval(v) -> bool:
    if v is None or (is_int(v) and v >= 1):
        return True
    return isinstance(v, float) and 0 < v <= 1


def _devices(v) -> bool:
    if v == "auto" or (is_int(v) and (v >= 1 or v == -1)):
        return True
    if isinstance(v, str):  # "0,1" or "2": Lightning parses it
        return v.replace(",", "").strip().isdigit() or v.strip() == "-1"
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(is_int(d) and d >= 0 for d in v)


# the Lightning Trainer keys distill's exactness and presets rely on
TRAINER_RULES = {
    "accumulate_grad_batches": integer(1, what=" (micro-batches per optimizer step)"),
    "max_steps": integer(1, also=(-1,), what=" (-1: no step limit)"),
    "max_epochs": integer(1, also=(-1,), null=True, what=" (-1: no epoch limit)"),
    "precision": choice(PRECISIONS),
    "gradient_clip_val": number(0, strict=False, null=True),
    "gradient_clip_algorithm": choice(("norm", "value"), null=True),
    "val_check_interval": Rule(_val_interval, "an integer >= 1 (steps), a fraction of an epoch "
                               "in (0, 1], or null"),
    "check_val_every_n_epoch": integer(1, null=True),
    "num_sanity_val_steps": integer(-1),
    "log_every_n_steps": integer(1),
    "deterministic": Rule(lambda v: isinstance(v, bool) or v == "warn", "true, false or 'warn'"),
    "accelerator": text(),
    "devices": Rule(_devices, "'auto', an integer >= 1 or -1 (all), a list of device ids, or a "
                    "string of them ('0,1')"),
    "num_nodes": integer(1),
}
OPTIMIZER_RULES = {"lr": LR, "weight_decay": number(0, strict=False),
                   "momentum": number(0, strict=False)}
SCHEDULER_RULES = {"num_warmup_steps": integer(0)}
CALLBACK_RULES = {  # by the class's name: third-party callbacks distill's presets configure
    "ModelCheckpoint": {"every_n_train_steps": integer(0, null=True),
                        "save_top_k": integer(-1)},
    "TQDMProgressBar": {"refresh_rate": integer(0)},
}
LOGGER_RULES = {"WandbLogger": {"offline": boolean()}}


def _node(*, null: bool) -> Rule:
    return mapping(null=null)


@dataclass(frozen=True)
class RunConfig:
    student: StudentConfig = setting()
    teacher: TeacherConfig = setting()
    data: DataConfig = setting()
    loss: LossConfig = setting()
    # folders other keys interpolate (${paths.data}/...): a use of an unset one is reported
    # at the key that uses it
    paths: dict = setting(rule=_node(null=False))
    # built by hydra.utils.instantiate: checked against their targets (check_targets)
    trainer: dict = setting(rule=_node(null=False))
    optimizer: dict = setting(rule=_node(null=False))
    speed: Speed = setting(factory=Speed)
    seed: int = setting(0, integer(0))
    ckpt_path: str | None = setting(None, Rule(_ckpt_path, "null, 'last' (resume from the "
                                               "checkpoints of paths.output_dir if any) or the "
                                               "path of an existing checkpoint"))
    cache: CacheSettings | None = setting(None, _node(null=True))
    evaluate: TaskEvalConfig | None = setting(None, _node(null=True))
    scheduler: dict | None = setting(None, _node(null=True))
    callbacks: dict | None = setting(None, _node(null=True))
    logger: dict | None = setting(None, _node(null=True))
    hydra: dict | None = setting(None, _node(null=True))  # Hydra's own, checked by Hydra

    def problems(self, prefix: str = "") -> list[str]:
        return cross_checks(self)


def cross_checks(run: RunConfig) -> list[str]:
    """Rules over several groups (each group's own rules live in its dataclass)."""
    out = []
    trainer = run.trainer
    if trainer.get("max_steps") == -1 and trainer.get("max_epochs") == -1:
        out.append("trainer.max_steps=-1 and trainer.max_epochs=-1: the run never stops; "
                   "set trainer.max_steps (or trainer.max_epochs) to a positive number")
    op = run.loss.on_policy
    samples = op.samples and not run.loss.ce_only
    if run.teacher.kind == "cached":
        if samples:
            out.append(f"loss.on_policy.fraction={op.fraction} needs a live teacher to score "
                       "the student's samples; a cached teacher only knows the dataset's "
                       "tokens. Use a live teacher (teacher.kind=live) or set "
                       "loss.on_policy.fraction=0")
        if run.cache is None:
            out.append("teacher.kind=cached needs the cache: block (cache.dir, cache.top_k); "
                       "teacher=cached brings it")
        elif run.cache.temperature != run.loss.temperature:
            out.append(f"cache.temperature={run.cache.temperature} and loss.temperature="
                       f"{run.loss.temperature}: the cache stores log-probs at the training "
                       "temperature; write the cache at loss.temperature")
    if run.loss.cross_tokenizer and run.data.packing:
        out.append(f"loss.cross_tokenizer={run.loss.cross_tokenizer} with data.packing=true: "
                   "packed rows would need the teacher's rows packed alike; set "
                   "data.packing=false")
    if op.samples and run.data.packing:
        out.append("loss.on_policy.fraction > 0 with data.packing=true: on-policy samples one "
                   "completion per row and packed rows hold several examples; set "
                   "data.packing=false")
    if run.speed.compile and run.speed.liger:
        out.append("speed.compile=true with speed.liger=true: Liger's autograd Functions "
                   "inside a compiled decoder layer stop dynamo (AssertionError in "
                   "overwrite_tensor_vt_proxy), and inductor already fuses the RMSNorm, SwiGLU "
                   "and RoPE that Liger would replace; choose one (docs/benchmarks.md "
                   "measures both)")
    if run.speed.compile and _fsdp(trainer) and "flex_attention" in _attentions(run):
        out.append("speed.compile=true under FSDP with flex_attention (set, or chosen for "
                   "data.packing=true on CUDA): inductor fails to lower flex_attention in the "
                   "compiled layers there, its head ratio symbolic (LoweringException at the "
                   "first step on an H200); set speed.compile=false (docs/benchmarks.md)")
    why = unfused_step_needed(trainer)
    if run.optimizer.get("fused") is True and why:
        clip, precision = trainer.get("gradient_clip_val"), trainer.get("precision")
        by_norm = "" if str(precision) in ("16-mixed", "16") else (
            " or trainer.gradient_clip_algorithm=norm")
        out.append(f"optimizer.fused=true with trainer.gradient_clip_val={clip} under "
                   f"trainer.precision={precision}: {why}; set optimizer.fused=false (torch's "
                   f"foreach AdamW){by_norm} or trainer.gradient_clip_val=null")
    out += _device_checks(trainer)
    out += _nothing_learns(run.loss)
    return out


def _fsdp(trainer: Mapping) -> bool:
    """Whether the strategy is FSDP: its name (`fsdp`) or class (`_target_`), not the
    values nested in it (a checkpoint folder named fsdp_runs is not FSDP)."""
    strategy = trainer.get("strategy")
    if isinstance(strategy, Mapping):
        strategy = strategy.get("_target_")
    return "fsdp" in str(strategy or "").lower()


def _attentions(run: RunConfig) -> set[str | None]:
    """The attention implementations the run's models will use: speed.attention, or the one
    packed rows get on CUDA, for both models (distill.models.levers); else each model's own."""
    chosen = packed_attention(run.speed, run.data.packing)
    if chosen:
        return {chosen}
    live = run.teacher.kind == "live"  # a cached teacher runs no model
    return {run.student.attn_implementation,
            getattr(run.teacher, "attn_implementation", None) if live else None}


# beyond these the loss's gradient vanishes (refused); beyond the softer ones it is scaled
# far down (a warning)
MAX_TEMPERATURE, SOFT_TEMPERATURE = 1000.0, 20.0
MIN_BETA, SOFT_BETA = 1e-3, 0.05


def unfused_step_needed(trainer: Mapping) -> str | None:
    """Why this trainer's clipping needs an optimizer that does not unscale in its own step
    (a fused one does), or None. Refuses `optimizer.fused=true` (cross_checks) and keeps
    distill.training.optim.adamw's CUDA default off the fused kernel (assemble.optimizer)."""
    clip = trainer.get("gradient_clip_val")
    if not (clip and float(clip) > 0):
        return None
    # Under a GradScaler (16-mixed; on CPU Lightning runs that as bf16-mixed, with none)
    # clipping would see scaled gradients: Lightning's AMP plugin stops such a run at its
    # first step, FSDP's would clip them wrongly. Lightning's AMP plugin refuses value
    # clipping for a fused optimizer even without a scaler; by norm
    # DistillModule.configure_gradient_clipping clips without it, and FSDP clips through the
    # wrapped module.
    precision = str(trainer.get("precision", ""))
    if precision in ("16-mixed", "16") and trainer.get("accelerator") != "cpu":
        return ("its GradScaler scales the gradients, which a fused optimizer unscales only "
                "in its own step, after the clipping (Lightning stops the run at its first "
                "step; under FSDP they would be clipped while scaled)")
    amp = precision in ("16-mixed", "16", "bf16-mixed", "bf16")
    if amp and trainer.get("gradient_clip_algorithm") == "value" and not _fsdp(trainer):
        return ("Lightning clips by value through its AMP plugin, which refuses a fused "
                "optimizer at the first step")
    return None


def _nothing_learns(loss) -> list[str]:
    """Settings under which the divergence, and so the gradient, is zero in float32."""
    out = []
    if loss.ce_only:
        return out
    if loss.temperature > MAX_TEMPERATURE:
        out.append(f"loss.temperature={loss.temperature:g}: at this temperature both softmaxes "
                   f"are uniform to within logits / T (~{10 / loss.temperature:.0e}), below "
                   "float32's resolution of their log-sum-exp: the divergence and its gradient "
                   "vanish and nothing learns. Distillation uses T from 1 to about 10 (distill "
                   f"refuses T above {MAX_TEMPERATURE:g})")
    if loss.kind == "jsd" and 0 < loss.beta < 1 and min(loss.beta, 1 - loss.beta) < MIN_BETA:
        near, kind = (loss.beta, "forward_kl") if loss.beta < 0.5 else (1 - loss.beta,
                                                                        "reverse_kl")
        out.append(f"loss.beta={loss.beta:g}: jsd is then {near:.0e} x {kind} to first order, "
                   "so its gradient is that much smaller and nothing learns at a usual learning "
                   f"rate; use loss.kind={kind}, or a beta in [{MIN_BETA:g}, {1 - MIN_BETA:g}]")
    return out


def cautions(run: RunConfig) -> list[str]:
    """Settings that train, but far slower than one would guess: logged as warnings."""
    loss, out = run.loss, []
    if loss.ce_only:
        return out
    if SOFT_TEMPERATURE < loss.temperature <= MAX_TEMPERATURE and not loss.temperature_squared:
        out.append(f"loss.temperature={loss.temperature:g}: the divergence's gradient scales as "
                   f"1 / T^2 ({1 / loss.temperature**2:.0e}); set loss.temperature_squared=true "
                   "to undo it, or expect to need a larger optimizer.lr")
    near = min(loss.beta, 1 - loss.beta)
    if loss.kind == "jsd" and MIN_BETA <= near < SOFT_BETA:
        kind = "forward_kl" if loss.beta < 0.5 else "reverse_kl"
        out.append(f"loss.beta={loss.beta:g}: jsd is then close to {near:g} x {kind}, a "
                   "gradient that much smaller than that divergence's")
    return out


def _device_checks(trainer: dict) -> list[str]:
    accelerator = str(trainer.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            return [f"trainer.accelerator={accelerator}: this machine has no CUDA GPU; use "
                    "trainer=cpu (or trainer.accelerator=auto, which picks the GPU where "
                    "there is one)"]
    return []


# --- the `_target_` groups -----------------------------------------------------------------
def _target(node: Mapping, key: str, found: list[str]):
    from hydra.utils import get_object

    target = node.get("_target_")
    if not isinstance(target, str) or not target:
        found.append(describe(f"{key}._target_", target, "the import path of what it builds"))
        return None
    try:
        return get_object(target)
    except Exception as err:  # an import error names the missing module
        found.append(f"{key}._target_={target!r}: cannot be imported ({type(err).__name__}: "
                     f"{err})")
        return None


def check_target(node: Mapping, key: str, found: list[str], rules: Mapping | None = None):
    """Unknown keys against the target's signature; values against `rules` and the rules a
    distill class declares (`SETTINGS`)."""
    obj = _target(node, key, found)
    if obj is None:
        return
    sig = inspect.signature(obj)
    params = [p.name for p in sig.parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    open_ended = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    rules = {**(rules or {}), **getattr(obj, "SETTINGS", {})}
    for name, value in node.items():
        if name in HYDRA_KEYS:
            continue
        if name not in params and not open_ended:
            found.append(unknown_key(f"{key}.", name, params))
            continue
        rule = rules.get(name)
        if rule is not None and (isinstance(value, (Missing, Unresolved))
                                 or not rule.check(value)):
            found.append(describe(f"{key}.{name}", value, rule.allowed))


def check_targets(run: RunConfig, found: list[str]) -> None:
    check_target(run.trainer, "trainer", found, TRAINER_RULES)
    check_target(run.optimizer, "optimizer", found, OPTIMIZER_RULES)
    if run.scheduler:
        check_target(run.scheduler, "scheduler", found, SCHEDULER_RULES)
    for group, table in (("callbacks", CALLBACK_RULES), ("logger", LOGGER_RULES)):
        nodes = getattr(run, group) or {}
        if "_target_" in nodes:  # a single object written by hand
            nodes = {"": nodes}
        for name, node in nodes.items():
            if node is None:
                continue
            key = f"{group}.{name}" if name else group
            if not isinstance(node, Mapping):
                found.append(describe(key, node, "a mapping with a _target_, or null"))
                continue
            cls = str(node.get("_target_", "")).rsplit(".", 1)[-1]
            check_target(node, key, found, table.get(cls))


# --- from Hydra's config to plain values -----------------------------------------------------
def plain(node):
    """A DictConfig as plain dicts and lists: a `???` becomes Missing, an interpolation that
    cannot be resolved Unresolved(why), so that each is reported under its own key."""
    if isinstance(node, DictConfig):
        out, keys = {}, list(node.keys())  # `for key in node` would skip the ??? ones
        for key in keys:
            if OmegaConf.is_missing(node, key):
                out[key] = Missing()
                continue
            try:
                value = node[key]
            except OmegaConfBaseException as err:
                out[key] = Unresolved(str(err).splitlines()[0])
                continue
            out[key] = plain(value)
        return out
    if isinstance(node, ListConfig):
        return [plain(v) for v in node]
    return node


def problems(cfg) -> list[str]:
    """Every rule the config breaks, as 'key=value: must be ...' lines."""
    values = plain(cfg) if isinstance(cfg, DictConfig) else dict(cfg)
    found = []
    for key in [k for k in values if k in MOVED]:
        found.append(f"{key}: this key is gone: use {MOVED[key]}")
        del values[key]
    run = build(RunConfig, values, "", found)
    if all(isinstance(getattr(run, k, None), dict) for k in ("trainer", "optimizer")):
        check_targets(run, found)
    return found


def parse(cfg) -> RunConfig:
    """The typed settings of a run; ConfigError listing every problem, before any loading."""
    found = problems(cfg)
    raise_problems(found)
    run = build(RunConfig, plain(cfg) if isinstance(cfg, DictConfig) else dict(cfg), "", [])
    for line in cautions(run):
        log.warning(line)
    return run


def validate(cfg) -> None:
    raise_problems(problems(cfg))
