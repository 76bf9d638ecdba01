"""`cache_teacher_logits(cfg)`: the caching job built from a Hydra config (conf/cache.yaml).

The thin @hydra.main wrapper is scripts/cache_teacher_logits.py; tests call this directly.
"""

from __future__ import annotations

import shlex

import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from distill.cache.job import CacheJob, CacheSettings
from distill.config import validate
from distill.models import DEMO_ASSETS, check_head_rows, load_tokenizer
from distill.paths import register_resolvers

if not OmegaConf.has_resolver("distill_demo"):
    OmegaConf.register_new_resolver("distill_demo", lambda: str(DEMO_ASSETS))
register_resolvers()  # ${distill_output_dir:}: Hydra's run or sweep-job folder


def cache_teacher_logits(cfg: DictConfig) -> dict:
    validate(cfg)  # types and ranges, before the teacher loads
    L.seed_everything(cfg.seed)
    c = cfg.cache
    teacher = instantiate(c.teacher)  # a LiveTeacher: the model whose top-k we keep
    tokenizer = load_tokenizer(teacher.tokenizer_path)
    check_head_rows(teacher.model, len(tokenizer), "teacher")
    data = instantiate(cfg.data, tokenizer=tokenizer)
    # the cache is per example, whether training packs them (data.packing) or not
    data.packing = False
    data.setup("fit")
    splits = {"train": data.train_set, "val": data.val_set}
    splits = {k: v for k, v in splits.items() if k in c.splits and v is not None}
    settings = CacheSettings(dir=c.dir, top_k=c.top_k, dtype=c.dtype,
                             temperature=c.temperature, shard_size=c.shard_size,
                             batch_size=c.batch_size, chunk=c.chunk,
                             num_workers=c.num_workers)
    job = CacheJob(settings, splits, data.collate, teacher_name=c.teacher.name_or_path,
                   tokenizer=tokenizer, max_length=data.max_length, command=_command())
    # each rank picks its own shards, so Lightning must not add a DistributedSampler
    callbacks = [instantiate(cb) for cb in (cfg.get("callbacks") or {}).values() if cb]
    trainer = instantiate(cfg.trainer, callbacks=[job.writer, *callbacks], logger=False,
                          use_distributed_sampler=False, enable_checkpointing=False)
    return job.run(trainer, teacher.model)


def _command() -> str | None:
    """This job's command line when Hydra launched it (None when called in-process)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    args = " ".join(shlex.quote(o) for o in HydraConfig.get().overrides.task)
    return f"python scripts/cache_teacher_logits.py {args}"
