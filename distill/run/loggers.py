"""Lightning loggers from the `logger` config node: one key per logger, so presets combine.

`logger=csv` gives `{csv: {...}}`, `logger=[csv,tensorboard]` or `logger=many` both keys;
a flat node with its own `_target_` (a single logger written by hand) works too. The
optional ones (tensorboard, wandb) come with the `loggers` extra, which `make install` installs.

One version per output folder (`version: 0` in the presets): a resumed run (the same
`paths.output_dir`) continues its TensorBoard curves and its `metrics.csv`. Lightning's own
CSVLogger deletes an existing metrics.csv; `CSVLogger` here keeps the rows of the steps
before the first one the run logs (a resume from step 500 keeps steps 0-499 and rewrites
any later ones a killed run had logged), as TensorBoard drops out-of-order steps.
`WandbLogger` here keeps one W&B run id per output folder (`wandb/distill_run_id`) and
resumes that run.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers import Logger
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from distill.training.callbacks.logs import silence_known_noise


class ContinuedCSV:
    """metrics.csv written as Lightning's CSV writer does (appended rows, the header
    rewritten when a new key appears), continuing the rows already in the file."""

    def __init__(self, log_dir: str):
        self.log_dir, self.path = log_dir, Path(log_dir) / "metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.metrics: list[dict] = []
        self.metrics_keys: list[str] = []
        self.hparams: dict = {}
        self._started = False

    def log_hparams(self, params: dict) -> None:
        self.hparams.update(params)
        save_hparams_to_yaml(os.path.join(self.log_dir, "hparams.yaml"), self.hparams)

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        if step is None:
            step = len(self.metrics)
        if not self._started:
            self._continue_from(step)
        row = {k: v.item() if hasattr(v, "item") else v for k, v in metrics.items()}
        self.metrics.append({**row, "step": step})

    def _continue_from(self, step: int) -> None:
        """Keep the file's rows before `step`; rows at or after it are from a run that went
        past the checkpoint this one resumed from (or from an earlier run, when this one
        starts at 0), and this run logs those steps anew."""
        self._started = True
        if not self.path.is_file():
            return
        with open(self.path, newline="") as f:
            reader = csv.DictReader(f)
            keys, rows = list(reader.fieldnames or []), list(reader)
        kept = [r for r in rows if r.get("step") and float(r["step"]) < step]
        self.metrics_keys = keys
        if len(kept) < len(rows):
            rank_zero_warn(f"{self.path}: {len(rows) - len(kept)} rows of steps >= {step} from "
                           "an earlier run in this folder are replaced by this run's")
            self._write(keys, kept, mode="w")

    def save(self) -> None:
        if not self.metrics:
            return
        new = sorted(set().union(*self.metrics) - set(self.metrics_keys))
        rows = self.metrics
        if new and self.path.is_file():  # a new column: the whole file gets the new header
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f)) + rows
        self.metrics_keys = sorted(set(self.metrics_keys) | set(new))
        self._write(self.metrics_keys, rows, mode="w" if new or not self.path.is_file()
                    else "a")
        self.metrics = []

    def _write(self, keys: list[str], rows: list[dict], mode: str) -> None:
        fresh = mode == "w"
        target = self.path.with_suffix(".csv.tmp") if fresh else self.path
        with open(target, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            if fresh:
                writer.writeheader()
            writer.writerows(rows)
        if fresh:
            os.replace(target, self.path)  # never a half-rewritten metrics.csv


class CSVLogger(LightningCSVLogger):
    """Lightning's CSVLogger (same folders, same columns) that continues an existing
    metrics.csv instead of deleting it: see the module docstring."""

    def __init__(self, save_dir, name: str | None = "lightning_logs",
                 version: int | str | None = None, prefix: str = "",
                 flush_logs_every_n_steps: int = 100):
        super().__init__(save_dir, name=name, version=version, prefix=prefix,
                         flush_logs_every_n_steps=flush_logs_every_n_steps)
        self._writer: ContinuedCSV | None = None

    @property
    @rank_zero_experiment
    def experiment(self) -> ContinuedCSV:
        if self._writer is None:
            self._writer = ContinuedCSV(self.log_dir)
        return self._writer

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self.save()


class WandbLogger(LightningWandbLogger):
    """Lightning's WandbLogger whose run id, unless one is given, belongs to the output
    folder: drawn once, kept in `<save_dir>/wandb/distill_run_id`, and resumed
    (`resume="allow"`) by a run resumed into the folder."""

    def __init__(self, *args, save_dir: str | Path = ".", id: str | None = None,
                 version: str | None = None, **kwargs):
        if id is None and version is None:
            id = folder_run_id(Path(save_dir))
            kwargs.setdefault("resume", "allow")
        super().__init__(*args, save_dir=save_dir, id=id, version=version, **kwargs)


def folder_run_id(save_dir: Path) -> str:
    """The folder's W&B run id; the first process to ask draws it (every rank of a DDP
    launch builds its loggers: one id wins, atomically, and all read it)."""
    import secrets

    path = save_dir / "wandb" / "distill_run_id"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(secrets.token_hex(8) + "\n")
        try:
            os.link(tmp, path)  # fails if another process was first: keep its id
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return path.read_text().strip()


def build_loggers(node) -> list[Logger] | bool:
    """The configured loggers, or False (Lightning's "no logger") when there are none."""
    silence_known_noise()  # the tips come when the Trainer is built, right after this
    if not node:
        return False
    nodes = {"logger": node} if "_target_" in node else {k: v for k, v in node.items() if v}
    return [_build(name, n) for name, n in nodes.items()] or False


def _build(name: str, node) -> Logger:
    try:
        return instantiate(node)
    except (InstantiationException, ModuleNotFoundError) as err:
        cause = err.__cause__ if isinstance(err, InstantiationException) else err
        if not isinstance(cause, ModuleNotFoundError):
            raise
        raise ModuleNotFoundError(
            f"logger '{name}' ({node.get('_target_')}) cannot start, a package is missing: "
            f"{cause}. Run `make install` (or `pip install -e '.[loggers]'`), or pick another "
            "logger (logger=csv)") from err


def close_loggers(loggers) -> None:
    """End a W&B run: the next run in this process (a multirun job) would reuse it otherwise."""
    if any(isinstance(lg, LightningWandbLogger) for lg in loggers or []):
        import wandb

        wandb.finish()
