"""Entry point: `python -m distill.train +experiment=sft_rkl [overrides]`.

`train(cfg)` builds everything from the Hydra config in order (tokenizer, student,
teacher, data, module, callbacks, trainer), fits, exports the student and returns a
summary dict; `main` is the thin @hydra.main wrapper. Tests call `train(cfg)` directly.
"""

from __future__ import annotations

import time

import hydra
import lightning as L
from hydra.errors import InstantiationException
from hydra.utils import instantiate as hydra_instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from distill.config import validate
from distill.levers import Speed, apply_levers
from distill.lightning_version import check_lightning_version
from distill.loggers import build_loggers, close_loggers
from distill.models import DEMO_ASSETS, check_head_rows, check_same_tokenizer, load_tokenizer
from distill.module import DistillModule
from distill.paths import register_resolvers
from distill.report import evaluate_models, print_summary, reference, trained_student
from distill.resume import resolve_ckpt_path
from distill.rollout import check_config as check_on_policy

if not OmegaConf.has_resolver("distill_demo"):
    OmegaConf.register_new_resolver("distill_demo", lambda: str(DEMO_ASSETS))
register_resolvers()  # ${distill_output_dir:}: Hydra's run or sweep-job folder


def instantiate(node, **kwargs):
    """hydra.utils.instantiate, re-raising our own clear errors instead of Hydra's wrapper."""
    try:
        return hydra_instantiate(node, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, (ValueError, OSError)):
            raise err.__cause__ from None
        raise


def train(cfg: DictConfig) -> dict:
    t0 = time.perf_counter()
    validate(cfg)  # types and ranges, before anything loads
    check_lightning_version()
    L.seed_everything(cfg.seed, workers=True)
    check_on_policy(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer)
    teacher = instantiate(cfg.teacher) if cfg.get("teacher") else None
    if teacher is None:
        raise ValueError("no teacher configured: set teacher=demo (live) or teacher=cached")
    vocab = len(tokenizer)
    if getattr(teacher, "tokenizer_path", None):
        vocab = check_same_tokenizer(tokenizer, load_tokenizer(teacher.tokenizer_path))
    student = instantiate(cfg.student)
    check_head_rows(student, vocab, "student")
    if getattr(teacher, "model", None) is not None:  # a cached teacher has no model
        check_head_rows(teacher.model, vocab, "teacher")
    apply_levers(Speed.from_config(OmegaConf.to_container(cfg.get("speed") or {})), student,
                 getattr(teacher, "model", None))
    datamodule = instantiate(cfg.data, tokenizer=tokenizer)
    if hasattr(teacher, "check_data"):  # a cached teacher must match this tokenizer and data
        teacher.check_data(datamodule, tokenizer)
        teacher.prefetch_in(datamodule)  # its targets come with each batch
    module = DistillModule(student, teacher, loss=OmegaConf.to_container(cfg.loss, resolve=True),
                           optimizer=instantiate(cfg.optimizer),
                           scheduler=instantiate(cfg.scheduler) if cfg.get("scheduler") else None,
                           vocab_size=vocab, eos_token_id=tokenizer.eos_token_id)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c]
    for cb in callbacks:
        if hasattr(cb, "tokenizer") and cb.tokenizer is None:
            cb.tokenizer = tokenizer
    logger = build_loggers(cfg.get("logger"))  # logger=csv, =[csv,tensorboard], =many
    # callbacks.checkpoint=null means no checkpoints: Lightning would otherwise add its own
    # ModelCheckpoint (a full fp32 + optimizer-state copy of the student at every validation)
    extra = {}
    if "enable_checkpointing" not in cfg.trainer:
        extra["enable_checkpointing"] = any(isinstance(cb, ModelCheckpoint) for cb in callbacks)
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=logger, **extra)

    before = evaluate_models(cfg, tokenizer, {"teacher": teacher, "untrained student": student})
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), callbacks)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    export = next((cb for cb in callbacks if hasattr(cb, "saved_to")), None)
    after = evaluate_models(cfg, tokenizer,
                            {"distilled student": trained_student(student, trainer, export)})

    summary = {
        "student_dir": str(export.saved_to) if export and export.saved_to else None,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "accuracy": {**before, **after},
        "reference": reference(cfg) if after else None,
        "global_step": trainer.global_step,
        "wall_s": time.perf_counter() - t0,
    }
    if trainer.is_global_zero:
        print_summary(summary)
    close_loggers(logger)
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
