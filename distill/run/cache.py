"""`cache_teacher_logits(cfg)`: the caching job, built from the training config itself.

`distill-cache +experiment=offline_fkl` (or `python -m distill.run.cache`) reads the same
config as `distill-train +experiment=offline_fkl`: the teacher (`teacher.name_or_path`), the
data and its tokenization, `loss.temperature` and the `cache:` block. So the cache and the
runs that read it cannot disagree on what was cached. Tests call `cache_teacher_logits`.
"""

from __future__ import annotations

import contextlib
import dataclasses

import hydra
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig

from distill.cache.job import CacheJob
from distill.data import DistillDataModule
from distill.data.sources import open_sources
from distill.export.callback import hydra_command
from distill.models.causal_lm import (
    check_head_rows,
    check_model_folder,
    load_causal_lm,
    load_tokenizer,
)
from distill.run.assemble import build_callbacks, instantiate
from distill.run.config import parse
from distill.run.paths import RunLock, is_launch_rank, register_resolvers

register_resolvers()


def cache_teacher_logits(cfg: DictConfig) -> dict:
    run = parse(cfg)  # every setting, before the teacher loads
    if run.cache is None:
        raise ValueError("the caching job needs the cache: block (cache.dir, cache.top_k): add "
                         "teacher=cached, or an experiment that sets it (+experiment="
                         "offline_fkl, +experiment=hf_offline)")
    L.seed_everything(run.seed)
    # one caching job per cache folder, refused before anything loads
    lock = RunLock(run.cache.dir) if is_launch_rank() else None
    with lock or contextlib.nullcontext():
        return _cache(cfg, run)


def _cache(cfg: DictConfig, run) -> dict:
    c = run.cache
    open_sources(run.data)  # data errors before the teacher loads
    check_model_folder(run.teacher.name_or_path, who="teacher")
    if run.loss.cross_tokenizer:
        return _cross_tokenizer_cache(run)
    # the teacher's: what the cache records (training compares the student's with it)
    tokenizer = load_tokenizer(run.teacher.tokenizer_path, who="teacher")
    # the cache is per example, whether training packs them (data.packing) or not; its
    # batches are padded as unpacked ones are (for_device below), never to max_length
    data = DistillDataModule(tokenizer, dataclasses.replace(run.data, packing=False))
    data.setup("fit")
    splits = {"train": data.train_set, "val": data.val_set}
    splits = {k: v for k, v in splits.items() if k in c.splits and v is not None}
    job = CacheJob(c, splits, data.collate, teacher_name=run.teacher.name_or_path,
                   tokenizer=tokenizer, max_length=data.max_length,
                   command=hydra_command("distill-cache"))
    model = load_causal_lm(run.teacher.name_or_path, dtype=run.teacher.dtype,
                           attn_implementation=run.teacher.attn_implementation)
    check_head_rows(model, len(tokenizer), "teacher")
    # the run's callbacks that act in a predict job (the progress bar, one's own); each rank
    # picks its own shards, so Lightning must not add a DistributedSampler
    callbacks = [cb for cb in build_callbacks(cfg, None, tokenizer)
                 if not isinstance(cb, ModelCheckpoint)]
    trainer = instantiate(cfg.trainer, callbacks=[job.writer, *callbacks], logger=False,
                          use_distributed_sampler=False, enable_checkpointing=False)
    data.for_device(trainer.strategy.root_device.type)  # job.collate is data.collate
    return job.run(trainer, model)


def _cross_tokenizer_cache(run) -> dict:
    """A teacher with its own tokenizer: the cache holds the teacher's side of each example
    (its tokens, byte offsets, top-k and own-token log-probs) and no student tokens, so it
    serves any student (distill.cache.cross). Written in one process, split by split."""
    import torch

    from distill.cache.cross import write_cache
    from distill.xtok.setup import cross_setup

    c = run.cache
    cross = cross_setup(run, with_offsets=True)
    data = DistillDataModule(cross.student_tokenizer, run.data, cross=cross)
    data.setup("fit")
    model = load_causal_lm(run.teacher.name_or_path, dtype=run.teacher.dtype,
                           attn_implementation=run.teacher.attn_implementation)
    check_head_rows(model, len(cross.teacher_tokenizer), "teacher")
    if torch.cuda.is_available():
        model = model.cuda()
    written = {}
    for split, ds in (("train", data.train_set), ("val", data.val_set)):
        if ds is None or split not in c.splits:
            continue
        write_cache(c.dir, ds.to_list(), model, cross.teacher_tokenizer, top_k=c.top_k,
                    temperature=c.temperature, split=split,
                    teacher=run.teacher.name_or_path)
        written[split] = len(ds)
    print(f"cross-tokenizer teacher cache {c.dir}: {written}")
    return {"dir": c.dir, "examples": written}


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    cache_teacher_logits(cfg)


if __name__ == "__main__":
    main()
