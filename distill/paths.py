"""Where a run writes: Hydra's own job folder, so every run and every multirun job gets one.

`conf/paths/default.yaml` sets `output_dir: ${distill_output_dir:}`. Under `@hydra.main`
that is Hydra's run dir (`outputs/<date>/<time>`) or sweep-job dir (`multirun/<date>/<time>/
<job number>`), which also holds the job's `.hydra/` config and its log. `train(cfg)` called
in-process on a composed config has no Hydra job: it falls back to `outputs/<date>/<time>`.
An explicit `paths.output_dir=...` replaces all of this (and, for a single run, is also
where Hydra writes, through `hydra.run.dir: ${paths.output_dir}`).
"""

from __future__ import annotations

from datetime import datetime

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
    if not OmegaConf.has_resolver("distill_output_dir"):
        # cached: every `${paths.output_dir}` of one config names the same folder
        OmegaConf.register_new_resolver("distill_output_dir", hydra_output_dir, use_cache=True)
