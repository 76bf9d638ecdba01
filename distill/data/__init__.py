"""Data: sources (datasets), tokenization (chat templates), padding, the DataModule."""

from distill.data.collate import PadCollator
from distill.data.datamodule import DistillDataModule, build_dataset

__all__ = ["DistillDataModule", "PadCollator", "build_dataset"]
