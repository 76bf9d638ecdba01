"""Where a run writes: Hydra's own job folder, so every run and every multirun job gets one.

`conf/paths/default.yaml` sets `output_dir: ${distill_output_dir:}`. Under `@hydra.main`
that is Hydra's run dir (`outputs/<date>/<time>`) or sweep-job dir (`multirun/<date>/<time>/
<job number>`), which also holds the job's `.hydra/` config and its log. `train(cfg)` called
in-process on a composed config has no Hydra job: it falls back to `outputs/<date>/<time>`.
An explicit `paths.output_dir=...` replaces all of this (and, for a single run, is also
where Hydra writes, through `hydra.run.dir: ${paths.output_dir}`).
"""

from __future__ import annotations

import json
import os
import socket
from datetime import datetime
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf


def hydra_output_dir() -> str:
    """Hydra's job output dir once the job runs, else a fresh timestamped folder.

    While Hydra decides a single run's folder (it resolves `hydra.run.dir`, which points
    here) its `runtime.output_dir` is not set yet, so the fallback names the folder; the
    resolver is cached per config, so the run keeps that one name afterwards.
    """
    if HydraConfig.initialized():
        found = OmegaConf.select(HydraConfig.get(), "runtime.output_dir", default=None)
        if found:
            return str(found)
    return datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S")


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("distill_demo"):
        from distill.demo import ASSETS

        OmegaConf.register_new_resolver("distill_demo", lambda: str(ASSETS))
    if not OmegaConf.has_resolver("distill_output_dir"):
        # cached: every `${paths.output_dir}` of one config names the same folder
        OmegaConf.register_new_resolver("distill_output_dir", hydra_output_dir, use_cache=True)
    if not OmegaConf.has_resolver("distill_precision"):  # trainer=auto
        from distill.run.devices import auto_precision

        OmegaConf.register_new_resolver("distill_precision", auto_precision)


class RunLock:
    """One run per output folder: an exclusive `flock` on `<dir>/.distill.lock`, held for the
    run's life. The kernel drops it when the process ends however it ends, so a killed run
    leaves no stale lock; a second run into the folder is refused, naming the first.

    Hydra writes a run's `.hydra/` record (config, overrides) into the folder before any of
    distill's code runs, so a refused second run has already overwritten the first's: the
    lock file keeps a copy of the holder's record, which the refused run puts back."""

    RECORD = ".hydra"

    def __init__(self, folder):
        self.folder = Path(folder)
        self.path = self.folder / ".distill.lock"
        self.file = None

    def __enter__(self):
        import fcntl

        self.folder.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.file.seek(0)
            held = _holder(self.file.read())
            self.file.close()
            self._put_back(held.get("record") or {})
            raise RuntimeError(
                f"{self.folder} is the output folder of a run that is still going "
                f"({held.get('holder') or 'another process'}): two runs in one folder would "
                "mix their checkpoints, logs and student. Give this run its own "
                "paths.output_dir, or wait for the other one") from None
        record = {p.name: p.read_text() for p in sorted((self.folder / self.RECORD).glob("*"))
                  if p.is_file()}
        self.file.seek(0)
        self.file.truncate()
        json.dump({"holder": f"pid {os.getpid()} on {socket.gethostname()}",
                   "record": record}, self.file)
        self.file.flush()
        return self

    def _put_back(self, record: dict) -> None:
        """The holder's `.hydra/` files, over the ones this refused run's Hydra wrote."""
        folder = self.folder / self.RECORD
        if not folder.is_dir():
            return
        for name, text in record.items():
            if not (folder / name).exists() or (folder / name).read_text() != text:
                (folder / name).write_text(text)

    def __exit__(self, *exc):
        import fcntl

        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
            self.file = None


def _holder(text: str) -> dict:
    try:
        held = json.loads(text)
    except ValueError:
        return {"holder": text.strip()}  # written by an older distill
    return held if isinstance(held, dict) else {}


def is_launch_rank() -> bool:
    """The process that owns the run's folder: global rank 0, or a launch not yet split into
    ranks (Lightning's launcher re-runs the command in its child processes)."""
    return all(os.environ.get(var, "0") == "0" for var in ("RANK", "LOCAL_RANK", "NODE_RANK"))
