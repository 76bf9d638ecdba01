"""Lightning loggers from the `logger` config node: one key per logger, so presets combine.

`logger=csv` gives `{csv: {...}}`, `logger=[csv,tensorboard]` or `logger=many` both keys;
a flat node with its own `_target_` (a single logger written by hand) works too. The
optional ones (tensorboard, wandb) come with the `loggers` extra, which `make install` installs.
"""

from __future__ import annotations

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.loggers import Logger, WandbLogger


def build_loggers(node) -> list[Logger] | bool:
    """The configured loggers, or False (Lightning's "no logger") when there are none."""
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
    if any(isinstance(lg, WandbLogger) for lg in loggers or []):
        import wandb

        wandb.finish()
