"""Data: sources (datasets), tokenization (chat templates), padding, step windows, the
DataModule."""

from distill.data.collate import PadCollator
from distill.data.config import DataConfig, SourceConfig
from distill.data.datamodule import DistillDataModule, build_dataset
from distill.data.windows import StepWindows

__all__ = ["DataConfig", "DistillDataModule", "PadCollator", "SourceConfig", "StepWindows",
           "build_dataset"]
