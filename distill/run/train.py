"""Entry point: `python -m distill.train +experiment=sft_rkl [overrides]` (or `distill-train`).

`train(cfg)` checks every setting (distill.run.config), then builds the run in order, so that a
bad input stops it before the expensive parts load: the data sources (opened, first rows
checked), the model folders (whole), the tokenizers (compared), the data (tokenized; no
example longer than the models' positions), the callbacks and the checkpoint to resume, the
student (the checkpoint must be its own), the teacher, the module and trainer; then it fits,
scores and returns a summary dict. A run stopped by a signal raises RunInterrupted, which
`main` turns into exit status 128 + the signal. `main` is the thin @hydra.main wrapper.
Tests and the Python API call `train(cfg)` directly.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

import hydra
import lightning as L
from omegaconf import DictConfig

from distill.core.checkpoint_io import check_resume
from distill.data import DistillDataModule
from distill.data.sources import open_sources
from distill.data.tokenize import longest
from distill.models.causal_lm import check_head_rows, check_model_folder, check_positions
from distill.models.levers import apply_levers
from distill.models.lora import load_student
from distill.models.tokenizers import run_tokenizer
from distill.run import assemble
from distill.run.config import parse
from distill.run.paths import RunLock, is_launch_rank, register_resolvers
from distill.run.report import print_summary
from distill.run.resume import resolve_ckpt_path
from distill.training.callbacks.guard import RunInterrupted, interrupted_outside_steps
from distill.training.module import DistillModule
from distill.training.teachers import build_teacher

register_resolvers()  # ${distill_output_dir:}, ${distill_demo:}
log = logging.getLogger(__name__)


def train(cfg: DictConfig, *, student=None, teacher=None) -> dict:
    t0 = time.perf_counter()
    run = parse(cfg)  # every setting, before anything loads
    L.seed_everything(run.seed, workers=True)
    lock = RunLock(run.paths["output_dir"]) if is_launch_rank() else None
    with lock or contextlib.nullcontext():
        open_sources(run.data)  # files, formats, columns, first rows: before any model
        check_model_folder(run.student.name_or_path, run.student.from_scratch)
        if run.teacher.kind == "live":
            check_model_folder(run.teacher.name_or_path, who="teacher")
        tokenizer, cross = _tokenizers(run)
        data = DistillDataModule(tokenizer, run.data, cross=cross)
        data.setup("fit")  # every row: data errors name their file and row
        check_positions(longest(data.train_examples, data.val_set), model_paths(run, cross))
        callbacks = assemble.build_callbacks(cfg, run, tokenizer,
                                             cross.teacher_tokenizer if cross else None)
        ckpt_path = resolve_ckpt_path(run.ckpt_path, callbacks)
        student = student if student is not None else load_student(run.student)
        check_resume(ckpt_path, student, run.student.name_or_path)  # before the teacher
        if teacher is None and cross is not None:
            teacher = cross.teacher(run)  # on its own tokens
        elif teacher is None:
            teacher = build_teacher(run.teacher, run.cache and run.cache.dir,
                                    run.cache and run.cache.top_k, run.loss.temperature,
                                    run.loss.sparse_mode)
        vocab = len(tokenizer)
        check_head_rows(student, vocab, "student")
        if teacher.model is not None:
            check_head_rows(teacher.model, len(cross.teacher_tokenizer) if cross else vocab,
                            "teacher")
        levers = apply_levers(run.speed, student, teacher.model, run.data.packing)
        if levers:
            log.info("speed levers: %s", ", ".join(levers))
        teacher.prepare(data, tokenizer)
        module = DistillModule(
            student, teacher, run.loss, optimizer=assemble.optimizer(cfg.optimizer, run.trainer),
            scheduler=assemble.instantiate(cfg.scheduler) if cfg.get("scheduler") else None,
            vocab_size=vocab, eos_token_id=tokenizer.eos_token_id,
            cross=cross, pad_to_multiple_of=run.data.pad_to_multiple_of)
        logger = assemble.loggers(cfg)
        trainer = assemble.build_trainer(cfg, callbacks, logger)
        with interrupted_outside_steps(trainer):
            trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        out = assemble.finish(trainer, module, callbacks, run, time.perf_counter() - t0)
        if trainer.is_global_zero:
            print_summary(out)
        assemble.close(logger)
    return out


def _tokenizers(run):
    """(the student's tokenizer, the cross-tokenizer pairing or None)."""
    if not run.loss.cross_tokenizer:
        return run_tokenizer(run.student, run.teacher), None
    from distill.xtok.setup import cross_setup

    cross = cross_setup(run)
    return cross.student_tokenizer, cross


def model_paths(run, cross=None) -> dict[str, str]:
    """The models a run loads by name, whose configs bound the example length (a
    cross-tokenizer teacher reads its own tokens, bounded by data.teacher_max_length)."""
    live = ({"teacher": run.teacher.name_or_path}
            if run.teacher.kind == "live" and cross is None else {})
    return {"student": run.student.name_or_path, **live}


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    except RunInterrupted as stop:  # a non-zero exit: `train && eval` must not carry on
        print(f"\n{stop}", file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)


if __name__ == "__main__":
    main()
