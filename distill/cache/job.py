"""The caching job end to end: plan, claim the folder, predict, seal the metadata, report.

    job = CacheJob(settings, {"train": ds, "val": ds_val}, collate, teacher_name=...,
                   tokenizer=tok, max_length=512)
    trainer = L.Trainer(callbacks=[job.writer], use_distributed_sampler=False, ...)
    summary = job.run(trainer, teacher_model)

`metadata.json` is written before the first shard and says what the cache is; a rerun
into the same folder must agree with it (else CacheMismatch), then only writes the shards
that are missing. When every shard exists, rank 0 adds the totals and `complete: true`:
training reads only complete caches.
"""

from __future__ import annotations

import shutil
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import pyarrow as pa
import torch
from torch.utils.data import DataLoader

from distill.cache.format import (
    FORMAT,
    VALUE_DTYPES,
    VERSION,
    CacheMismatch,
    first_difference,
    identity,
    read_metadata,
    shard_path,
    tokenizer_hash,
    write_json_atomic,
)
from distill.cache.plan import Plan, ShardBatches, describe
from distill.cache.verify import file_sha256, recorded, shard_problem
from distill.cache.writer import ShardWriter, TopKPredictor
from distill.core.rules import Rule, check, choice, integer, number, setting, text


def _splits(v) -> bool:
    return isinstance(v, Sequence) and not isinstance(v, str) and len(v) > 0 and \
        all(s in ("train", "val") for s in v)


@dataclass(frozen=True)
class CacheSettings:
    """`cache:` where the teacher-logit cache lives and how the caching job writes it.
    The log-probs are stored at the training temperature (`loss.temperature`)."""

    dir: str = setting(rule=text())
    top_k: int = setting(64, integer(1, what=" (K, ids kept per position)"))
    dtype: str = setting("float16", choice(VALUE_DTYPES))  # of the stored log-probs
    temperature: float = setting(1.0, number(0, strict=True))
    shard_size: int = setting(256, integer(1))  # examples per shard
    batch_size: int = setting(8, integer(1))
    chunk: int | None = setting(None, integer(1, null=True,
                                              what=" (rows per top-k chunk; null: a fixed "
                                                   "logits budget)"))
    num_workers: int = setting(0, integer(0))
    splits: list[str] = setting(("train", "val"), Rule(_splits, "a non-empty list of train "
                                                              "and/or val"))

    def __post_init__(self):
        check(self)


class CacheData(L.LightningDataModule):
    """Claims the cache folder in setup, then serves this rank's pending shard batches."""

    def __init__(self, job: CacheJob):
        super().__init__()
        self.job = job

    def setup(self, stage: str | None = None):
        self.job.claim(self.trainer)

    def predict_dataloader(self):
        t = self.trainer
        job = self.job
        pending = job.plan.pending(job.root, t.global_rank, t.world_size, job.intact)
        items = ShardBatches(job.datasets, job.plan, pending, job.collate)
        return DataLoader(items, batch_size=None, shuffle=False,
                          num_workers=job.settings.num_workers)


class CacheJob:
    def __init__(self, settings: CacheSettings, datasets: dict, collate, *, teacher_name: str,
                 tokenizer, max_length: int, command: str | None = None):
        self.settings, self.datasets, self.collate = settings, datasets, collate
        self.root = Path(settings.dir)
        self.vocab = len(tokenizer)
        if settings.top_k > self.vocab:
            raise ValueError(f"cache.top_k={settings.top_k} exceeds the vocabulary ({self.vocab})")
        self.plan = Plan(settings.shard_size, settings.batch_size,
                         {split: describe(ds) for split, ds in datasets.items()})
        self.meta = {
            "format": FORMAT, "version": VERSION, "teacher": str(teacher_name),
            "tokenizer": tokenizer_hash(tokenizer), "vocab": self.vocab,
            "max_length": int(max_length), "top_k": int(settings.top_k),
            "temperature": float(settings.temperature), "dtype": settings.dtype,
            "data": {s: i.fingerprint for s, i in self.plan.splits.items()},
            "plan": self.plan.summary(),
            "command": command,  # how to rerun (repair) it; not part of what the cache is
        }
        self.repaired = 0
        self.writer = ShardWriter(self.root, settings.top_k)
        self.data = CacheData(self)

    def predictor(self, model) -> TopKPredictor:
        s = self.settings
        return TopKPredictor(model, s.top_k, s.temperature, s.dtype, self.vocab, s.chunk)

    def claim(self, trainer) -> None:
        """Refuse a folder holding another cache; rank 0 writes the metadata; all wait."""
        existing = read_metadata(self.root)
        if existing is not None:
            diff = first_difference(identity(existing), identity(self.meta))
            if diff is not None:
                raise CacheMismatch(*diff, where=f"in {self.root}",
                                    hint="This folder holds another cache: set a new "
                                    "cache.dir, or delete the folder to rebuild it.")
        if trainer.is_global_zero and existing is None:
            for split in self.plan.splits:  # shards of unknown origin: start clean
                shutil.rmtree(self.root / split, ignore_errors=True)
            self.root.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.root / "metadata.json", self.meta)
        trainer.strategy.barrier("distill_cache_claim")

    def intact(self, split: str, shard: int) -> bool:
        """Check an existing shard in full before skipping it; delete it when damaged."""
        path = shard_path(self.root, split, shard)
        s = self.settings
        why = shard_problem(path, recorded(read_metadata(self.root), path, split, shard),
                            top_k=s.top_k, vocab=self.vocab, dtype=s.dtype,
                            examples=self.plan.examples(split, shard))
        if why is None:
            return True
        print(f"[cache] shard {path} is damaged ({why}): rewriting it", flush=True)
        path.unlink()
        self.repaired += 1
        return False

    def run(self, trainer: L.Trainer, model) -> dict:
        t0 = time.perf_counter()
        with warnings.catch_warnings():  # our batches are whole items: no sampler indices
            warnings.filterwarnings("ignore", "Couldn't infer the batch indices")
            warnings.filterwarnings("ignore", ".*DataLoader` across ranks is zero")  # all done
            trainer.predict(self.predictor(model), datamodule=self.data,
                            return_predictions=False)
        w = self.writer
        if trainer.world_size > 1:
            print(f"[cache] rank {trainer.global_rank}/{trainer.world_size}: wrote {w.shards} "
                  f"shards, {w.examples} examples, {w.tokens} tokens", flush=True)
        trainer.strategy.barrier("distill_cache_written")
        done = torch.tensor([w.examples, w.tokens, w.shards, self.repaired],
                            dtype=torch.float64, device=trainer.strategy.root_device)
        done = trainer.strategy.reduce(done, reduce_op="sum").tolist()
        wall = time.perf_counter() - t0
        summary = {"dir": str(self.root), "run_examples": int(done[0]),
                   "run_tokens": int(done[1]), "shards_written": int(done[2]),
                   "shards_repaired": int(done[3]),
                   "wall_s": wall, "tokens_per_s": done[1] / max(wall, 1e-9)}
        if trainer.is_global_zero:
            summary.update(self.seal())
            print_summary(summary)
        return summary

    def seal(self) -> dict:
        """Check every shard is there, add the totals, mark the cache complete."""
        shards, totals = {}, {"examples": 0, "tokens": 0, "bytes": 0}
        for split, shard in self.plan.shards():
            path = shard_path(self.root, split, shard)
            if not path.exists():
                raise RuntimeError(f"shard {path} is missing after the job: rerun it to "
                                   "finish the cache (finished shards are kept)")
            with pa.memory_map(str(path)) as src:
                tbl = pa.ipc.open_stream(src).read_all()
                row = {"examples": tbl.num_rows,
                       "tokens": sum(len(c.values) for c in tbl.column("ids").chunks)
                       // self.settings.top_k,
                       "bytes": path.stat().st_size}
            side = recorded(None, path, split, shard)  # the writer's record
            row["sha256"] = side["sha256"] if side else file_sha256(path)
            shards.setdefault(split, []).append(row)
            for key in totals:
                totals[key] += row[key]
        totals["bytes_per_token"] = totals["bytes"] / max(totals["tokens"], 1)
        meta = {**self.meta, "complete": True, "shards": shards, "totals": totals}
        write_json_atomic(self.root / "metadata.json", meta)
        return totals


def print_summary(s: dict) -> None:
    k = s.get("tokens", 0)
    lines = [
        "", "=" * 60, f"teacher cache: {s['dir']}",
        f"  examples          {s.get('examples', 0)}",
        f"  trained tokens    {k}",
        f"  bytes             {s.get('bytes', 0)}  ({s.get('bytes_per_token', 0):.1f} per token)",
        f"  this run          {s['run_tokens']} tokens in {s['shards_written']} shards, "
        f"{s['wall_s']:.1f} s, {s['tokens_per_s']:.0f} tokens/s"
        + (f", {s['shards_repaired']} damaged shards rewritten" if s.get("shards_repaired")
           else ""),
        "=" * 60,
    ]
    print("\n".join(lines))
