"""The pieces `train()` puts together, each built from the checked settings: callbacks,
loggers, the trainer, the resume checkpoint and the run's summary."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from hydra.errors import InstantiationException
from hydra.utils import get_method
from hydra.utils import instantiate as hydra_instantiate
from lightning.pytorch.callbacks import ModelCheckpoint

from distill.core.checkpoint_io import AtomicCheckpointIO
from distill.demo.task_eval import TaskAccuracy, references_for
from distill.run.config import unfused_step_needed
from distill.run.loggers import build_loggers, close_loggers
from distill.training.callbacks.compile_watch import CompileWatch


def instantiate(node, **kwargs):
    """hydra.utils.instantiate, re-raising our own clear errors instead of Hydra's wrapper."""
    try:
        return hydra_instantiate(node, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, (ValueError, OSError)):
            raise err.__cause__ from None
        raise


def optimizer(node, trainer: Mapping):
    """The optimizer factory. Where this trainer's clipping needs the unfused step
    (distill.run.config.unfused_step_needed), a factory whose `fused` is left to its default
    (distill.training.optim.adamw takes the fused kernel on CUDA) gets fused=False."""
    if node.get("fused") is None and unfused_step_needed(trainer):
        target = get_method(node["_target_"])
        if "fused" in inspect.signature(target).parameters:
            return instantiate(node, fused=False)
    return instantiate(node)


def build_callbacks(cfg, run, tokenizer, teacher_tokenizer=None) -> list:
    """The configured callbacks (callbacks.<name>=null drops one), the export given the
    tokenizer, and the demo-task scoring when `evaluate` names a task set (the teacher
    scored on its own tokenizer where it has one: cross-tokenizer runs)."""
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c]
    for cb in callbacks:
        if hasattr(cb, "tokenizer") and cb.tokenizer is None:
            cb.tokenizer = tokenizer
    if run is not None and run.evaluate is not None:
        callbacks.append(TaskAccuracy(run.evaluate, tokenizer, teacher_tokenizer))
    return callbacks


def build_trainer(cfg, callbacks: list, logger):
    extra = {}
    # callbacks.checkpoint=null means no checkpoints: Lightning would otherwise add its own
    # ModelCheckpoint (a full fp32 + optimizer-state copy of the student at every validation)
    if "enable_checkpointing" not in cfg.trainer:
        extra["enable_checkpointing"] = any(isinstance(cb, ModelCheckpoint) for cb in callbacks)
    strategy = cfg.trainer.get("strategy")
    sharded = isinstance(strategy, dict) or "fsdp" in str(strategy)
    if "plugins" not in cfg.trainer and not sharded:  # FSDP writes its own (sharded) files
        extra["plugins"] = [AtomicCheckpointIO()]
    return instantiate(cfg.trainer, callbacks=callbacks, logger=logger, **extra)


def loggers(cfg):
    return build_loggers(cfg.get("logger"))


def finish(trainer, module, callbacks: list, run, wall_s: float) -> dict:
    """Score the trained student (the demo tasks) and gather the run's summary."""
    export = next((cb for cb in callbacks if hasattr(cb, "saved_to")), None)
    scores = next((cb for cb in callbacks if isinstance(cb, TaskAccuracy)), None)
    watch = next((cb for cb in callbacks if isinstance(cb, CompileWatch)), None)
    references = references_for(run.evaluate.references, run.loss) if run.evaluate else []
    return {
        "student_dir": str(export.saved_to) if export and export.saved_to else None,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "accuracy": dict(scores.accuracy) if scores else {},
        "references": references,
        "global_step": trainer.global_step,
        "trained_tokens": module.sums.trained_tokens,  # this process's steps (since a resume)
        "wall_s": wall_s,
        "compile": watch.report() if watch else None,
    }


def close(logger) -> None:
    close_loggers(logger)
