"""Loggers from the config (csv, tensorboard, wandb offline, combined) and the token throughput
that Lightning's ThroughputMonitor measures."""

import lightning as L
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from distill.run.loggers import build_loggers
from distill.train import train
from distill.training.callbacks import TokenThroughput


def _metrics(out):
    return pd.read_csv(next(out.glob("logs/version_*/metrics.csv")))


@pytest.mark.parametrize("choice, keys", [("logger=csv", ["csv"]),
                                          ("logger=many", ["csv", "tensorboard"]),
                                          ("logger=[wandb,csv]", ["wandb", "csv"]),
                                          ("logger=none", []), ("~logger", [])])
def test_logger_presets_compose_and_combine(compose_cfg, choice, keys):
    cfg = compose_cfg(choice)
    node = cfg.get("logger")
    assert sorted(node or {}) == sorted(keys)
    for key in keys:
        assert node[key].save_dir == cfg.paths.output_dir
    if not keys:
        assert build_loggers(node) is False  # Lightning's "no logger"


def test_csv_tensorboard_and_offline_wandb_in_one_run(compose_cfg, tmp_path, monkeypatch):
    import wandb
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: W&B writes the run locally
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    summary = train(compose_cfg("+experiment=sft_rkl", "logger=[csv,tensorboard,wandb]",
                                "trainer.max_steps=6", "callbacks.throughput.window_size=3",
                                out=out))
    csv = _metrics(out)
    losses = csv["train/loss"].dropna().tolist()
    assert len(losses) == 6
    events = EventAccumulator(str(next(out.glob("tb/version_*")))).Reload()
    tb_losses = [e.value for e in events.Scalars("train/loss")]
    assert tb_losses == pytest.approx(losses, rel=1e-6)
    assert "train/device/items_per_sec" in events.Tags()["scalars"]
    runs = list(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
    assert wandb.run is None  # closed: a next run in this process starts its own
    # tokens/s (bar and logs) is the monitor's rate (one rank), from the window's 3rd step on
    rates = csv["train/device/items_per_sec"].dropna()
    assert len(rates) == 4 and (rates > 0).all()
    assert csv["tokens/s"].dropna().tolist() == pytest.approx(rates.tolist())
    assert summary["metrics"]["tokens/s"] == pytest.approx(rates.iloc[-1])


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def training_step(self, batch, batch_idx):
        return (self.w * batch["input_ids"].float().mean()) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_throughput_counts_real_tokens_not_padding(tmp_path):
    batches = []
    for i in range(7):
        mask = torch.zeros(3, 11, dtype=torch.long)
        for r in range(3):
            mask[r, : 1 + (5 * i + 3 * r) % 11] = 1  # rows of different real lengths
        batches.append({"input_ids": torch.randint(0, 9, (3, 11)), "attention_mask": mask})
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="logs")
    trainer = L.Trainer(max_steps=7, logger=logger, log_every_n_steps=1, accelerator="cpu",
                        callbacks=[TokenThroughput(window_size=2)], enable_checkpointing=False,
                        enable_model_summary=False, enable_progress_bar=False)
    trainer.fit(_Tiny(), train_dataloaders=DataLoader(batches, batch_size=None))
    csv = _metrics(tmp_path)
    counted = csv["train/lengths"].dropna().tolist()
    real = torch.stack([b["attention_mask"].sum() for b in batches]).cumsum(0).tolist()
    assert counted == real  # cumulative real tokens, padding excluded
    assert csv["train/samples"].dropna().tolist() == [3 * (i + 1) for i in range(7)]
    assert trainer.callback_metrics["tokens/s"] > 0


def test_missing_logger_package_names_the_fix():
    node = OmegaConf.create({"tb": {"_target_": "tests.test_loggers.needs_a_missing_package"}})
    with pytest.raises(ModuleNotFoundError, match=r"logger 'tb'.*make install.*logger=csv"):
        build_loggers(node)


def needs_a_missing_package():
    raise ModuleNotFoundError("Neither `tensorboard` nor `tensorboardX` is available.")


def test_a_flat_single_logger_node_still_works(tmp_path):
    node = OmegaConf.create({"_target_": "lightning.pytorch.loggers.CSVLogger",
                             "save_dir": str(tmp_path)})
    (logger,) = build_loggers(node)
    assert isinstance(logger, L.pytorch.loggers.CSVLogger)
    assert build_loggers(None) is False and build_loggers({}) is False
