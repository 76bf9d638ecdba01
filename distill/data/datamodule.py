"""The LightningDataModule: sources -> tokenized datasets -> padded batches.

Several training sources are mixed with `datasets.interleave_datasets` by their weights
(e.g. SFT chat data with CPT text); validation sources are concatenated. With
`packing=True` the training examples are packed several per row (distill.data.pack).
"""

from __future__ import annotations

import datasets
import lightning as L
from torch.utils.data import DataLoader

from distill.core.rules import parse
from distill.data.chat import resolve_template
from distill.data.collate import PadCollator, width_multiple
from distill.data.config import DataConfig
from distill.data.files import source_name
from distill.data.pack import pack_dataset
from distill.data.sources import load_source  # files, folders, hub names, memory
from distill.data.tokenize import tokenize_source
from distill.data.windows import StepWindows, WindowCollate, WindowSampler


def build_dataset(sources, tokenizer, max_length: int, seed: int, mix: bool = True,
                  stopping_strategy: str = "first_exhausted", cross=None, **options):
    """Tokenized sources, mixed by weight (or concatenated). `options`: chat_template,
    assistant_turns, cpt_stride, chat_template_kwargs, num_proc (distill.data.tokenize).
    With `cross` (a distill.xtok CrossSetup) each row is tokenized for both models."""
    if cross is not None:
        parts = [cross.tokenize_source(load_source(s), s, max_length, **options)
                 for s in sources]
    else:
        options.pop("teacher_max_length", None)
        parts = [tokenize_source(load_source(s), s, tokenizer, max_length, **options)
                 for s in sources]
    if len(parts) == 1:
        return parts[0]
    if not mix:
        return datasets.concatenate_datasets(parts)
    weights = [float(s.get("weight", 1.0)) for s in sources]
    total = sum(weights)
    return datasets.interleave_datasets(parts, probabilities=[w / total for w in weights],
                                        seed=seed, stopping_strategy=stopping_strategy)


def check_packing_support() -> None:
    """Packed rows rely on transformers building per-document masks from position_ids;
    older versions build one causal mask over the whole row, without any error."""
    import transformers

    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            f"data.packing=true needs a transformers that masks packed documents apart "
            f"from their position_ids (masking_utils.find_packed_sequence_indices); this is "
            f"{transformers.__version__}: upgrade transformers or set data.packing=false"
        ) from err


class DistillDataModule(L.LightningDataModule):
    """Built from a `DataConfig` (`data:` of the config), or its settings as keywords.
    `cross`: a distill.xtok CrossSetup (cross-tokenizer runs: the teacher's tokens too)."""

    def __init__(self, tokenizer, config: DataConfig | None = None, cross=None, **settings):
        super().__init__()
        cfg = config if config is not None else parse(DataConfig, settings, "data.")
        if config is not None and settings:
            raise ValueError("give a DataConfig or its settings as keywords, not both")
        if cfg.chat_template is not None:
            # the evaluation and the exported tokenizer then use the template the student
            # was trained with
            tokenizer.chat_template = resolve_template(cfg.chat_template)
        self.cfg, self.tokenizer = cfg, tokenizer
        self.train_sources = [s.as_dict() for s in cfg.train]
        self.val_sources = [s.as_dict() for s in cfg.val or []]
        # a val source named like a train one (`name: mine` in both): its examples get ids of
        # their own, else the teacher cache's index of example ids would mix the two
        taken = {source_name(s) for s in self.train_sources}
        for s in self.val_sources:
            if source_name(s) in taken:
                s["ids"] = f"{source_name(s)}@val"
        self.batch_size = cfg.batch_size
        self.val_batch_size = cfg.val_batch_size or cfg.batch_size
        self.max_length, self.packing = cfg.max_length, cfg.packing
        self.options = {"chat_template": tokenizer.chat_template if cfg.chat_template else None,
                        "assistant_turns": cfg.assistant_turns, "cpt_stride": cfg.cpt_stride,
                        "chat_template_kwargs": dict(cfg.chat_template_kwargs or {}),
                        "num_proc": cfg.num_proc}
        if cfg.packing:
            check_packing_support()
        self.cross = cross
        # packed rows are padded to max_length: one shape, which compiled kernels
        # (flex_attention, torch.compile) see once instead of once per batch
        multiple = cfg.max_length if cfg.packing else (cfg.pad_to_multiple_of or 1)
        # `padding` makes the rows a batch; `collate` may wrap it (a cached teacher's targets)
        self.padding = PadCollator(tokenizer.pad_token_id, multiple, cap=cfg.max_length)
        if cross is not None:  # both models' tokens, each padded with its own pad id
            self.padding = cross.collate
            self.options["teacher_max_length"] = cfg.teacher_max_length
        self.collate = self.padding
        self.train_set = self.val_set = self.train_examples = None

    def for_device(self, device_type: str) -> None:
        """Pad unpacked batches as `data.pad_to_multiple_of` says for a run on this device
        (null: distill.data.collate.width_multiple)."""
        if not self.packing:
            self.padding.multiple = width_multiple(self.cfg.pad_to_multiple_of, device_type)

    def setup(self, stage: str | None = None):
        if self.trainer is not None:  # inside a Trainer: its device is known
            self.for_device(self.trainer.strategy.root_device.type)
        if self.train_set is None:
            # one example per row; what a teacher cache is keyed by, packed or not
            self.train_examples = build_dataset(self.train_sources, self.tokenizer,
                                                self.max_length, self.cfg.seed,
                                                stopping_strategy=self.cfg.mix_stopping,
                                                cross=self.cross, **self.options)
            self.train_set = self.train_examples
            if self.packing:  # validation stays one example per row
                self.train_set = pack_dataset(self.train_examples, self.max_length)
        if self.val_set is None and self.val_sources:
            self.val_set = build_dataset(self.val_sources, self.tokenizer, self.max_length,
                                         self.cfg.seed, mix=False, cross=self.cross,
                                         **self.options)

    def train_dataloader(self) -> StepWindows:
        """Each optimizer step's micro-batches as one window, built and counted in the
        loader's workers (distill.data.windows); this rank's share under DDP."""
        trainer = self.trainer
        k = trainer.accumulate_grad_batches if trainer is not None else 1
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        sampler = WindowSampler(len(self.train_set), self.batch_size, k,
                                shuffle=self.cfg.shuffle, seed=self.cfg.seed, rank=rank,
                                world_size=world)
        workers = self.cfg.num_workers
        loader = DataLoader(self.train_set, batch_sampler=sampler, num_workers=workers,
                            collate_fn=WindowCollate(self.collate, self.batch_size),
                            persistent_workers=workers > 0)
        return StepWindows(loader, sampler, k, self.batch_size, world)

    def val_dataloader(self):
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=self.val_batch_size, shuffle=False,
                          collate_fn=self.collate, num_workers=self.cfg.num_workers,
                          persistent_workers=self.cfg.num_workers > 0)
